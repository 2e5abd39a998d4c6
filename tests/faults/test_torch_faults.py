"""The fault suite over gloo (torch): issue 16's seven classes, one test per class, each case on 2-3 ranks.

Every case must end, within seconds, either with the same ValueError on every rank (then a correct
collective must still work) or with results equal to the one-device op (tests/faults/cases.py).
Collectives time out after 20 s and tasks after 90 s, so a hang fails the test instead of CI.
The same cases run over NCCL on GPUs with benchmarks/gpu_fault_suite.py.
"""

import time

import pytest

from tests.faults.cases import CASES, problems_of, healthy

pytestmark = pytest.mark.multirank
TASK_TIMEOUT_S = 90


def run_case(fault_pools, case):
    """Run ``case`` on every rank, check its outcome, then check the group still works. A broken group
    (a timed-out or mismatched collective) is replaced, so the next case starts clean either way."""
    pool = fault_pools(case.world)
    started = time.monotonic()
    try:
        outcome = pool.run_collect(case.fn, *case.args, timeout=TASK_TIMEOUT_S)
    except TimeoutError as err:  # a hang or a dead rank: the pool has been restarted
        pytest.fail(f"{case.id}: {err}")
    problems = problems_of(case, outcome, time.monotonic() - started)
    try:
        usable = pool.run(healthy, timeout=TASK_TIMEOUT_S) == [True] * case.world
    except (AssertionError, TimeoutError):
        usable = False
    if not usable:
        pool.restart()
        problems.append("the process group was unusable afterwards")
    assert not problems, f"{case.id}: " + "; ".join(problems)


def cases_of(fault_class):
    return [pytest.param(case, id=case.id) for case in CASES if case.fault_class == fault_class]


@pytest.mark.parametrize("case", cases_of(1))
def test_class1_ranks_with_different_packed_ids_raise_together(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(2))
def test_class2_layer_or_model_configuration_mismatch_raises_before_the_first_exchange(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(3))
def test_class3_check_inputs_differing_across_ranks_raises_instead_of_aborting(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(4))
def test_class4_a_later_call_that_changes_on_one_rank_raises_instead_of_hanging(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(5))
def test_class5_nonfinite_values_raise_when_checked_and_stay_in_their_document_otherwise(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(6))
def test_class6_out_of_domain_inputs_raise_on_every_rank(fault_pools, case):
    run_case(fault_pools, case)


@pytest.mark.parametrize("case", cases_of(7))
def test_class7_edited_metadata_raises_on_every_rank(fault_pools, case):
    run_case(fault_pools, case)


def test_every_class_has_cases_on_two_and_three_ranks():
    for fault_class in range(1, 8):
        worlds = {case.world for case in CASES if case.fault_class == fault_class}
        assert worlds == {2, 3}, (fault_class, worlds)
