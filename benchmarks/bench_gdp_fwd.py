"""GDP forward: the tensor-core CuTeDSL kernels vs flash-linear-attention's ``chunk_gated_delta_product``.

    python benchmarks/bench_gdp_fwd.py [--out DIR] [--repeat 20] [--cases ...] [--variants ...]

Cases (H = 16, K = V = 128, bf16, qk l2norm): B = 1 with T in {8k, 32k, 128k} for n_h in {1, 2}
(one long sequence), and 32 packed documents of 1k tokens (n_h = 2). Both run in this process on
the same inputs; CUDA events around each call after warm-up, the median of ``--repeat``.
Prints a table, writes ``DIR/bench_gdp_fwd.csv`` and ``DIR/bench_gdp_fwd.png``, and a per-kernel
breakdown of our forward (each recorded launch replayed alone). Useful TFLOP/s counts the
chunked algorithm's FLOPs (``chunked_flops``); GB/s the fewest bytes (inputs once, output once).
Two times per call: "wall" (CUDA events around the Python call: what an eager caller waits,
host launch overhead included) and "kernel" (the sum of the GPU kernels' durations from
torch.profiler: what a CUDA-graph replay or an overlapped step pays). Variants of our backend:
``default`` (``launch.scan_row_block``'s choice), ``r64`` / ``r128`` (4-warp scan CTAs, two per
SM / 8-warp CTAs, one per SM), ``wg`` (the warpgroup-MMA scan), ``cN`` (segments sized for N CTAs
per SM); parts combine, e.g. ``wg-r64``.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

from _bench_common import kernel_times, make_inputs, parse_case, time_ms
from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend
from torch_api.gdp.types import GDPInputs

CHUNK = 64
DEFAULT_CASES = ["1x8192:2", "1x32768:2", "1x131072:2", "1x8192:1", "1x32768:1", "1x131072:1", "32x1024:2"]


def chunked_flops(tokens: int, heads: int, key_dim: int, value_dim: int, nh: int, chunk: int = CHUNK) -> float:
    """FLOPs of the chunked WY/UT forward (multiply-add = 2), summed over chunks and heads."""
    steps = tokens * nh
    chunks = -(-steps // chunk)
    c, k, v = chunk, key_dim, value_dim
    rows = c / nh
    per_chunk = (c * (c - 1) * k + c * (c - 1) * (k + v) + 2 * c * k * v * 2 + 2 * rows * k * v + rows * c * (k + v))
    return per_chunk * chunks * heads


def min_bytes(tokens: int, heads: int, key_dim: int, value_dim: int, nh: int, itemsize: int = 2) -> int:
    steps = tokens * nh
    return (tokens * heads * key_dim + steps * heads * (key_dim + value_dim) + tokens * heads * value_dim) * itemsize \
        + (tokens + steps) * heads * 4


def make_backend(variant: str) -> CuTeDSLGatedDeltaProductCPBackend:
    # "default" is what a user gets (the backend's own mma="auto"); "sync" / "wg" force an MMA kind
    row_block, ctas, mma = 0, 2.0, "auto"
    for part in variant.split("-"):
        if part in ("r64", "r128"):
            row_block = int(part[1:])
        elif part == "wg":
            mma = "wgmma"
        elif part == "sync":
            mma = "sync"
        elif part.startswith("c"):
            ctas = float(part[1:])
    return CuTeDSLGatedDeltaProductCPBackend(row_block=row_block, ctas_per_sm=ctas, mma=mma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="DOCSxDOC_TOKENS:NH entries")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default="out/bench_gdp_fwd")
    parser.add_argument("--variants", nargs="+", default=["default"], help="default (the backend as a user gets it), sync, wg, r64, c4, r64-c4, ...")
    parser.add_argument("--no-fla", action="store_true", help="time our kernels only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fla = None
    try:
        if not args.no_fla:
            from fla.ops.gated_delta_product import chunk_gated_delta_product as fla
    except Exception as err:  # FLA is an optional anchor
        print(f"flash-linear-attention unavailable ({type(err).__name__}: {err}); timing ours only")
    header = ["case", "variant", "tokens", "nh", "ours_wall_ms", "ours_kernel_ms", "fla_wall_ms", "fla_kernel_ms",
              "speedup_wall", "speedup_kernel", "ours_tflops_kernel", "rel_diff_fla"]
    print(f"GDP forward, H={args.heads}, K=V={args.dim}, bf16, l2norm; median of {args.repeat}; ms per call")
    print(f"{'case':>12} {'variant':>9} {'wall':>8} {'kernel':>8} {'FLA wall':>9} {'FLA kern':>9} "
          f"{'x wall':>7} {'x kern':>7} {'TFLOP/s':>8} {'rel diff':>9}", flush=True)
    rows, breakdowns = [], []
    for case in args.cases:
        docs, doc_tokens, nh = parse_case(case)
        q, k, v, g, beta, cu = make_inputs(docs, doc_tokens, args.heads, args.dim, nh)
        tokens = docs * doc_tokens
        inputs = GDPInputs(q, k, v, g, beta, args.dim ** -0.5, nh, True, cu, save_for_backward=False)  # inference
        flops = chunked_flops(tokens, args.heads, args.dim, args.dim, nh)
        with torch.no_grad():
            t_fla = k_fla = float("nan")
            o_fla = None
            if fla is not None:
                def run_fla():
                    return fla(q, k, v, g, beta, num_householder=nh, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

                t_fla = time_ms(run_fla, args.repeat)
                fla_kernels = kernel_times(run_fla, args.repeat)
                k_fla = sum(fla_kernels.values())
                o_fla = run_fla()[0]
                breakdowns.append((case, "FLA", fla_kernels))
            for variant in args.variants:
                backend = make_backend(variant)
                run_ours = lambda: backend.one_device_forward(inputs)  # noqa: E731
                t_ours = time_ms(run_ours, args.repeat)
                ours_kernels = kernel_times(run_ours, args.repeat)
                k_ours = sum(ours_kernels.values())
                breakdowns.append((case, variant, ours_kernels))
                o_ours = run_ours()[0]
                diff = float("nan") if o_fla is None else \
                    ((o_ours.float() - o_fla.float()).norm() / o_fla.float().norm()).item()
                row = [case, variant, tokens, nh, t_ours, k_ours, t_fla, k_fla, t_fla / t_ours, k_fla / k_ours,
                       flops / k_ours / 1e9, diff]
                rows.append(row)
                print(f"{case:>12} {variant:>9} {t_ours:>8.3f} {k_ours:>8.3f} {t_fla:>9.3f} {k_fla:>9.3f} "
                      f"{row[8]:>7.2f} {row[9]:>7.2f} {row[10]:>8.1f} {diff:>9.2e}", flush=True)
        del q, k, v, g, beta, inputs
        torch.cuda.empty_cache()
    print("\nper-kernel GPU time per call (ms, torch.profiler), largest first")
    for case, who, kernels in breakdowns:
        top = sorted(kernels.items(), key=lambda item: -item[1])[:8]
        print(f"{case:>12} {who:>9}: " + "  ".join(f"{name[:60]} {ms:.3f}" for name, ms in top), flush=True)
    with open(os.path.join(args.out, "bench_gdp_fwd.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r[0]} {r[1]}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[5] for r in rows], 0.4, label="cp_linear (CuTeDSL), kernel time")
        ax.bar([x + 0.2 for x in xs], [r[7] for r in rows], 0.4, label="flash-linear-attention, kernel time")
        ax.set_xticks(list(xs), labels, rotation=20)
        ax.set_ylabel("forward ms (log)")
        ax.set_yscale("log")
        ax.set_title(f"GDP forward on one H200, H={args.heads}, K=V={args.dim}, bf16")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_gdp_fwd.png"), dpi=120)
    except Exception as err:  # the table and CSV are the result; the plot is a convenience
        print(f"no plot: {err}")


if __name__ == "__main__":
    main()
