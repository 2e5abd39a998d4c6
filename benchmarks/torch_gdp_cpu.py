"""CPU timing of TorchGDPBackend through the one-device ``gated_delta_product``, forward and backward.

Usage: python benchmarks/torch_gdp_cpu.py [--threads 1] [--tokens 65536] [--docs 300]
"""

import argparse
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F

from torch_api import gated_delta_product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-householder", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens, heads, dim, n = args.tokens, args.heads, args.head_dim, args.num_householder
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, heads, dim, generator=gen)
    k = F.normalize(torch.randn(1, tokens * n, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, tokens * n, heads, dim, generator=gen)
    g = F.logsigmoid(torch.randn(1, tokens, heads, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(1, tokens * n, heads, generator=gen))
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=args.docs - 1, replace=False))
    cu = torch.tensor(np.concatenate([[0], cuts, [tokens]]), dtype=torch.int32)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    for _ in range(2):  # the second repetition is the steady state
        t0, c0 = time.perf_counter(), time.process_time()
        o, final = gated_delta_product(*leaves, num_householder=n, cu_seqlens=cu)
        t1, c1 = time.perf_counter(), time.process_time()
        (o.sum() + final.sum()).backward()
        t2, c2 = time.perf_counter(), time.process_time()
        print(f"threads={args.threads} T={tokens} H={heads} K=V={dim} n_h={n} docs={args.docs}: "
              f"forward {t1 - t0:.2f}s wall / {c1 - c0:.2f}s cpu, backward {t2 - t1:.2f}s wall / {c2 - c1:.2f}s cpu",
              flush=True)
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
