"""Attention work per rank under the contiguous and the zig-zag CP layouts (host count, no GPU).

For each packing and cp size, counts the [128 x 128] tiles of the block-diagonal causal mask that
each rank's queries keep (``cp_linear.zigzag.attention_block_work``: what a block-sparse kernel such
as flex attention computes) and reports the busiest rank against the mean. One tile costs
4 · 128² · D FLOPs per query head forward (QKᵀ and PV; the backward about 2.5 times that).

    python benchmarks/bench_zigzag_balance.py [--tokens 131072] [--block 128] [--head-dim 128]
    python benchmarks/bench_zigzag_balance.py --measure-bytes [--worlds 2 4]

``--measure-bytes`` runs one GDP op (H4-K64-V64) and one attention call (Hkv 2, D 64, float32) per
layout, forward and backward, on gloo groups of this CPU machine, and counts the payload bytes each
rank receives through every data collective (the agreement headers excluded), wrapping the
collectives of ``torch.distributed``.

Packings: one document of T tokens; four of T / 4; three mixes of lengths (seeds 0-2, log-uniform in
[256, T / 2], the last one trimmed to fill T). docs/cp_options.md records the table.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cp_linear.zigzag import LAYOUTS, attention_block_work  # noqa: E402


def mixed_lengths(total: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(np.exp(rng.uniform(np.log(256), np.log(total // 2)))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def packings(total: int) -> dict[str, np.ndarray]:
    cases = {f"one document of {total // 1024}k": np.ones(total, np.int64),
             f"4 documents of {total // 4096}k": np.repeat(np.arange(1, 5), total // 4)}
    for seed in range(3):
        lengths = mixed_lengths(total, seed)
        cases[f"mixed (seed {seed}): {len(lengths)} documents"] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return cases


def _received_bytes(rank, world, layout, what):
    """Payload bytes this rank receives in one forward + backward of ``what`` ("gdp" / "attention")."""
    import torch
    import torch.distributed as dist

    import torch_api.gdp.cp as gdp_cp
    from cp_linear.zigzag import local_positions

    received = []

    def counting(collective, receives):
        def wrapped(out, inp, *args, **kwargs):
            if out.dtype != torch.int64:  # agreement headers are int64; payloads are float
                received.append(receives(out, inp))
            return collective(out, inp, *args, **kwargs)
        return wrapped

    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter_name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    originals = {name: getattr(dist, name) for name in (gather_name, scatter_name)}
    original_cp = gdp_cp.all_gather_single
    gather = counting(originals[gather_name], lambda out, inp: (out.numel() - inp.numel()) * out.element_size())
    setattr(dist, gather_name, gather)
    gdp_cp.all_gather_single = gather
    # a reduce-scatter receives (world - 1) / world of its input, summed into its own slice
    setattr(dist, scatter_name, counting(originals[scatter_name],
                                         lambda out, inp: (inp.numel() - out.numel()) * inp.element_size()))
    try:
        local_len, total = 64, 64 * world
        positions = torch.from_numpy(local_positions(total, world, rank, layout))
        generator = torch.Generator().manual_seed(0)
        if what == "gdp":
            from torch_api.gdp.chunk import TorchGDPBackend

            heads, dim = 4, 64
            q, k, v = (torch.randn(1, total, heads, dim, generator=generator)[:, positions].requires_grad_()
                       for _ in range(3))
            g = (-torch.rand(1, total, heads, generator=generator))[:, positions].requires_grad_()
            beta = torch.rand(1, total, heads, generator=generator)[:, positions].requires_grad_()
            out = gdp_cp.gdp_chunkwise_context_parallel(q, k, v, g, beta, cp_group=dist.group.WORLD,
                                                        global_seq_idx=torch.zeros(1, total, dtype=torch.int64),
                                                        backend=TorchGDPBackend(16), layout=layout)
        else:
            from torch_api.attention.blockdiag import blockdiag_attention

            q = torch.randn(1, total, 4, 64, generator=generator)[:, positions].requires_grad_()
            k, v = (torch.randn(1, total, 2, 64, generator=generator)[:, positions].requires_grad_() for _ in range(2))
            out = blockdiag_attention(q, k, v, torch.ones(total, dtype=torch.int64), cp_group=dist.group.WORLD,
                                      mode="allgather", kernel="sdpa", layout=layout)
        out.sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        gdp_cp.all_gather_single = original_cp
    return sum(received)


def measure_bytes(worlds) -> None:
    from tests.gloo_pool import GlooPool

    print("| op | world | contiguous bytes received per rank (fwd + bwd) | zigzag |")
    print("|---|---|---|---|")
    for world in worlds:
        pool = GlooPool(world)
        try:
            for what in ("gdp", "attention"):
                got = {layout: pool.run(_received_bytes, layout, what) for layout in LAYOUTS}
                print(f"| {what} | {world} | {got['contiguous']} | {got['zigzag']} |")
        finally:
            pool.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure-bytes", action="store_true")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    if args.measure_bytes:
        measure_bytes(args.worlds)
        return
    tile_gflop = 4 * args.block**2 * args.head_dim / 1e9
    print(f"| packing | cp | layout | tiles per rank | busiest rank GFLOP/head | busiest / mean |")
    print("|---|---|---|---|---|---|")
    for name, doc_ids in packings(args.tokens).items():
        for cp in args.cp:
            for layout in LAYOUTS:
                work = attention_block_work(doc_ids, cp, layout, block_size=args.block)
                shown = ", ".join(str(int(w)) for w in work)
                print(f"| {name} | {cp} | {layout} | {shown} | {work.max() * tile_gflop:.1f} | "
                      f"{work.max() / work.mean():.2f} |")


if __name__ == "__main__":
    main()
