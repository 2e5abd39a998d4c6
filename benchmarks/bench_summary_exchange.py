"""Summary exchange of GDP context parallelism: all-gather vs log-depth scan, on gloo (CPU).

For world 2, 4, 8 and two summary sizes, every rank exchanges its forward summary [H, K, V + K]
(float32) for one sequence spanning every rank (the scan's worst case: nothing stops it early) and
reports the median wall time of the exchange alone, the summaries received per rank and the peak
summaries held per rank. Bytes follow from the schedule (``torch_api.gdp.summary_exchange``):

    all_gather  receives (cp - 1) summaries, holds cp
    scan        receives <= ceil(log2 cp) summaries, holds 4 (own inclusive fold, exclusive fold,
                receive buffer, the fold being formed)

    python benchmarks/bench_summary_exchange.py [--iters 20] [--worlds 2 4 8]

On a machine with fewer cores than ranks the times include scheduling noise; docs/cp_options.md
records one run and what it says.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {"H4-K64-V64": (4, 64, 64), "H16-K128-V256": (16, 128, 256)}


def _measure(rank, world, heads, key_dim, value_dim, iters):
    import numpy as np
    import torch
    import torch.distributed as dist

    from cp_linear import sequence_state_routing
    from torch_api.gdp.cp import _all_gather_summary, _slice_summary
    from cp_linear.summary_exchange import scan_schedule
    from torch_api.gdp.summary_exchange import scan_exchange

    group = dist.group.WORLD
    summary = torch.randn(heads, key_dim, value_dim + key_dim)
    routing = sequence_state_routing(np.zeros((1, world), dtype=np.int64), world)
    schedule = scan_schedule(routing, descending=False)
    runs = {
        "all_gather": lambda: _slice_summary(_all_gather_summary(summary, group), slice(0, rank)),
        "scan": lambda: scan_exchange(summary, group, schedule),
    }
    out = {}
    for name, run in runs.items():
        for _ in range(3):
            run()
        times = []
        for _ in range(iters):
            dist.barrier(group)
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        dist.barrier(group)
        out[name] = statistics.median(times)
    out["scan_received"] = schedule.received_per_rank()[rank]
    return out


def main(argv=None):
    from tests.gloo_pool import GlooPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    print("world,size,summary_bytes,exchange,received_summaries_max,received_bytes_max,held_summaries,median_ms")
    for world in args.worlds:
        pool = GlooPool(world)
        try:
            for size, (heads, key_dim, value_dim) in SIZES.items():
                per_rank = pool.run(_measure, heads, key_dim, value_dim, args.iters, timeout=600)
                summary_bytes = heads * key_dim * (value_dim + key_dim) * 4
                received = {"all_gather": world - 1, "scan": max(r["scan_received"] for r in per_rank)}
                held = {"all_gather": world, "scan": 4}
                for exchange in ("all_gather", "scan"):
                    slowest = max(r[exchange] for r in per_rank) * 1e3  # the exchange ends when its last rank does
                    print(f"{world},{size},{summary_bytes},{exchange},{received[exchange]},"
                          f"{received[exchange] * summary_bytes},{held[exchange]},{slowest:.3f}", flush=True)
        finally:
            pool.close()


if __name__ == "__main__":
    main()
