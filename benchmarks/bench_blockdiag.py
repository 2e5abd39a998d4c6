"""Benchmark block-diagonal attention under CP: kernel candidates and exchange modes.

    python benchmarks/bench_blockdiag.py                  # on a GPU machine (H200), < 3 minutes
    python benchmarks/bench_blockdiag.py --device cpu --smoke   # tiny CPU run that exercises every path

Part 1 (one GPU): the attention of one rank's shard over its key window, for each kernel candidate
("sdpa" at a few query-chunk sizes, "sdpa" pinned to the efficient / cuDNN backends, compiled
"flex"), forward and forward+backward. Each candidate is first checked on a scaled-down copy of the
problem against the CPU-exact path (``kernel="sdpa"`` on CPU in float32) and at full size against
the default candidate; a candidate that fails a check or raises is reported, not timed.
Part 2 (>= 2 GPUs, NCCL): every exchange mode end to end on real ranks (exchange alone and the whole
``blockdiag_attention``), with the bytes each mode moves (``cp_linear.exchange_bytes``).
Times: CUDA events, warm-up, then the median of ``--iters`` (>= 10) runs; part 2 reports the slowest rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_common import time_ms  # noqa: E402
from cp_linear import build_blockdiag_plan, exchange_bytes  # noqa: E402
from torch_api.attention.kernel import DocCausalLayout, attention_flops, doc_causal_attention  # noqa: E402

BF16_TOLERANCE = 2e-2  # relative L2 error vs float32 CPU-exact path, for bf16 kernels


@dataclass(frozen=True)
class Shape:
    local_len: int
    cp_size: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def doc_layout(kind: str, tokens: int, local_len: int, seed: int = 0) -> np.ndarray:
    """doc ids [T]: "short" = documents of 1/64 .. 1/4 of L; "long" = one document over ~2.5 shards
    (so halo is impossible) among short ones. A little padding between some documents and at the end."""
    rng = np.random.default_rng(seed)
    ids, doc, cursor = np.zeros(tokens, np.int64), 1, 0
    if kind == "long":
        start, length = local_len // 3, int(2.5 * local_len)
        ids[start:start + length] = doc
        doc, cursor = doc + 1, start + length
        ids[:start] = 0
        head = 0
        while head < start:  # short documents before the long one
            length = min(int(rng.integers(max(1, local_len // 64), max(2, local_len // 8))), start - head)
            ids[head:head + length] = doc
            doc, head = doc + 1, head + length
    while cursor < tokens - max(1, tokens // 100):
        length = int(rng.integers(max(1, local_len // 64), max(2, local_len // 4)))
        stop = min(cursor + length, tokens - max(1, tokens // 100))
        ids[cursor:stop] = doc
        doc, cursor = doc + 1, stop + (int(rng.integers(0, 3)) if rng.random() < 0.2 else 0)
    return ids


# --------------------------------------------------------------------------- timing


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """CUDA events on a GPU (``_bench_common.time_ms``), the wall clock on the CPU."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return time_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Deadline:
    def __init__(self, seconds: float):
        self.stop = time.monotonic() + seconds

    def left(self) -> float:
        return self.stop - time.monotonic()


# --------------------------------------------------------------------------- part 1: kernels


def candidates(device: torch.device):
    """name -> (kernel, chunk_size, context manager factory)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {"sdpa": ("sdpa", None, contextlib.nullcontext)}
    if device.type == "cuda":
        found["sdpa/chunk512"] = ("sdpa", 512, contextlib.nullcontext)
        found["sdpa/chunk8192"] = ("sdpa", 8192, contextlib.nullcontext)
        found["sdpa/efficient"] = ("sdpa", None, lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
        found["sdpa/cudnn"] = ("sdpa", None, lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))
        found["flex"] = ("flex", None, contextlib.nullcontext)
    else:
        found["sdpa/chunk64"] = ("sdpa", 64, contextlib.nullcontext)
    return found


def rank_problem(kind: str, shape: Shape, device: torch.device, seed: int = 0):
    """The busiest rank's problem (largest key window): layout, q, k, v, grad_out."""
    tokens = shape.local_len * shape.cp_size
    ids = doc_layout(kind, tokens, shape.local_len, seed)
    plan = build_blockdiag_plan(ids, shape.cp_size)
    rank = max(range(shape.cp_size), key=plan.needed_len)
    layout = DocCausalLayout.from_doc_ids(ids, rank * shape.local_len, shape.local_len, plan.s_first[rank],
                                          plan.real_end[rank])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.batch, shape.local_len, shape.q_heads, shape.head_dim, generator=gen)
    k = torch.randn(shape.batch, layout.key_len, shape.kv_heads, shape.head_dim, generator=gen)
    v = torch.randn(shape.batch, layout.key_len, shape.kv_heads, shape.head_dim, generator=gen)
    grad_out = torch.randn(q.shape, generator=gen)
    return layout, [t.to(device, shape.dtype) for t in (q, k, v, grad_out)], plan, rank


def run_candidate(layout, tensors, kernel, chunk_size, context, backward: bool):
    q, k, v, grad_out = tensors
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    with context():
        out = doc_causal_attention(*leaves, layout, kernel=kernel, chunk_size=chunk_size)
        if backward:
            out.backward(grad_out)
    return out, [leaf.grad for leaf in leaves]


def check_candidate(name, spec, kind, shape: Shape, device) -> str | None:
    """Scaled-down problem on the device vs the CPU-exact path (float32). None when it passes."""
    small = Shape(max(256, shape.local_len // 8), shape.cp_size, 1, max(2, shape.q_heads // 4),
                  max(1, shape.kv_heads // 4), shape.head_dim, shape.dtype)
    layout, tensors, _, _ = rank_problem(kind, small, device, seed=1)
    kernel, chunk_size, context = spec
    out, grads = run_candidate(layout, tensors, kernel, chunk_size, context, backward=True)
    cpu = [t.detach().float().cpu() for t in tensors]
    ref, ref_grads = run_candidate(layout, cpu, "sdpa", None, contextlib.nullcontext, backward=True)
    tolerance = BF16_TOLERANCE if shape.dtype in (torch.bfloat16, torch.float16) else 1e-4
    errors = [rel_error(out, ref)] + [rel_error(g, r) for g, r in zip(grads, ref_grads)]
    if not all(e <= tolerance for e in errors):
        return f"check failed: rel errors out/dq/dk/dv = {', '.join(f'{e:.1e}' for e in errors)}"
    return None


def bench_kernels(args, shape: Shape, device: torch.device, deadline: Deadline) -> None:
    print(f"\n## Part 1: kernels on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    print(f"B={shape.batch} L={shape.local_len} Hq={shape.q_heads} Hkv={shape.kv_heads} D={shape.head_dim} "
          f"{shape.dtype} (busiest rank of cp={shape.cp_size}); median of {args.iters} after {args.warmup} warm-up")
    print("| layout | keys | kernel | fwd ms | fwd+bwd ms | fwd TFLOP/s | check |")
    print("|---|---|---|---|---|---|---|")
    best: dict[str, tuple[float, str]] = {}
    for kind in ("short", "long"):
        layout, tensors, _, _ = rank_problem(kind, shape, device)
        flops = attention_flops(layout, shape.batch, shape.q_heads, shape.head_dim)
        reference = None
        for name, spec in candidates(device).items():
            row = f"| {kind} | {layout.key_len} | {name} |"
            if deadline.left() < args.reserve_s:
                print(f"{row} skipped: time budget | | | |")
                continue
            try:
                problem = check_candidate(name, spec, kind, shape, device)
                if problem is None:
                    out, _ = run_candidate(layout, tensors, *spec, backward=False)
                    if reference is None:
                        reference = out
                    elif rel_error(out, reference) > BF16_TOLERANCE:
                        problem = f"full-size output differs from {list(candidates(device))[0]}"
                if problem is not None:
                    print(f"{row} | | | {problem} |")
                    continue
                fwd = median_ms(lambda: run_candidate(layout, tensors, *spec, backward=False), device,
                                args.warmup, args.iters)
                both = median_ms(lambda: run_candidate(layout, tensors, *spec, backward=True), device,
                                 args.warmup, args.iters)
            except Exception as err:  # an unavailable backend is a result, not a crash
                print(f"{row} | | | unavailable: {type(err).__name__}: {str(err).splitlines()[0][:90]} |")
                continue
            print(f"{row} {fwd:.3f} | {both:.3f} | {flops / fwd / 1e9:.1f} | ok |")
            if kind not in best or both < best[kind][0]:
                best[kind] = (both, name)
    for kind, (ms, name) in best.items():
        print(f"fastest fwd+bwd on '{kind}': {name} ({ms:.3f} ms)")
    print("kernel='auto' uses flex on CUDA; override with CP_LINEAR_BLOCKDIAG_KERNEL=sdpa|flex")


# --------------------------------------------------------------------------- part 2: exchanges


def exchange_worker(rank, world, port, args, shape: Shape, backend: str, results):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # renamed collectives in newer torch

    from torch_api.attention.blockdiag import blockdiag_attention, exchange_window, prepare_blockdiag
    from torch_api.attention.exchange import stack_kv

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from datetime import timedelta

    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    group = dist.group.WORLD
    rows = []
    try:
        tokens = shape.local_len * world
        for kind in ("short", "long"):
            ids = torch.from_numpy(doc_layout(kind, tokens, shape.local_len))
            gen = torch.Generator().manual_seed(11)
            full = [torch.randn(shape.batch, tokens, h, shape.head_dim, generator=gen)
                    for h in (shape.q_heads, shape.kv_heads, shape.kv_heads, shape.q_heads)]
            local = slice(rank * shape.local_len, (rank + 1) * shape.local_len)
            q, k, v, grad_out = [t[:, local].to(device, shape.dtype) for t in full]
            plan = build_blockdiag_plan(ids.numpy(), world)
            outputs = {}
            for mode in ("allgather", "halo", "a2a"):
                if mode == "halo" and not plan.use_halo:
                    rows.append((kind, mode, None, "impossible: a document reaches back more than L"))
                    continue
                routing = prepare_blockdiag(ids, group, mode)
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                def attention(backward, leaves=leaves, routing=routing):
                    out = blockdiag_attention(*leaves, routing, cp_group=group, kernel=args.exchange_kernel)
                    if backward:
                        out.backward(grad_out)
                    return out

                def exchange(backward, leaves=leaves, routing=routing):
                    window = exchange_window(routing, stack_kv(leaves[1], leaves[2]))
                    if backward:
                        window.backward(torch.ones_like(window))

                outputs[mode] = attention(False).detach()
                timings = [median_ms(lambda f=f, b=b: f(b), device, args.warmup, args.iters)
                           for f in (exchange, attention) for b in (False, True)]
                rows.append((kind, mode, timings, None))
            errors = {mode: rel_error(out, outputs["allgather"]) for mode, out in outputs.items()}
            rows.append((kind, "check", errors, None))
            rows.append((kind, "bytes", {mode: exchange_bytes(plan, mode, batch=shape.batch, kv_heads=shape.kv_heads,
                                                              head_dim=shape.head_dim,
                                                              itemsize=torch.finfo(shape.dtype).bits // 8)
                                         for mode in outputs}, None))
        # slowest rank per timing
        for index, (kind, mode, timings, note) in enumerate(rows):
            if mode not in ("check", "bytes") and timings is not None:
                t = torch.tensor(timings, dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                rows[index] = (kind, mode, t.tolist(), note)
        if rank == 0:
            results.put(("ok", rows))
    except Exception as err:
        results.put(("error", f"rank {rank}: {type(err).__name__}: {err}"))
        raise
    finally:
        dist.destroy_process_group()


def bench_exchanges(args, shape: Shape, device: torch.device, deadline: Deadline) -> None:
    import multiprocessing as mp

    if device.type == "cuda":
        world = min(torch.cuda.device_count(), args.max_world)
        backend = "nccl"
    else:
        world, backend = 2, "gloo"
    print(f"\n## Part 2: exchange modes, {world} ranks ({backend}), L={shape.local_len} per rank, "
          f"kernel={args.exchange_kernel}")
    if world < 2:
        print("skipped: needs at least 2 GPUs (run on a multi-GPU machine, e.g. nvidia-h200-x2)")
        return
    if deadline.left() < args.reserve_s:
        print("skipped: time budget")
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=exchange_worker, args=(r, world, port, args, shape, backend, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        status, payload = results.get(timeout=max(10.0, deadline.left()))
    except Exception:
        status, payload = "error", "timed out"
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        print(f"FAILED: {payload}")
        return
    print("| layout | mode | exchange fwd ms | exchange fwd+bwd ms | attention fwd ms | attention fwd+bwd ms |"
          " bytes total / max per rank | rel err vs allgather |")
    print("|---|---|---|---|---|---|---|---|")
    by_kind = {}
    for kind, mode, value, note in payload:
        by_kind.setdefault(kind, {})[mode] = (value, note)
    for kind, entries in by_kind.items():
        checks, sizes = entries["check"][0], entries["bytes"][0]
        for mode in ("allgather", "halo", "a2a"):
            value, note = entries[mode]
            if value is None:
                print(f"| {kind} | {mode} | {note} | | | | | |")
                continue
            size = sizes[mode]
            flag = "ok" if checks[mode] <= BF16_TOLERANCE else "MISMATCH"
            print(f"| {kind} | {mode} | " + " | ".join(f"{t:.3f}" for t in value)
                  + f" | {size['total']:,} / {size['max_per_rank']:,} | {checks[mode]:.1e} {flag} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (checks that every path runs)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting new cases after this")
    parser.add_argument("--reserve-s", type=float, default=15.0)
    parser.add_argument("--max-world", type=int, default=4)
    parser.add_argument("--local-len", type=int, default=None)
    parser.add_argument("--part", choices=("all", "kernels", "exchanges"), default="all")
    parser.add_argument("--exchange-kernel", choices=("auto", "sdpa", "flex"), default="sdpa",
                        help="attention kernel in part 2 (sdpa: no compile time in every rank)")
    args = parser.parse_args(argv)
    args.iters = max(10, args.iters)
    device = torch.device(args.device)
    deadline = Deadline(args.budget_s)
    if args.smoke or device.type == "cpu":
        shape = Shape(args.local_len or 256, 4, 1, 4, 2, 32, torch.float32)
        args.warmup = min(args.warmup, 1)
    else:
        shape = Shape(args.local_len or 8192, 4, 1, 16, 4, 128, torch.bfloat16)
    print(f"torch {torch.__version__}, device {device}")
    if args.part in ("all", "kernels"):
        bench_kernels(args, shape, device, deadline)
    if args.part in ("all", "exchanges"):
        bench_exchanges(args, shape, device, deadline)
    print(f"\ntotal {args.budget_s - deadline.left():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
