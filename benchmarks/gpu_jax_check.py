"""JAX paths on real GPUs: block-diagonal attention with every exchange (ragged all-to-all included,
which XLA:CPU lacks) and GDP chunkwise CP, against float64 references. Prints one line per check.

    python benchmarks/gpu_jax_check.py          # on a machine with >= 2 GPUs
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from cp_linear import build_blockdiag_plan, reference  # noqa: E402

TOL = 1e-4  # float32 on the GPU: matmuls pinned to full float32 below
jax.config.update("jax_default_matmul_precision", "highest")


def rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def report(name, err, tol=TOL):
    status = "ok" if err <= tol else "FAIL"
    print(f"[{status}] {name}: rel err {err:.2e} (tol {tol:.0e})", flush=True)
    return err <= tol


def blockdiag_checks(mesh) -> bool:
    from jax_api.attention.blockdiag import blockdiag_attention, plan_blockdiag_exchange
    from jax_api.attention.naive import naive_blockdiag_attention

    cp = mesh.devices.size
    local = 64
    layouts = {
        "one-document-over-all-ranks": np.ones(cp * local, np.int64),
        "straddle-and-interior-padding": np.concatenate(
            [np.full(40, 1), np.zeros(9, np.int64), np.full(cp * local - 60, 2), np.zeros(11, np.int64)]),
    }
    ok = True
    rng = np.random.default_rng(0)
    for name, doc_ids in layouts.items():
        tokens = doc_ids.shape[0]
        q = rng.normal(size=(2, tokens, 4, 32)).astype(np.float32)
        k = rng.normal(size=(2, tokens, 2, 32)).astype(np.float32)
        v = rng.normal(size=(2, tokens, 2, 32)).astype(np.float32)
        do = rng.normal(size=q.shape).astype(np.float32)
        ref_out = reference.blockdiag_attention(q, k, v, doc_ids)
        ref_grads = jax.grad(lambda q, k, v: jnp.sum(naive_blockdiag_attention(q, k, v, jnp.asarray(doc_ids)) * do),
                             argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
        variants = [("allgather", "auto"), ("a2a", "ppermute")]
        if jax.default_backend() != "cpu":  # XLA:CPU has no ragged all-to-all
            variants.append(("a2a", "ragged"))
        if build_blockdiag_plan(doc_ids, cp).use_halo:
            variants.append(("halo", "auto"))
        for mode, impl in variants:
            plan = plan_blockdiag_exchange(doc_ids, cp, mode=mode, platform="gpu", a2a_impl=impl)

            @jax.jit
            def loss_and_out(q, k, v, plan=plan):
                out = blockdiag_attention(q, k, v, plan, mesh=mesh)
                return jnp.sum(out * do), out

            t0 = time.perf_counter()
            (_, out), grads = jax.value_and_grad(loss_and_out, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            out.block_until_ready()
            label = f"jax blockdiag {name} mode={mode} impl={impl or '-'} ({time.perf_counter() - t0:.1f}s incl. compile)"
            ok &= report(f"{label} out", rel(out, ref_out))
            for which, g, r in zip("qkv", grads, ref_grads):
                ok &= report(f"{label} d{which}", rel(g, r))
    return ok


def gdp_checks(mesh) -> bool:
    from jax_api import gdp_chunkwise_context_parallel

    cp = mesh.devices.size
    rng = np.random.default_rng(1)
    lengths = [5, 3 * 32 * cp // 4, 1, 32 * cp - 6 - 3 * 32 * cp // 4]
    tokens, n, heads, kd, vd = sum(lengths), 2, 2, 16, 12
    q = rng.normal(size=(1, tokens, heads, kd)).astype(np.float32)
    k = rng.normal(size=(1, tokens * n, heads, kd)).astype(np.float32)
    v = rng.normal(size=(1, tokens * n, heads, vd)).astype(np.float32)
    g = (-np.log1p(np.exp(-rng.normal(size=(1, tokens, heads)) - 1))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(1, tokens * n, heads))))).astype(np.float32)
    ids = np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)
    ref_out, _ = reference.naive_gated_delta_product(q, k, v, g, beta, num_householder=n, use_qk_l2norm_in_kernel=True,
                                                     cu_seqlens=np.r_[0, np.cumsum(lengths)])
    fn = jax.jit(lambda *xs: gdp_chunkwise_context_parallel(*xs, mesh=mesh, global_seq_idx=jnp.asarray(ids),
                                                            num_householder=n, use_qk_l2norm_in_kernel=True))
    out = fn(q, k, v, g, beta)
    return report(f"jax gdp CP over {cp} GPUs (packed, n_h=2, l2norm) out", rel(out, ref_out))


def main() -> int:
    devices = jax.devices()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(devices)} devices", flush=True)
    mesh = Mesh(np.array(devices[:2]), ("cp",))
    ok = blockdiag_checks(mesh)
    try:
        ok &= gdp_checks(mesh)
    except ImportError as err:
        print(f"[skip] jax gdp: {err}")
    print("ALL OK" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
