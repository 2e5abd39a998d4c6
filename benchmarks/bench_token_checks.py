"""The containment of non-finite GDP inputs (``check_inputs=False``): the token-checks kernel against the
torch ops it replaces (``bad_tokens``: ``aminmax`` per row and per-entry checks; ``sanitized``: one
``nan_to_num`` per input).

    python benchmarks/bench_token_checks.py [--tokens 8192 32768] [--heads 16] [--dim 128] [--nh 2] [--repeat 20]

B = 1, bf16 q, k, v, float32 g and beta, a few NaN / ±Inf in each. First checks that the kernel's flags and
copies equal the torch path's bit for bit, then times with CUDA events (median of ``--repeat``): the kernel
launch alone (``_kernel_contained_inputs``: output allocations and one launch), ``contained_inputs`` (what
the GDP ops call: the same plus the gates and the autograd node), and the torch path (``bad_tokens`` +
``sanitized``). Forward only: the gradient passes through the sanitising, so the backward has no kernel.
GB/s counts the bytes the kernel must move: every input read and written once, and the two flag arrays.
Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from _bench_common import make_inputs as gdp_inputs, time_ms
from cp_linear.validation import gdp_bad_tokens
from torch_api.gdp import isolation

SPECIALS = (float("nan"), float("inf"), -float("inf"))


def make_inputs(tokens: int, heads: int, dim: int, nh: int, seed: int = 0):
    """``bench_gdp_fwd``'s inputs (one sequence of ``tokens``) with 8 NaN / ±Inf planted in each."""
    *inputs, _ = gdp_inputs(1, tokens, heads, dim, nh, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    for index, x in enumerate(inputs):
        places = torch.randint(x.numel(), (8,), device="cuda", generator=gen)
        x.view(-1)[places] = SPECIALS[index % 3]
    return tuple(inputs)


def same_as_torch(inputs, nh: int, config) -> bool:
    state, read, *clean = isolation._kernel_contained_inputs(config, *inputs)
    state_ref, read_ref = gdp_bad_tokens(*inputs, nh)
    same = torch.equal(state, state_ref) and torch.equal(read, read_ref) and bool(state_ref.any())
    for x, y in zip(clean, inputs):
        want = torch.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)
        ints = torch.int16 if x.element_size() == 2 else torch.int32
        same = same and torch.equal(x.view(ints), want.view(ints))
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    failed = False
    print(f"H = {args.heads}, K = V = {args.dim}, n_h = {args.nh}, bf16; ms, median of {args.repeat}")
    print(f"{'T':>7} {'kernel':>8} {'GB/s':>6} {'contained_inputs':>17} {'torch ops':>10} {'speed-up':>9}  check")
    for tokens in args.tokens:
        inputs = make_inputs(tokens, args.heads, args.dim, args.nh)
        config = isolation._token_checks_config(*inputs, args.nh)
        if config is None or not isolation._kernel_reads(*inputs):
            print(f"{tokens:>7} the kernel does not take these inputs here (platform, dtype or sizes)")
            return 1
        ok = same_as_torch(inputs, args.nh, config)
        failed |= not ok
        kernel = time_ms(lambda: isolation._kernel_contained_inputs(config, *inputs), args.repeat)
        contained = time_ms(lambda: isolation.contained_inputs(*inputs, args.nh), args.repeat)

        def torch_ops():
            isolation.bad_tokens(*inputs, args.nh)
            isolation.sanitized(*inputs)

        reference = time_ms(torch_ops, args.repeat)
        moved = 2 * sum(x.numel() * x.element_size() for x in inputs) + 2 * inputs[3].numel()
        print(f"{tokens:>7} {kernel:8.3f} {moved / kernel / 1e6:6.0f} {contained:17.3f} {reference:10.3f} "
              f"{reference / contained:8.1f}x  {'bit-exact' if ok else 'MISMATCH'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
