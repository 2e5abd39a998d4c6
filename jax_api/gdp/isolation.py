"""The containment's input pass in JAX: which tokens hold a non-finite input, and sanitised copies.

Traced inputs cannot be checked on the host, so the JAX ops always contain non-finite values
(``cp_linear.validation``; the torch ops do so with ``check_inputs=False``). The pass reads every input
once; as jnp ops it is a row reduction per input plus a select per input, and the select's gradient,
``where(isfinite(x), dx, 0)``, is one more pass per input in the backward. With the kernel backend it
is one custom call of the token-checks kernel (``cp_linear.kernels.token_checks``) that only reads:
the flags go to the backend with the unchanged inputs (``GDPInputs.token_flags``), and its chunk kernels
zero the flagged rows as they load them. So a clean input costs one read and no copy. (A backend that
cannot do that gets the flags and sanitised copies from one launch, bit for bit the jnp results, with a
gradient that passes through unchanged, as torch's ``_Sanitize``: at a replaced entry it is zero anyway,
since everything the entry reaches is poisoned and a poisoned output passes no gradient.)
"""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp

from cp_linear.kernels import launch as kl
from cp_linear.validation import gdp_bad_tokens, sanitize
from jax_api.gdp import kernel_calls

def contained_inputs(q, k, v, g, beta, num_householder: int, *, backend, copies: bool = False
                     ) -> tuple[jax.Array, jax.Array, tuple, tuple | None]:
    """(state_bad, read_bad, (q, k, v, g, beta), token_flags): ``gdp_bad_tokens`` and the inputs the
    backend computes with.

    * A backend that zeroes flagged rows itself (``zeroes_flagged_rows``: the CuTeDSL kernel backend),
      where the token-checks kernel takes the inputs: one flags-only launch; the inputs pass unchanged
      and ``token_flags`` (uint8 [B, T, H] each) goes to the backend in ``GDPInputs.token_flags``.
    * Else the flags and sanitised copies (``sanitize``): one token-checks launch with copies for the
      kernel backend, the jnp ops otherwise; ``token_flags`` None. ``copies``: this, whatever the backend
      (the zigzag op, whose halves' GDPInputs carry no flags).
    """
    config = _token_checks_config(q, k, v, g, beta, num_householder, backend)
    if config is None:
        state_bad, read_bad = gdp_bad_tokens(q, k, v, g, beta, num_householder)
        return state_bad, read_bad, tuple(sanitize(x) for x in (q, k, v, g, beta)), None
    if not copies and getattr(backend, "zeroes_flagged_rows", False):
        state_bad, read_bad = _kernel_token_flags(q, k, v, g, beta, replace(config, copies=False),
                                                  backend.cuda_graph)
        return state_bad != 0, read_bad != 0, (q, k, v, g, beta), (state_bad, read_bad)
    *clean, state_bad, read_bad = _kernel_contained_inputs(q, k, v, g, beta, config, backend.cuda_graph)
    return state_bad, read_bad, tuple(clean), None


def _token_checks_config(q, k, v, g, beta, num_householder: int, backend):
    """The kernel's ``TokenChecksConfig`` when the kernel backend runs here (``unsupported_reason``) and the
    kernel takes these inputs (``launch.token_checks_config``: dtypes, head dims, n_h, int32 sizes); else
    None (shapes only)."""
    from jax_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend, unsupported_reason

    if not isinstance(backend, CuTeDSLGatedDeltaProductCPBackend):
        return None
    if unsupported_reason(q, k, v, num_householder) is not None or q.ndim != 4:
        return None
    tensors = (q, k, v, g, beta)
    return kl.token_checks_config(tuple(jnp.dtype(x.dtype).name for x in tensors), q.shape[-1], v.shape[-1],
                                  num_householder, tuple(x.size for x in tensors))


def _launch_token_checks(q, k, v, g, beta, config, cuda_graph) -> dict:
    """One ``TokenChecksLaunch`` on row views: {"state_bad", "read_bad"} uint8 [B·T, H] and, with
    ``config.copies``, the sanitised copies (as row views)."""
    heads = q.shape[2]

    def rows(x):  # [rows, D/8, 8]: the kernel reads and writes 16-byte vectors
        return x.reshape(-1, x.shape[-1] // config.vector, config.vector)

    def by_head(x):  # [rows, H]
        return x.reshape(-1, heads)

    inputs = dict(q=rows(q), k=rows(k), v=rows(v), g=by_head(g), beta=by_head(beta))
    # flags only: the copies are not written, and a [1, ...] placeholder of each stands in
    copies = {f"{name}_out": array.shape if config.copies else (1, *array.shape[1:]) for name, array in inputs.items()}
    results = dict(state_bad=inputs["g"].shape, read_bad=(q.shape[0] * q.shape[1], heads), **copies)
    return kernel_calls.launch(kl.TokenChecksLaunch, config, inputs=inputs, results=results, scalars={},
                               cuda_graph=cuda_graph)


def _kernel_token_flags(q, k, v, g, beta, config, cuda_graph) -> tuple[jax.Array, jax.Array]:
    """(state_bad, read_bad) uint8 [B, T, H] from the flags-only launch (integer results: no gradient, so
    the inputs enter it through ``stop_gradient``)."""
    q, k, v, g, beta = (jax.lax.stop_gradient(x) for x in (q, k, v, g, beta))
    out = _launch_token_checks(q, k, v, g, beta, config, cuda_graph)
    return out["state_bad"].reshape(g.shape), out["read_bad"].reshape(q.shape[:3])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _kernel_contained_inputs(q, k, v, g, beta, config, cuda_graph):
    """-> (q, k, v, g, beta sanitised, state_bad, read_bad): one ``TokenChecksLaunch`` with copies."""
    out = _launch_token_checks(q, k, v, g, beta, config, cuda_graph)
    clean = tuple(out[f"{name}_out"].reshape(x.shape) for name, x in zip(("q", "k", "v", "g", "beta"),
                                                                        (q, k, v, g, beta)))
    return (*clean, out["state_bad"].reshape(g.shape) != 0, out["read_bad"].reshape(q.shape[:3]) != 0)


def _contained_fwd(q, k, v, g, beta, config, cuda_graph):
    return _kernel_contained_inputs(q, k, v, g, beta, config, cuda_graph), None


def _contained_bwd(config, cuda_graph, _, cotangents):
    return cotangents[:5]  # the sanitising passes the gradient through (module docstring); the flags have none


_kernel_contained_inputs.defvjp(_contained_fwd, _contained_bwd)


__all__ = ["contained_inputs"]
