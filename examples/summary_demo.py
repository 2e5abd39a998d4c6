"""Split a packed batch over CP ranks and show the affine summaries reproduce the recurrence.

Pure numpy (float64 references), no GPU and no process group: each "rank" computes its shard's
summary with zero incoming state, the summaries are gathered, and each rank folds the ones
its metadata names to get its incoming state.
"""

from __future__ import annotations

import argparse

import numpy as np

from cp_linear import build_packed_sequence_cp_metadata, compose_forward
from cp_linear import reference as ref


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[5, 4, 7, 24, 8])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--num-householder", type=int, default=2)
    args = parser.parse_args(argv)
    lengths, cp, n = args.lengths, args.cp, args.num_householder
    tokens = sum(lengths)
    if tokens % cp:
        raise SystemExit(f"sum(lengths) = {tokens} must be divisible by --cp {cp}")
    rng = np.random.default_rng(0)
    heads, key_dim, value_dim = 2, 16, 16
    q = rng.normal(size=(1, tokens, heads, key_dim))
    k = rng.normal(size=(1, tokens * n, heads, key_dim))
    v = rng.normal(size=(1, tokens * n, heads, value_dim))
    g = np.log(rng.uniform(0.8, 1.0, size=(1, tokens, heads)))
    beta = rng.uniform(0.0, 1.0, size=(1, tokens * n, heads))
    ids = np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)
    cu = np.r_[0, np.cumsum(lengths)]
    o_full, _ = ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=n, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True)
    local = tokens // cp
    metas = [build_packed_sequence_cp_metadata(ids, rank, cp) for rank in range(cp)]
    print(f"packed lengths {lengths} -> T = {tokens}, cp = {cp}, L = {local}, n_h = {n}")
    print("rank  preceding_rank_start  following_rank_stop  local_cu_seqlens")
    for rank, md in enumerate(metas):
        print(f"{rank:>4}  {md.preceding_rank_start:>20}  {md.following_rank_stop:>19}  {md.local_cu_seqlens.tolist()}")

    def shard(array, rank, per_token):
        return array[:, rank * local * per_token:(rank + 1) * local * per_token]

    # every rank: summary with zero incoming state; then an "all-gather" (a stack here)
    gathered = np.stack([
        ref.shard_forward_summary(shard(k, r, n), shard(v, r, n), shard(g, r, 1), shard(beta, r, n),
                                  num_householder=n, cu_seqlens=metas[r].local_cu_seqlens, use_qk_l2norm_in_kernel=True)
        for r in range(cp)]).astype(np.float32)
    worst = 0.0
    for rank, md in enumerate(metas):
        incoming = compose_forward(gathered[md.preceding_rank_start:rank]).astype(np.float64)
        init = np.zeros((len(md.local_cu_seqlens) - 1, heads, key_dim, value_dim))
        init[0] = incoming
        o_local, _ = ref.naive_gated_delta_product(
            shard(q, rank, 1), shard(k, rank, n), shard(v, rank, n), shard(g, rank, 1), shard(beta, rank, n),
            num_householder=n, cu_seqlens=md.local_cu_seqlens, initial_state=init, use_qk_l2norm_in_kernel=True)
        err = np.linalg.norm(o_local - shard(o_full, rank, 1)) / np.linalg.norm(shard(o_full, rank, 1))
        worst = max(worst, err)
        print(f"rank {rank}: folded {rank - md.preceding_rank_start} summaries, output rel err vs one-device "
              f"recurrence {err:.2e}")
    print(f"max rel err {worst:.2e} (float32 summaries) -> {'OK' if worst < 1e-5 else 'MISMATCH'}")
    return worst


if __name__ == "__main__":
    main()
