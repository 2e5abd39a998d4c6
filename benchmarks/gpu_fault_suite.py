"""The fault suite (tests/faults) over NCCL: one process per GPU, then the JAX and one-device cases.

    python3 benchmarks/gpu_fault_suite.py --out DIR          (from the repository root, 2 GPUs)

1. Every torch case of tests/faults/cases.py runs once at world 2 (``--world``) in a pool of NCCL ranks
   (``tests.gloo_pool.GlooPool(backend="nccl")``, rank r on GPU r, tensors on ``cuda:r``), checked
   exactly as the gloo suite checks it, then a correct all-reduce and agreement header show that the
   group still works (a broken group is replaced, so one failure cannot spill into the next case).
2. ``pytest tests/faults/test_one_device_faults.py tests/faults/test_jax_faults.py`` in a subprocess
   (JAX on the GPUs; cases that need 3 devices skip on 2 GPUs).
Nothing can hang: every collective times out (``--collective-timeout``, NCCL's watchdog then ends the
rank), every case has a task timeout, the pytest step has one; every rank runs the same collectives
in the same order. NVLink multicast (NVLS) stays off. Writes DIR/gpu_fault_suite.log; exit status 1
when any case failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out", help="directory for gpu_fault_suite.log")
    parser.add_argument("--world", type=int, default=2, help="NCCL ranks, one per GPU")
    parser.add_argument("--collective-timeout", type=float, default=20.0, help="seconds per collective")
    parser.add_argument("--task-timeout", type=float, default=90.0, help="seconds per case")
    parser.add_argument("--pytest-timeout", type=float, default=600.0, help="seconds for the JAX/one-device step")
    parser.add_argument("--skip-pytest", action="store_true", help="only the NCCL cases")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                        help="gloo runs the same script on CPU ranks (a dry run of this script)")
    args = parser.parse_args()
    if args.backend == "nccl":
        os.environ["CP_LINEAR_FAULT_DEVICE"] = "cuda"  # read by tests.faults.cases.device in every rank
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "gpu_fault_suite.log", "w", buffering=1)

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")

    import torch

    from tests.faults.cases import CASES, healthy, problems_of
    from tests.gloo_pool import GlooPool

    say(f"torch {torch.__version__}, backend {args.backend}, {torch.cuda.device_count()} GPU(s): "
        f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
    if args.backend == "nccl" and torch.cuda.device_count() < args.world:
        say(f"FAIL: needs {args.world} GPUs")
        return 1
    failures = 0
    pool = GlooPool(args.world, backend=args.backend, collective_timeout_s=args.collective_timeout)
    seen = set()
    try:
        for case in CASES:
            if (case.fault_class, case.name) in seen:
                continue
            seen.add((case.fault_class, case.name))
            case = dataclasses.replace(case, world=args.world)
            started = time.monotonic()
            try:
                outcome = pool.run_collect(case.fn, *case.args, timeout=args.task_timeout)
                problems = problems_of(case, outcome, time.monotonic() - started)
            except TimeoutError as err:  # the pool restarted itself
                outcome, problems = None, [str(err)]
            elapsed = time.monotonic() - started
            try:
                usable = pool.run(healthy, timeout=args.task_timeout) == [True] * args.world
            except (AssertionError, TimeoutError):
                usable = False
            if not usable:
                pool.restart()
                problems.append("the process group was unusable afterwards (restarted)")
            failures += bool(problems)
            detail = "; ".join(problems) if problems else _summary(outcome)
            say(f"{'FAIL' if problems else 'ok  '} {case.id:60s} {elapsed:6.1f} s  {detail[:400]}")
    finally:
        pool.close(kill=True)
    say(f"{args.backend} cases: {len(seen) - failures} passed, {failures} failed")

    if not args.skip_pytest:
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("CP_LINEAR_FAULT_DEVICE", None)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                   "tests/faults/test_one_device_faults.py", "tests/faults/test_jax_faults.py"]
        say("$ " + " ".join(command[2:]))
        try:
            result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                    timeout=args.pytest_timeout)
            say(result.stdout[-20000:] + result.stderr[-4000:])
            failures += result.returncode != 0
        except subprocess.TimeoutExpired:
            say(f"FAIL: pytest step timed out after {args.pytest_timeout} s")
            failures += 1
    say("RESULT: " + ("all passed" if not failures else f"{failures} failure(s)"))
    return 1 if failures else 0


def _summary(outcome) -> str:
    first_ok, first = outcome[0]
    return "ok on every rank" if first_ok else f"ValueError on every rank: {first.message[:200]}"


if __name__ == "__main__":
    sys.exit(main())
