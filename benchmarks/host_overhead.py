"""Host time per call of the CuTeDSL GDP backend, measured on the CPU (no GPU needed).

    python benchmarks/host_overhead.py [--tokens 256] [--heads 16] [--nh 2] [--calls 300]
                                       [--paths fwd-infer fwd-infer-dense fwd-train bwd] [--ops] [--cprofile PATH]

The backend runs on CPU tensors with every kernel launch a no-op (``_Launch.run``), the platform checks
answering "Hopper" (``unsupported_reason`` -> None, 132 SMs, the value-checks kernel taken like on a GPU),
so what remains is the host work a GPU step pays per call: Python, torch dispatch, allocations, and the
arithmetic of the few torch ops that run on the tensors (small with few tokens: on a GPU they are
launches). Paths (the problem of bench_gdp_fwd.py / bench_gdp_train.py: H = 16, K = V = 128, bf16, qk l2norm):

* ``fwd-infer``: ``backend.one_device_forward(GDPInputs(..., cu_seqlens=[0, T], save_for_backward=False))``
  (bench_gdp_fwd.py: one packed document, inference);
* ``fwd-infer-dense``: the same without cu_seqlens (rows);
* ``fwd-train``: ``torch_api.gated_delta_product`` forward with ``check_inputs=True`` (bench_gdp_train.py);
* ``bwd``: that forward's ``torch.autograd.backward`` (the forward untimed);
* ``fwd-train-packed`` / ``bwd-packed``: the same with cu_seqlens = [0, T];
* ``fwd-train-unchecked`` / ``bwd-unchecked``: the dense forward and backward with ``check_inputs=False``
  (no value checks; non-finite inputs contained: sanitise and poison ops, ``torch_api.gdp.isolation``).

Prints per path: host microseconds per call (median and fastest of ``--calls``), the aten ops the call
dispatches (counted below autograd with a ``TorchDispatchMode``: every op, views included) and the kernel
launches. ``--ops`` lists the ops and the launches per path by name (the unchecked paths take the token-checks
kernel, ``TokenChecksLaunch``, as on a GPU); ``--trace`` lists them in order with the line of
the project that dispatched each; ``--cprofile PATH`` prints the functions with the most own time on
that path; ``--profile`` prints each path's aten ops by self CPU time with their input shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter

# measure the checkout this script is in (the editable install may point at another worktree)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torch_api.gdp.cutedsl as cutedsl  # noqa: E402
import torch_api.gdp.validation as gdp_validation  # noqa: E402
from cp_linear.kernels import launch as kl  # noqa: E402
from torch_api import gated_delta_product  # noqa: E402
from torch_api.gdp.types import GDPInputs  # noqa: E402

PATHS = ("fwd-infer", "fwd-infer-dense", "fwd-train", "bwd", "fwd-train-packed", "bwd-packed", "fwd-train-unchecked",
         "bwd-unchecked")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def cpu_kernels(launches: Counter | None = None):
    """The CuTeDSL backend on CPU tensors as on a Hopper GPU, every launch a no-op (counted by kernel
    in ``launches``): outputs stay ``torch.empty`` garbage, fine for host timing."""
    patches = [(cutedsl, "unsupported_reason", lambda inputs: None), (cutedsl, "_sm_count", lambda device: 132),
               (gdp_validation, "_kernel_platform_ready", lambda device: True)]

    def no_launch(self):
        if launches is not None:
            launches[type(self).__name__] += 1
    patches.append((kl._Launch, "run", no_launch))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched below autograd, by name."""

    def __init__(self, trace: bool = False):
        super().__init__()
        self.ops = Counter()
        self.trace = [] if trace else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        if self.trace is not None:
            self.trace.append((str(func.overloadpacket.__name__), _caller()))
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame of the project (outside this script) on the stack: "path:line function"."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT) and "site-packages" not in path and not path.endswith("host_overhead.py"):
            return f"{os.path.relpath(path, ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def make_calls(tokens: int, heads: int, n_h: int, dim: int = 128) -> dict:
    """path -> (setup, call): ``call(setup())`` is the timed call."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = rand(1, tokens, heads, dim).bfloat16()
    k = torch.nn.functional.normalize(rand(1, tokens * n_h, heads, dim), dim=-1).bfloat16()
    v = rand(1, tokens * n_h, heads, dim).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0)
    beta = torch.sigmoid(rand(1, tokens * n_h, heads))
    do, dfinal = rand(1, tokens, heads, dim).bfloat16(), rand(1, heads, dim, dim)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    infer = {name: GDPInputs(q, k, v, g, beta, dim ** -0.5, n_h, True, packed, save_for_backward=False)
             for name, packed in (("fwd-infer", cu), ("fwd-infer-dense", None))}

    def leaves():
        return [x.detach().requires_grad_() for x in (q, k, v, g, beta)]

    def forward(xs, packed, check=True):
        return gated_delta_product(*xs, num_householder=n_h, cu_seqlens=packed, use_qk_l2norm_in_kernel=True,
                                   backend=backend, check_inputs=check)

    def backward(outputs):
        torch.autograd.backward(outputs, [do, dfinal])

    calls = {name: (lambda: None, lambda _, x=x: backend.one_device_forward(x)) for name, x in infer.items()}
    for suffix, packed in (("", None), ("-packed", cu)):
        calls["fwd-train" + suffix] = (leaves, lambda xs, packed=packed: forward(xs, packed))
        calls["bwd" + suffix] = (lambda packed=packed: forward(leaves(), packed), backward)
    calls["fwd-train-unchecked"] = (leaves, lambda xs: forward(xs, None, False))
    calls["bwd-unchecked"] = (lambda: forward(leaves(), None, False), backward)
    return calls


def host_us(setup, call, calls: int) -> tuple[float, float]:
    """(median, fastest) microseconds of ``call`` after warm-up calls."""
    times = []
    for i in range(calls + 5):
        state = setup()
        start = time.perf_counter()
        call(state)
        elapsed = time.perf_counter() - start
        if i >= 5:
            times.append(elapsed)
        del state
    return statistics.median(times) * 1e6, min(times) * 1e6


def count(setup, call, trace: bool = False) -> tuple[OpCounter, Counter]:
    """(the op counter: aten ops by name and, with trace, in order; launches by kernel) of one call."""
    launches = Counter()
    with cpu_kernels(launches):
        call(setup())  # warm-up: lazy imports, caches
        state = setup()
        launches.clear()
        counter = OpCounter(trace)
        with counter:
            call(state)
    return counter, launches


def profile_table(setup, call, rows: int = 25) -> str:
    """One call under ``torch.profiler`` (shapes recorded): the aten ops with the most self CPU time, per
    input shapes. With many tokens the CPU time of an op roughly follows the bytes it moves, which is what
    the same op costs on a GPU (the kernel launches themselves are no-ops here)."""
    from torch.profiler import ProfilerActivity, profile

    with cpu_kernels():
        call(setup())
        state = setup()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call(state)
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                               max_name_column_width=28, max_shapes_column_width=70)
    return "\n".join("    " + line for line in table.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--paths", nargs="+", default=list(PATHS[:4]), choices=PATHS)
    parser.add_argument("--ops", action="store_true", help="list each path's aten ops by name")
    parser.add_argument("--trace", action="store_true", help="list each path's aten ops in order, with call sites")
    parser.add_argument("--cprofile", choices=PATHS, help="print the functions with most own time on this path")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler table per path: aten ops by self CPU time, grouped by input shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls = make_calls(args.tokens, args.heads, args.nh)
    print(f"T={args.tokens} H={args.heads} K=V=128 n_h={args.nh} bf16, {args.calls} calls, "
          f"{args.threads} thread(s); kernel launches are no-ops")
    print(f"{'path':<18} {'median us':>10} {'fastest us':>11} {'aten ops':>9} {'launches':>9}")
    for path in args.paths:
        setup, call = calls[path]
        counter, launches = count(setup, call, args.trace)
        ops = counter.ops
        with cpu_kernels():
            median, fastest = host_us(setup, call, args.calls)
        print(f"{path:<18} {median:>10.0f} {fastest:>11.0f} {sum(ops.values()):>9} {sum(launches.values()):>9}",
              flush=True)
        if args.ops:
            print("    " + ", ".join(f"{name} {n}" for name, n in ops.most_common()))
            print("    launches: " + ", ".join(f"{name} {n}" for name, n in launches.most_common()))
        for name, site in counter.trace or ():
            print(f"    {name:<18} {site}")
        if args.profile:
            print(profile_table(setup, call))
    if args.cprofile:
        setup, call = calls[args.cprofile]
        with cpu_kernels():
            host_us(setup, call, 5)
            profiler = cProfile.Profile()
            for _ in range(50):
                state = setup()
                profiler.enable()
                call(state)
                profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
