"""Document-causal attention backends at the decoder benchmark's shape, one layer, one GPU.

    python benchmarks/bench_attention_backends.py [--tokens 8192 32768]

Rows: torch flex_attention and FlashAttention-2 varlen (``torch_api.attention.kernel``, kernels "flex" and
"varlen"), and JAX's cuDNN packed attention (``jax_api.attention.cudnn``, containment included); B = 1,
16 query / 4 key-value heads × 128, bf16, the documents of ``bench_train.py`` (``_doc_ids``). Forward and
forward + backward, median of 10 (CUDA events for torch, wall clock for JAX). At 8k every row's output
and gradients are compared with a float32 reference (math SDPA per document). The first version of this
probe (``benchmarks/results/2026-12-03-h200-s4/c3``) also tried torch's ``aten._cudnn_attention_forward``
with cumulative offsets: infinite / NaN gradients and 50–75 ms forwards on torch 2.11, so it is not a row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_common import time_ms  # noqa: E402
from bench_train import _doc_ids  # noqa: E402
from torch_api.attention.kernel import DocCausalLayout, doc_causal_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128


def reference(q, k, v, do, bounds):
    """float32 outputs and gradients, causal math SDPA per document."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    pieces = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[:, lo:hi].transpose(1, 2) for x in leaves)
        group = HEADS // KV_HEADS
        pieces.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1), is_causal=True).transpose(1, 2))
    out = torch.cat(pieces, 1)
    return out.detach(), torch.autograd.grad(out, leaves, do.float())


def rel(a, b) -> float:
    return float((a.float() - b).norm() / b.norm())


def torch_rows(tokens: int, ids: np.ndarray) -> None:
    layout = DocCausalLayout.from_doc_ids(ids, 0, tokens, 0, tokens)
    bounds = layout.varlen_segments()[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, HEAD_DIM, device="cuda", generator=gen).bfloat16().requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    do = torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    ref = reference(q, k, v, do, bounds) if tokens <= 8192 else None
    for kernel in ("flex", "varlen"):
        def forward():
            return doc_causal_attention(q, k, v, layout, kernel=kernel)

        def both():
            torch.autograd.grad(forward(), (q, k, v), do)

        line = f"  torch {kernel:8s} fwd {time_ms(forward, 10):7.3f} ms  fwd+bwd {time_ms(both, 10):7.3f} ms"
        if ref is not None:
            out = forward()
            grads = torch.autograd.grad(out, (q, k, v), do)
            line += f"  rel err out {rel(out.detach(), ref[0]):.2e} " + " ".join(
                f"d{name} {rel(g, r):.2e}" for name, g, r in zip("qkv", grads, ref[1]))
        print(line, flush=True)


def jax_rows(tokens: int, ids: np.ndarray) -> None:
    import jax
    import jax.numpy as jnp

    from jax_api.attention.cudnn import cudnn_attention_reason, cudnn_document_attention

    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.normal(size=(1, tokens, heads, HEAD_DIM)), jnp.bfloat16)
                   for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    reason = cudnn_attention_reason(q, k)
    if reason:
        print(f"  jax cuDNN: not run ({reason})")
        return
    doc_ids = jnp.asarray(ids, jnp.int32)

    def attend(q, k, v):
        return cudnn_document_attention(q, k, v, doc_ids, max_runs=16, scale=HEAD_DIM ** -0.5)

    forward = jax.jit(attend)
    both = jax.jit(lambda q, k, v: jax.vjp(attend, q, k, v)[1](do))
    for name, fn in (("fwd", forward), ("fwd+bwd", both)):
        jax.block_until_ready(fn(q, k, v))
        times = []
        for _ in range(10):
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times.append(time.perf_counter() - start)
        print(f"  jax cuDNN {name:8s} {1e3 * sorted(times)[5]:7.3f} ms (wall)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for tokens in args.tokens:
        ids = _doc_ids(tokens, 0)
        print(f"T = {tokens}: documents {np.bincount(ids)[1:].tolist()}")
        torch_rows(tokens, ids)
        jax_rows(tokens, ids)


if __name__ == "__main__":
    main()
