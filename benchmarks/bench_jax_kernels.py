"""JAX vs torch on the same CuTeDSL GDP kernels: wall time per call at bench_gdp_fwd.py's shapes.

    python benchmarks/bench_jax_kernels.py [--cases 1x8192:2 ...] [--repeat 20] [--out DIR] [--kernels] [--cp]
                                          [--cuda-graph]

Each case (H = 16, K = V = 128, bf16, qk l2norm; DOCSxDOC_TOKENS:NH, documents packed in one row)
runs the public one-device op of both frontends on the same inputs with the kernel backends:
``torch_api.gated_delta_product`` (eager, ``torch.no_grad`` for the forward) and
``jax.jit(jax_api.gated_delta_product)``; then forward + backward with ``backward="kernels"`` in
both (torch autograd vs ``jax.jit(jax.vjp)``). The outputs must be the same bits (checked once per
case, printed). A traced JAX op cannot read its inputs on the host, so it always contains non-finite
values (one token-checks launch); torch does the same with ``check_inputs=False`` ("contained"
columns, the like-for-like comparison) and by default checks them (one value-checks launch and a host
read). Times: wall clock around the call and a device synchronisation (torch:
``torch.cuda.synchronize``; JAX: ``block_until_ready``), median of ``--repeat`` after warm-up, so
host dispatch is included on both sides; the variants of a case take turns, five rounds in alternating order
(``interleaved_wall_ms``). ``--cp``: the JAX CP op on 2 GPUs (jit + shard_map +
all-gathers) at cp_gdp_nccl.py's packing, forward and forward + backward; torch's CP forward on
the same packing is timed by ``benchmarks/cp_gdp_nccl.py`` (NCCL, one process per GPU). ``--cuda-graph``: the
JAX backends register their kernels as command-buffer compatible (``cuda_graph=True``), so XLA may replay
them from CUDA graphs instead of launching each from the host (JAX's host dispatch is part of its wall time).
Writes ``DIR/bench_jax_kernels.csv``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too

import argparse  # noqa: E402
import csv  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from _bench_common import make_inputs as gdp_inputs, parse_case  # noqa: E402

DEFAULT_CASES = ["1x8192:2", "1x32768:2", "1x131072:2", "1x32768:1", "32x1024:2"]


def interleaved_wall_ms(variants: dict, repeat: int, rounds: int = 5, warmup: int = 3) -> dict:
    """Median wall ms per call of each variant (name -> (fn, sync)) over about ``repeat`` calls, timed in
    ``rounds`` rounds with the variants' order reversed every other round: a drift of clocks or memory state
    during the run lands on every variant alike, not on whichever ran last (timed one after another, the same
    torch call moved by up to 0.38 ms between runs; benchmarks/NOTES.md, session 2026-12-08)."""
    for fn, sync in variants.values():
        for _ in range(warmup):
            sync(fn())
    samples = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            fn, sync = variants[name]
            for _ in range(max(1, repeat // rounds)):
                start = time.perf_counter()
                sync(fn())
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def wall_ms(fn, sync, repeat: int, warmup: int = 3) -> float:
    return interleaved_wall_ms({"": (fn, sync)}, repeat, rounds=1, warmup=warmup)[""]


def torch_sync(_):
    torch.cuda.synchronize()


def jax_sync(result):
    jax.block_until_ready(result)


def to_jax(t: torch.Tensor) -> jax.Array:
    """The same device buffer as a JAX array (DLPack), or a host copy where that fails."""
    torch.cuda.synchronize()
    try:
        return jax.dlpack.from_dlpack(t.contiguous())
    except Exception:  # noqa: BLE001
        dtype = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}.get(t.dtype, jnp.float32)
        return jnp.asarray(t.float().cpu().numpy()).astype(dtype)


def same_bits(a: torch.Tensor, b: jax.Array) -> bool:
    x = a.detach().float().cpu().numpy()
    y = np.asarray(jax.device_get(b.astype(jnp.float32)))
    return x.shape == y.shape and bool(np.array_equal(x.view(np.uint32), y.view(np.uint32)))


def make_inputs(docs: int, doc_tokens: int, heads: int, dim: int, nh: int, seed: int = 0):
    """bench_gdp_fwd.py's inputs and an output gradient dO (bf16), drawn after them from the same generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g, beta, cu = gdp_inputs(docs, doc_tokens, heads, dim, nh, generator=gen)
    do = torch.randn(1, docs * doc_tokens, heads, dim, device="cuda", generator=gen).bfloat16()
    return q, k, v, g, beta, cu, do


def _print_kernels(label: str, fn, repeat: int, top: int = 10) -> None:
    """The kernels ``fn`` launches, largest first (GPU ms per call; torch.profiler sees XLA's launches too)."""
    from _bench_common import kernel_times

    times = sorted(kernel_times(fn, repeat).items(), key=lambda item: -item[1])
    total = sum(ms for _, ms in times)
    print(f"  {label}: {total:.3f} ms of kernels in {len(times)} kinds: "
          + "  ".join(f"{name[:60]} {ms:.3f}" for name, ms in times[:top]), flush=True)


def one_device_case(case: str, heads: int, dim: int, repeat: int, kernels: bool = False,
                    cuda_graph: bool = False) -> dict:
    import jax_api
    import jax_api.gdp.cutedsl as jcd
    import torch_api
    import torch_api.gdp.cutedsl as tcd

    docs, doc_tokens, nh = parse_case(case)
    q, k, v, g, beta, cu, do = make_inputs(docs, doc_tokens, heads, dim, nh)
    options = dict(num_householder=nh, use_qk_l2norm_in_kernel=True)
    row = {"case": case, "tokens": docs * doc_tokens, "nh": nh, "jax_cuda_graph": cuda_graph}

    torch_fwd = tcd.CuTeDSLGatedDeltaProductCPBackend()
    jax_fwd = jcd.CuTeDSLGatedDeltaProductCPBackend(cuda_graph=cuda_graph)
    jq, jk, jv, jg, jbeta, jcu, jdo = (to_jax(x) for x in (q, k, v, g, beta, cu, do))

    def torch_forward():
        with torch.no_grad():
            return torch_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, backend=torch_fwd, **options)

    jax_forward = jax.jit(lambda q, k, v, g, beta, cu: jax_api.gated_delta_product(
        q, k, v, g, beta, cu_seqlens=cu, backend=jax_fwd, **options))
    def torch_contained_forward():
        with torch.no_grad():
            return torch_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, backend=torch_fwd,
                                                 check_inputs=False, **options)

    o_t, _ = torch_forward()
    o_j, _ = jax_forward(jq, jk, jv, jg, jbeta, jcu)
    row["forward_same_bits"] = same_bits(o_t, o_j)
    row.update(interleaved_wall_ms({"torch_fwd_ms": (torch_forward, torch_sync),
                                    "torch_contained_fwd_ms": (torch_contained_forward, torch_sync),
                                    "jax_fwd_ms": (lambda: jax_forward(jq, jk, jv, jg, jbeta, jcu), jax_sync)},
                                   repeat))
    if kernels:
        _print_kernels(f"{case} torch fwd", torch_forward, repeat)
        _print_kernels(f"{case} torch contained fwd", torch_contained_forward, repeat)
        _print_kernels(f"{case} jax fwd", lambda: jax.block_until_ready(jax_forward(jq, jk, jv, jg, jbeta, jcu)),
                       repeat)

    torch_bwd = tcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    jax_bwd = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels", cuda_graph=cuda_graph)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]

    def torch_train(check_inputs=True):
        for leaf in leaves:
            leaf.grad = None
        o, _ = torch_api.gated_delta_product(*leaves, cu_seqlens=cu, backend=torch_bwd, check_inputs=check_inputs,
                                             **options)
        o.backward(do)
        return [leaf.grad for leaf in leaves]

    @jax.jit
    def jax_train(q, k, v, g, beta, cu, do):
        _, vjp = jax.vjp(lambda *a: jax_api.gated_delta_product(*a, cu_seqlens=cu, backend=jax_bwd, **options)[0],
                         q, k, v, g, beta)
        return vjp(do)

    grads_t = torch_train()
    grads_j = jax_train(jq, jk, jv, jg, jbeta, jcu, jdo)
    row["grads_same_bits"] = all(same_bits(a, b) for a, b in zip(grads_t, grads_j))
    row.update(interleaved_wall_ms({"torch_fwdbwd_ms": (torch_train, torch_sync),
                                    "torch_contained_fwdbwd_ms": (lambda: torch_train(check_inputs=False), torch_sync),
                                    "jax_fwdbwd_ms": (lambda: jax_train(jq, jk, jv, jg, jbeta, jcu, jdo), jax_sync)},
                                   repeat))
    if kernels:
        _print_kernels(f"{case} torch fwd+bwd", torch_train, repeat)
        _print_kernels(f"{case} jax fwd+bwd", lambda: jax.block_until_ready(jax_train(jq, jk, jv, jg, jbeta, jcu, jdo)),
                       repeat)
    row["jax/torch fwd"] = row["jax_fwd_ms"] / row["torch_fwd_ms"]
    row["jax/torch fwd+bwd"] = row["jax_fwdbwd_ms"] / row["torch_fwdbwd_ms"]
    row["jax/torch contained fwd"] = row["jax_fwd_ms"] / row["torch_contained_fwd_ms"]
    row["jax/torch contained fwd+bwd"] = row["jax_fwdbwd_ms"] / row["torch_contained_fwdbwd_ms"]
    return row


def cp_case(tokens: int, heads: int, dim: int, nh: int, repeat: int) -> dict:
    """The JAX CP op on 2 GPUs at cp_gdp_nccl.py's packing (documents of T/8, T/2, T/4 + 3 and the rest)."""
    import jax_api
    import jax_api.gdp.cutedsl as jcd

    parts = [tokens // 8, tokens // 2, tokens // 4 + 3]
    lengths = parts + [tokens - sum(parts)]
    q, k, v, g, beta, _, do = make_inputs(1, tokens, heads, dim, nh)
    mesh = jax.sharding.Mesh(np.array(jax.devices("gpu")[:2]), ("cp",))
    seq_idx = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    options = dict(mesh=mesh, global_seq_idx=seq_idx, num_householder=nh, use_qk_l2norm_in_kernel=True)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))  # each GPU its shard
    arrays = [jax.device_put(to_jax(x), sharded) for x in (q, k, v, g, beta, do)]
    forward_backend = jcd.CuTeDSLGatedDeltaProductCPBackend()
    train_backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    forward = jax.jit(lambda q, k, v, g, beta: jax_api.gdp_chunkwise_context_parallel(
        q, k, v, g, beta, backend=forward_backend, **options))

    @jax.jit
    def train(q, k, v, g, beta, do):
        _, vjp = jax.vjp(lambda *a: jax_api.gdp_chunkwise_context_parallel(*a, backend=train_backend, **options),
                         q, k, v, g, beta)
        return vjp(do)

    row = {"case": f"cp2 1x{tokens}:{nh}", "tokens": tokens, "nh": nh}
    row["jax_fwd_ms"] = wall_ms(lambda: forward(*arrays[:5]), jax_sync, repeat)
    row["jax_fwdbwd_ms"] = wall_ms(lambda: train(*arrays), jax_sync, repeat)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="DOCSxDOC_TOKENS:NH entries")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default="out/bench_jax_kernels")
    parser.add_argument("--kernels", action="store_true", help="also print each variant's kernels (torch.profiler)")
    parser.add_argument("--cp", action="store_true", help="also the JAX CP op on 2 GPUs")
    parser.add_argument("--cp-tokens", type=int, default=65536)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="JAX kernels command-buffer compatible (XLA may capture them in CUDA graphs)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; torch {torch.__version__}", flush=True)
    rows = []
    for case in args.cases:
        row = one_device_case(case, args.heads, args.dim, args.repeat, kernels=args.kernels,
                              cuda_graph=args.cuda_graph)
        rows.append(row)
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        torch.cuda.empty_cache()
    if args.cp and len(jax.devices("gpu")) >= 2:
        row = cp_case(args.cp_tokens, args.heads, args.dim, 2, args.repeat)
        rows.append(row)
        print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    fields = sorted({key for row in rows for key in row}, key=lambda key: list(rows[0]).index(key)
                    if key in rows[0] else 99)
    with open(os.path.join(args.out, "bench_jax_kernels.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
