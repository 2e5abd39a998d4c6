"""``summary_exchange="scan"`` (log-depth ppermute prefix fold) against the all-gather path, JAX host devices.

Meshes of 2-4 devices, packings with spanning and non-spanning sequences and batch rows, with and
without sequence states: the outputs, final states and all gradients through the scan equal the
all-gather path's (float32, 1e-6 relative). The jaxpr of the scan path holds ppermutes and no
all_gather, forward and backward.
"""

import functools
import math

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from cp_linear.summary_exchange import SCAN_MIN_WORLD
from jax_api.gdp.chunk import JaxGDPBackend
from jax_api.gdp.cp import gdp_chunkwise_context_parallel
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths

LOCAL_LEN, HEADS, KEY_DIM, VALUE_DIM = 6, 2, 5, 3
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def packings(cp_size):
    """Three sequences each (one compiled program serves them all: ids and states are data)."""
    total, L = cp_size * LOCAL_LEN, LOCAL_LEN
    return {
        "spans-every-rank": [1, total - 2, 1],
        "starts-at-a-boundary-then-spans": [L, total - L - 1, 1],
        "short-then-spans": [2, 1, total - 3],
        "no-sequence-spans": [L, L, total - 2 * L] if cp_size > 2 else [L, 1, L - 1],
        "rows": None,
    }


@functools.lru_cache(maxsize=None)
def value_and_grads(cp_size, exchange, with_states, packed):
    """jit(value_and_grad) of sum(o * do) (+ sum(final * dfinal)) through the global CP function."""
    mesh = jax.make_mesh((cp_size,), ("cp",))

    def loss(q, k, v, g, beta, initial, output_grad, final_grad, seq_idx):
        options = dict(mesh=mesh, global_seq_idx=seq_idx if packed else None, num_householder=2,
                       backend=JaxGDPBackend(4), summary_exchange=exchange)
        if not with_states:
            o = gdp_chunkwise_context_parallel(q, k, v, g, beta, **options)
            return jnp.sum(o * output_grad), (o, jnp.zeros(()))
        o, final = gdp_chunkwise_context_parallel(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                                  **options)
        return jnp.sum(o * output_grad) + jnp.sum(final * final_grad), (o, final)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


def case_arrays(seed, cp_size, lengths):
    rng = np.random.default_rng(seed)
    batch = 2 if lengths is None else 1
    tokens = cp_size * LOCAL_LEN
    inputs = random_gdp_inputs(rng, batch=batch, tokens=tokens, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=2)
    sequences = batch if lengths is None else len(lengths)
    extra = (rng.normal(size=(sequences, HEADS, KEY_DIM, VALUE_DIM)), rng.normal(size=(batch, tokens, HEADS, VALUE_DIM)),
             rng.normal(size=(sequences, HEADS, KEY_DIM, VALUE_DIM)))
    arrays = [jnp.asarray(x, jnp.float32) for x in (*inputs, *extra)]
    seq_idx = jnp.zeros((1, tokens), jnp.int32) if lengths is None else jnp.asarray(seq_idx_from_lengths(lengths))
    return arrays, seq_idx


@pytest.mark.parametrize("with_states", [False, True], ids=["no-states", "states"])
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_scan_matches_all_gather_forward_and_every_gradient(cp_size, with_states):
    for index, (name, lengths) in enumerate(packings(cp_size).items()):
        arrays, seq_idx = case_arrays(10 * cp_size + index, cp_size, lengths)
        got = {}
        for exchange in ("all_gather", "scan"):
            (_, (o, final)), grads = value_and_grads(cp_size, exchange, with_states, lengths is not None)(
                *arrays, seq_idx)
            got[exchange] = {"o": o, **({"final_state": final} if with_states else {}),
                             **{f"d{n}": x for n, x in zip(NAMES, grads) if with_states or n != "initial_state"}}
        for key, expected in got["all_gather"].items():
            assert np.any(np.asarray(expected)), f"{name} {key}: all zeros, the comparison would be empty"
            err = rel_err(got["scan"][key], expected)
            assert err <= 1e-6, f"cp {cp_size} {name} {key}: scan vs all_gather rel err {err:.2e}"


def collectives(cp_size, exchange, with_states=True):
    """Primitive names of the CP collectives in the jaxpr of the forward and backward."""
    arrays, seq_idx = case_arrays(0, cp_size, packings(cp_size)["spans-every-rank"])
    jaxpr = jax.make_jaxpr(value_and_grads(cp_size, exchange, with_states, True))(*arrays, seq_idx)
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.append(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return names


@pytest.mark.parametrize("cp_size", [2, 4])
def test_scan_issues_ppermute_rounds_and_no_all_gather(cp_size):
    names = collectives(cp_size, "scan")
    assert "all_gather" not in names
    rounds = math.ceil(math.log2(cp_size))
    # forward and backward: one ppermute per round each (the primal and the vjp's forward trace both
    # appear in a value_and_grad jaxpr, so at least the backward's rounds and the forward's)
    assert names.count("ppermute") >= 2 * rounds, names.count("ppermute")
    gathered = collectives(cp_size, "all_gather")
    assert "all_gather" in gathered and "ppermute" not in gathered


def test_auto_gathers_below_the_threshold_as_torch():
    assert SCAN_MIN_WORLD > 4
    assert "ppermute" not in collectives(4, "auto")


def test_unknown_summary_exchange_raises_a_value_error():
    arrays, seq_idx = case_arrays(0, 2, [LOCAL_LEN * 2])
    with pytest.raises(ValueError, match=r"summary_exchange must be one of .* received 'ring'"):
        gdp_chunkwise_context_parallel(*arrays[:5], mesh=jax.make_mesh((2,), ("cp",)), global_seq_idx=seq_idx,
                                       summary_exchange="ring")
