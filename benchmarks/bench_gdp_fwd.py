"""GDP forward: CuTeDSL kernels vs flash-linear-attention's Triton ``chunk_gated_delta_product``.

    python benchmarks/bench_gdp_fwd.py [--tokens 8192 32768 131072] [--heads 16] [--dim 128] [--nh 2]

B = 1, one sequence, bf16 inputs, qk l2norm in the kernel. CUDA events around each call, after
warm-up; the median of ``--repeat`` calls. TFLOP/s counts the chunked algorithm's useful FLOPs
(``chunked_flops``); GB/s counts the fewest bytes (inputs read once, output written once).
A per-kernel breakdown of the CuTeDSL forward, the output difference to FLA, and the compute of
the last rank of a 2-way CP split (prepare + apply on this GPU, no communication) are printed too.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from torch_api import GDPInputs
from torch_api.gdp.cutedsl import CHUNK, CuTeDSLGatedDeltaProductCPBackend


def chunked_flops(tokens: int, heads: int, key_dim: int, value_dim: int, nh: int, chunk: int = CHUNK) -> float:
    """FLOPs of the chunked WY/UT forward (multiply-add = 2), summed over chunks and heads."""
    steps = tokens * nh
    chunks = -(-steps // chunk)
    c, k, v = chunk, key_dim, value_dim
    rows = c / nh  # output rows (token last steps) per chunk
    per_chunk = (c * (c - 1) * k  # A = strict-lower(k k^T)
                 + c * (c - 1) * (k + v)  # forward substitution for w and u
                 + 2 * c * k * v * 2  # v_new = u - w h, h += k_end^T v_new
                 + 2 * rows * k * v  # q h
                 + rows * c * (k + v))  # causal scores and scores @ v_new (half of the square)
    return per_chunk * chunks * heads


def min_bytes(tokens: int, heads: int, key_dim: int, value_dim: int, nh: int, itemsize: int = 2) -> int:
    steps = tokens * nh
    return (tokens * heads * key_dim + steps * heads * (key_dim + value_dim) + tokens * heads * value_dim) * itemsize \
        + (tokens + steps) * heads * 4


def time_ms(fn, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def make_inputs(tokens, heads, dim, nh, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q = rand(1, tokens, heads, dim).bfloat16()
    k = rand(1, tokens * nh, heads, dim).bfloat16()
    v = rand(1, tokens * nh, heads, dim).bfloat16()
    g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0).float()
    beta = torch.sigmoid(rand(1, tokens * nh, heads)).float()
    return q, k, v, g, beta


def breakdown(backend, inputs, repeat):
    """Median time of each stage of the one-device CuTeDSL forward."""
    shard = backend._shard(inputs)
    final = torch.empty(shard.num_seqs, shard.heads, shard.key_dim, shard.value_dim, device="cuda")
    stages = {
        "chunk_index + wy_prepare": lambda: backend._index_and_wy(shard),
        "state_pass": lambda: backend._state_pass(shard, seq_begin=0, seq_count=shard.num_seqs, initial=None,
                                                  final=final, final_begin=0),
        "output": lambda: backend._output(shard),
    }
    return {name: time_ms(fn, repeat) for name, fn in stages.items()}


def cp_rank_step(backend, q, k, v, g, beta, dim, nh, repeat):
    """Median time of the last rank's prepare + apply when one sequence is split over 2 ranks
    (the critical path of a 2-GPU CP forward without the all-gather), on this one GPU."""
    half = q.shape[1] // 2
    shards = [GDPInputs(q[:, sl], k[:, slk], v[:, slk], g[:, sl], beta[:, slk], dim ** -0.5, nh, True, None)
              for sl, slk in ((slice(0, half), slice(0, half * nh)), (slice(half, None), slice(half * nh, None)))]
    first_summary, _ = backend.cp_forward_prepare(shards[0])
    preceding = first_summary.packed.unsqueeze(0)

    def step():
        _, context = backend.cp_forward_prepare(shards[1])
        return backend.cp_forward_apply(context, preceding)

    return time_ms(step, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-fla", action="store_true")
    args = parser.parse_args()

    fla = None
    if not args.no_fla:
        try:
            from fla.ops.gated_delta_product import chunk_gated_delta_product as fla
        except Exception as err:  # FLA is an optional oracle
            print(f"flash-linear-attention unavailable ({type(err).__name__}: {err}); timing CuTeDSL only")
    backend = CuTeDSLGatedDeltaProductCPBackend()
    print(f"GDP forward, B=1, H={args.heads}, K=V={args.dim}, n_h={args.nh}, bf16, l2norm; median of {args.repeat}")
    print(f"{'T':>8} {'CuTeDSL ms':>11} {'FLA ms':>8} {'FLA/ours':>9} {'TFLOP/s':>8} {'GB/s(min)':>10} "
          f"{'rel diff':>9}", flush=True)
    rows = []
    for tokens in args.tokens:
        q, k, v, g, beta = make_inputs(tokens, args.heads, args.dim, args.nh)
        inputs = GDPInputs(q, k, v, g, beta, args.dim ** -0.5, args.nh, True, None)
        ours = lambda: backend.one_device_forward(inputs)  # noqa: E731
        with torch.no_grad():
            t_ours = time_ms(ours, args.repeat)
            stages = breakdown(backend, inputs, args.repeat)
            stages["CP rank 1 of 2 (prepare + apply)"] = cp_rank_step(backend, q, k, v, g, beta, args.dim, args.nh,
                                                                      args.repeat)
            o_ours = ours()[0]
            t_fla = diff = float("nan")
            if fla is not None:
                def run_fla():
                    return fla(q, k, v, g, beta, num_householder=args.nh, use_qk_l2norm_in_kernel=True)

                t_fla = time_ms(run_fla, args.repeat)
                o_fla = run_fla()[0]
                diff = ((o_ours.float() - o_fla.float()).norm() / o_fla.float().norm()).item()
        flops = chunked_flops(tokens, args.heads, args.dim, args.dim, args.nh)
        nbytes = min_bytes(tokens, args.heads, args.dim, args.dim, args.nh)
        rows.append((tokens, t_ours, t_fla, flops, nbytes, diff, stages))
        # one line per size as soon as it is measured (a time limit then still leaves the rows done)
        print(f"{tokens:>8} {t_ours:>11.3f} {t_fla:>8.3f} {t_fla / t_ours:>9.2f} {flops / t_ours / 1e9:>8.1f} "
              f"{nbytes / t_ours / 1e6:>10.0f} {diff:>9.2e}", flush=True)
        del q, k, v, g, beta, inputs, o_ours
        torch.cuda.empty_cache()

    print("\nper-stage CuTeDSL times (ms)")
    for tokens, *_, stages in rows:
        print(f"{tokens:>8} " + "  ".join(f"{name} {ms:.3f}" for name, ms in stages.items()))


if __name__ == "__main__":
    main()
