"""Host work of one GDP training step on the CuTeDSL backend, counted on the CPU (no GPU needed).

    python benchmarks/host_ops_gdp_step.py [--tokens 8192] [--heads 16] [--no-check-inputs]
                                           [--cu-seqlens 0,2048,4096,6144,8192] [--steps 20]

The step is the one of profile_gdp_step.py (H = 16, K = V = 128, n_h = 2, bf16, qk l2norm in the
kernel, loss <o, dO> + <S_T, dS>) through ``torch_api.gated_delta_product`` with
``CuTeDSLGatedDeltaProductCPBackend(backward="kernels")``. On a GPU that step is host-bound (8.1 ms
back to back against 2.4 ms of kernels at 8k on an H200), so the count of host ops is the number
to cut. Here the backend is made to take CPU tensors (``unsupported_reason`` -> None, 132 SMs) and
every kernel launch is a no-op (outputs stay ``torch.empty`` garbage: fine for counting).

Prints: top-level aten ops per step (ops with no aten op above them: what the host dispatches),
kernel launches (``_Launch.run`` calls), both per phase, and the host wall time per step (median
after warm-up). The wall time includes the CPU doing the ops' arithmetic on full-size tensors
(value checks, casts, copies), which a GPU would do asynchronously; ``--tokens 256 --heads 2``
makes that negligible and leaves the dispatch cost.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter

# measure the checkout this script is in (the editable install may point at another worktree)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import torch_api.gdp.cutedsl as cutedsl  # noqa: E402
import torch_api.gdp.ops as gdp_ops  # noqa: E402
from cp_linear.kernels import launch as kl  # noqa: E402
from torch_api import gated_delta_product  # noqa: E402

# functions timed as phases: (object, attribute, phase name); an op belongs to its innermost phase
PHASES = (
    (kl, "forward_layout", "forward layout"),
    (gdp_ops, "gdp_value_flags", "value checks"),
    (gdp_ops, "PendingValueChecks", "value checks"),
    (cutedsl.CuTeDSLGatedDeltaProductCPBackend, "cp_forward_prepare", "forward prepare"),
    (cutedsl.CuTeDSLGatedDeltaProductCPBackend, "cp_forward_apply", "forward apply"),
    (cutedsl.CuTeDSLGatedDeltaProductCPBackend, "cp_backward_prepare", "backward prepare"),
    (cutedsl.CuTeDSLGatedDeltaProductCPBackend, "cp_backward_apply", "backward apply"),
)
OUTSIDE = "outside the backend (op wrapper, autograd)"


def _in_phase(function, name: str):
    def wrapped(*args, **kwargs):
        with record_function(f"phase: {name}"):
            return function(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def cpu_kernels(launches: Counter, phased: bool):
    """The CuTeDSL backend on CPU tensors with no-op launches (counted by kernel); with ``phased``,
    the PHASES functions run inside profiler ranges."""
    saved = [(cutedsl, "unsupported_reason"), (cutedsl, "_sm_count"), (kl._Launch, "run")]
    if phased:
        saved += [(owner, attribute) for owner, attribute, _ in PHASES]
    originals = [(owner, attribute, owner.__dict__[attribute]) for owner, attribute in saved]

    def no_launch(self):
        launches[type(self).__name__] += 1

    cutedsl.unsupported_reason = lambda inputs: None
    cutedsl._sm_count = lambda device: 132
    kl._Launch.run = no_launch
    if phased:
        for owner, attribute, name in PHASES:
            setattr(owner, attribute, _in_phase(getattr(owner, attribute), name))
    try:
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def make_step(tokens: int, heads: int, n_h: int, check_inputs: bool, cu_seqlens: list[int] | None):
    gen = torch.Generator().manual_seed(tokens)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rand(1, tokens, heads, 128).bfloat16()
    k = rand(1, tokens * n_h, heads, 128).bfloat16()
    v = rand(1, tokens * n_h, heads, 128).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0)
    beta = torch.sigmoid(rand(1, tokens * n_h, heads))
    sequences = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    do, dfinal = rand(1, tokens, heads, 128).bfloat16(), rand(sequences, heads, 128, 128)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")

    def step():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        o, final = gated_delta_product(*leaves, num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                       backend=backend, check_inputs=check_inputs)
        torch.autograd.backward([o, final], [do, dfinal])
    return step


def _phase_of(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("phase: "):
            return parent.name.removeprefix("phase: ")
        parent = parent.cpu_parent
    return OUTSIDE


def _has_aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def count_ops(step) -> tuple[Counter, Counter, Counter]:
    """One profiled step -> (top-level aten ops by phase, launches by phase, top-level aten ops by name)."""
    with cpu_kernels(Counter(), phased=True):
        step()  # warm-up (lazy imports, caches)

        def marked_launch(self):
            with record_function("launch"):
                pass
        kl._Launch.run = marked_launch  # cpu_kernels restores the original
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    ops, launches, by_name = Counter(), Counter(), Counter()
    for event in prof.events():
        if event.name == "launch":
            launches[_phase_of(event)] += 1
        elif event.name.startswith("aten::") and not _has_aten_parent(event):
            ops[_phase_of(event)] += 1
            by_name[event.name] += 1
    return ops, launches, by_name


def wall_ms(step, steps: int) -> tuple[float, float]:
    """(median, fastest) host wall time per step (ms) after two warm-up steps, no profiler."""
    with cpu_kernels(Counter(), phased=False):
        for _ in range(2):
            step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--check-inputs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cu-seqlens", default=None,
                        help="packed documents: comma-separated boundaries from 0 to --tokens (0,2048,4096,6144,8192)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--top", type=int, default=15, help="most frequent ops to list")
    args = parser.parse_args()
    cu = None if args.cu_seqlens is None else [int(x) for x in args.cu_seqlens.split(",")]
    if cu is not None and (cu[0] != 0 or cu[-1] != args.tokens):
        parser.error(f"--cu-seqlens must run from 0 to --tokens = {args.tokens}; received {cu}")
    step = make_step(args.tokens, args.heads, args.nh, args.check_inputs, cu)
    by_phase, launches, by_name = count_ops(step)
    print(f"T={args.tokens} H={args.heads} n_h={args.nh} check_inputs={args.check_inputs} "
          f"cu_seqlens={args.cu_seqlens or 'None (dense)'}")
    print(f"top-level aten ops per fwd+bwd step: {sum(by_phase.values())}")
    print(f"kernel launches (_Launch.run) per step: {sum(launches.values())}")
    print("per phase (aten ops, launches):")
    for phase in sorted(set(by_phase) | set(launches), key=lambda p: -by_phase[p]):
        print(f"  {phase:<45} {by_phase[phase]:>4} {launches[phase]:>3}")
    common = ", ".join(f"{name.removeprefix('aten::')} {count}" for name, count in by_name.most_common(args.top))
    print(f"most frequent top-level ops: {common}")
    median, fastest = wall_ms(step, args.steps)
    print(f"host wall time per step: {median:.2f} ms median, {fastest:.2f} ms fastest of {args.steps} "
          "(CPU arithmetic included)")


if __name__ == "__main__":
    main()
