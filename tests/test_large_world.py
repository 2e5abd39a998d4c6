"""CP at world sizes 6 and 8 on gloo (issue 8's CPU share): GDP with documents spanning at least three
ranks, and block-diagonal attention with one document over every rank (halo impossible, so the
needed-only all-to-all-v runs). The same checks as the world 1-4 tests, at a size GPUs would use."""

import numpy as np
import pytest

from cp_linear import build_blockdiag_plan
from tests.tolerance import assert_close, attention_length, tolerance
from tests.torch_api import test_blockdiag as blockdiag_tests
from tests.torch_api import test_gdp_cp as gdp_tests

pytestmark = pytest.mark.multirank


def gdp_cases(world):
    total, local = world * gdp_tests.LOCAL_LEN, gdp_tests.LOCAL_LEN
    layouts = {
        "document-spans-every-rank": [3, total - 5, 2],
        "documents-span-three-ranks": [2 * local + 5, local - 5, 2 * local + 3, total - 5 * local - 3],
    }
    flavours = [(2, True, 8), (3, False, 64)]
    return [dict(name=name, lengths=lengths, batch=1, seed=800 + i, num_householder=n_h, l2norm=l2, chunk_size=chunk)
            for i, ((name, lengths), (n_h, l2, chunk)) in enumerate(zip(layouts.items(), flavours))]


@pytest.mark.parametrize("world", [6, 8])
def test_gdp_cp_at_large_world_matches_float64_and_one_device(gloo_pools, world):
    cases = gdp_cases(world)
    for case in cases:
        metadata_spans = max(stop - start for start, stop in _rank_ranges(case["lengths"], world))
        assert metadata_spans >= 3, case["name"]
    per_rank = gloo_pools(world).run(gdp_tests.run_cases, cases)
    for index, case in enumerate(cases):
        gdp_tests.check_every_rank([per_rank[rank][index] for rank in range(world)], case, world)


def _rank_ranges(lengths, world):
    from cp_linear import build_packed_sequence_cp_metadata
    from tests.cp_linear.gdp_cases import seq_idx_from_lengths

    ids = seq_idx_from_lengths(lengths)
    for rank in range(world):
        md = build_packed_sequence_cp_metadata(ids, rank, world)
        yield md.preceding_rank_start, md.following_rank_stop


@pytest.mark.parametrize("world", [6, 8])
def test_blockdiag_a2a_with_one_document_over_every_rank(gloo_pools, world):
    docs = blockdiag_tests.docs
    cases = [
        blockdiag_tests.Case("single_document_over_all_ranks", docs((1, 4 * world)), q_heads=4, kv_heads=2, seed=1),
        blockdiag_tests.Case("long_document_and_padding", docs((0, 3), (1, 3 * world), (0, 2), (2, world - 5)),
                             q_heads=2, kv_heads=1, batch=2, seed=2),
    ]
    assert not build_blockdiag_plan(np.array(cases[0].doc_ids), world).use_halo
    per_rank = gloo_pools(world).run(blockdiag_tests.run_cases, cases)
    index = 0
    for case in cases:
        ref_out, ref_grads = blockdiag_tests.full_sequence_references(case)
        tol = tolerance(attention_length(len(case.doc_ids), case.head_dim))
        for mode in blockdiag_tests.modes_for(case, world):
            ranks = [results[index] for results in per_rank]
            index += 1
            out = np.concatenate([r["out"] for r in ranks], axis=1)
            assert_close(f"{case.name} {mode}", ref_out, out, tol)
            for slot, ref_grad in enumerate(ref_grads):
                grad = np.concatenate([r["grads"][slot] for r in ranks], axis=1)
                assert_close(f"{case.name} {mode} d{'qkv'[slot]}", ref_grad, grad, tol)
