"""Where a GDP training step's time goes beyond the kernels: aten ops by GPU time, host syncs with
the Python line that caused them, and wall vs kernel time with and without ``check_inputs``.

    python benchmarks/profile_gdp_step.py [--tokens 8192 32768] [--out DIR] [--host [--unchecked]] [--sync-debug]

``--host``: the host's time per step split by phase (perf_counter around the backend's four
functions, the value checks, the containment's parts and every kernel launch: its Python preparation and
the TVM-FFI call, by kernel), without the profiler, whose own per-event cost distorts host time;
``--unchecked`` adds the contained step (``check_inputs=False``). ``--sync-debug``: one step of each
variant under ``torch.cuda.set_sync_debug_mode("warn")``, printing every synchronising call torch sees
with the project's lines on its stack (the checked step reads its flags once, by design).

Same step as bench_gdp_train.py (one sequence, H = 16, K = V = 128, n_h = 2, bf16, l2norm, loss
<o, dO> + <S_T, dS>) on the CuTeDSL backend. Writes a Chrome trace per size to DIR.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
from _bench_common import time_ms  # the benchmarks' timer (benchmarks/ is the script's directory)
from torch.profiler import ProfilerActivity, profile

from torch_api import gated_delta_product
from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

# host calls that wait for the GPU (a sync leaves the GPU idle while Python catches up)
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
               "aten::item", "aten::nonzero")


def make_step(tokens: int, nh: int, heads: int, check_inputs: bool):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q = rand(1, tokens, heads, 128).bfloat16()
    k = rand(1, tokens * nh, heads, 128).bfloat16()
    v = rand(1, tokens * nh, heads, 128).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0)
    beta = torch.sigmoid(rand(1, tokens * nh, heads))
    do, dfinal = rand(1, tokens, heads, 128).bfloat16(), rand(1, heads, 128, 128)
    backend = CuTeDSLGatedDeltaProductCPBackend(backward="kernels")

    def step():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        o, final = gated_delta_product(*leaves, num_householder=nh, use_qk_l2norm_in_kernel=True, backend=backend,
                                       check_inputs=check_inputs)
        torch.autograd.backward([o, final], [do, dfinal])
    return step


def profile_step(step, tokens: int, out: str) -> None:
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(out, f"trace_{tokens}.json"))
    averages = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"\n== T={tokens}: kernel time {kernel_ms:.3f} ms; aten ops by GPU time (incl. children)")
    ops = [e for e in averages if e.key.startswith("aten::") and e.device_time_total > 0]
    for e in sorted(ops, key=lambda e: -e.device_time_total)[:25]:
        print(f"  {e.key:<40} calls {e.count:>4}  gpu {e.device_time_total / 1e3:8.3f} ms  cpu {e.cpu_time_total / 1e3:8.3f} ms")
    print(f"== T={tokens}: host syncs (with the Python lines that issued them)")
    for e in prof.key_averages(group_by_stack_n=6):
        if e.key in SYNC_EVENTS:
            stack = " <- ".join(line for line in e.stack if "cp_linear" in line or "torch_api" in line or "bench" in line)
            print(f"  {e.key:<28} x{e.count:<3} cpu {e.cpu_time_total / 1e3:7.3f} ms  {stack[:400]}")


def host_split(step, repeat: int = 20) -> None:
    """Host milliseconds per step by phase: each wrapped function's inclusive time (nested phases
    are also inside their callers), with the device synchronised before each step so that no host
    call waits for the GPU."""
    import torch_api.gdp.ops as ops
    from cp_linear.kernels import launch as kl
    from cp_linear.kernels.cache import compiled

    spent = defaultdict(float)
    counts = defaultdict(int)
    restore = []

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started
                counts[label] += 1

        restore.append((owner, name, original))
        setattr(owner, name, timed)

    def run(launch):  # replaces _Launch.run: preparation and the FFI call timed apart
        started = time.perf_counter()
        function, arguments = compiled(launch.config), launch.arguments()
        called = time.perf_counter()
        function(*arguments)
        spent["launch: prepare arguments"] += called - started
        spent["launch: TVM-FFI call"] += time.perf_counter() - called
        counts["launch: TVM-FFI call"] += 1
        label = f"  TVM-FFI call: {type(launch).__name__}"
        spent[label] += time.perf_counter() - called
        counts[label] += 1

    backend_cls = CuTeDSLGatedDeltaProductCPBackend
    for name in ("cp_forward_prepare", "cp_forward_apply", "cp_backward_prepare", "cp_backward_apply", "_shard",
                 "_saved_shard", "_reverse"):
        wrap(backend_cls, name, f"backend.{name}")
    wrap(ops, "gdp_value_flags", "value checks (flags)")
    for name in ("contained_inputs", "token_poison", "sequence_bad", "poison"):  # check_inputs=False only
        wrap(ops, name, f"containment: {name}")
    restore.append((kl._Launch, "run", kl._Launch.run))
    kl._Launch.run = run
    try:
        step()
        torch.cuda.synchronize()
        spent.clear()
        counts.clear()
        total = 0.0
        for _ in range(repeat):
            torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            total += time.perf_counter() - started
        torch.cuda.synchronize()
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
    print(f"host ms per step (mean of {repeat}): whole step {1e3 * total / repeat:.3f}")
    for label, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {label:<36} {1e3 * seconds / repeat:7.3f} ms  ({counts[label] // repeat} calls)")


def sync_calls(step) -> None:
    """One step (after a warm-up) under ``torch.cuda.set_sync_debug_mode("warn")``: each synchronising call
    torch reports (a host read, a blocking copy, a synchronize), with the project's lines on its stack."""
    import traceback
    import warnings

    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):  # the stack at the warning: the Python lines that made the call
            stack = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                     if any(part in f.filename for part in ("cp_linear", "torch_api", "benchmarks"))]
            found.append(f"{str(message)[:80]}  <- {' <- '.join(reversed(stack[:-1]))[:400]}")

    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for line in found:
        print(f"  {line}")
    print(f"  {len(found)} synchronising call(s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out", default="out/profile_gdp_step")
    parser.add_argument("--host", action="store_true", help="only the host time split by phase (no profiler)")
    parser.add_argument("--unchecked", action="store_true", help="--host: also the contained step (check_inputs=False)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="only the synchronising calls of one step per variant (torch.cuda.set_sync_debug_mode)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for tokens in args.tokens:
        if args.sync_debug:
            for check in (True, False):
                print(f"== T={tokens}, check_inputs={check}: synchronising calls")
                sync_calls(make_step(tokens, args.nh, args.heads, check))
            continue
        if args.host:
            for check in (True, False) if args.unchecked else (True,):
                print(f"== T={tokens}, check_inputs={check}")
                host_split(make_step(tokens, args.nh, args.heads, check))
            continue
        for check in (True, False):
            step = make_step(tokens, args.nh, args.heads, check)
            print(f"T={tokens} check_inputs={check}: wall {time_ms(step, 10, warmup=2):.3f} ms per fwd+bwd", flush=True)
        profile_step(make_step(tokens, args.nh, args.heads, True), tokens, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
