"""Initial and final sequence states under JAX CP (host devices, meshes of 1-3).

The global function with ``initial_state`` and ``output_final_state=True`` against the float64
``jax.grad`` of the naive recurrence and the one-device ``gated_delta_product``: outputs, final states
and the gradients of q, k, v, g, beta and the initial state, for a loss on both outputs. The per-shard
function returns each rank's rows of the final state (zeros where a sequence does not end), checked
inside a caller's shard_map.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cp_linear import reference as ref
from jax_api.gdp.chunk import JaxGDPBackend
from jax_api.gdp.cp import gdp_chunkwise_context_parallel, gdp_chunkwise_context_parallel_shard
from jax_api.gdp.ops import gated_delta_product
from tests.cp_linear.gdp_cases import random_gdp_inputs, seq_idx_from_lengths
from tests.jax_api.test_gdp_chunk import float64_reference_grads
from tests.tolerance import assert_close, gdp_length, tolerance

TOKENS, HEADS, KEY_DIM, VALUE_DIM = 24, 2, 7, 5
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

# three sequences each, so that one compiled program (ids and states are data) serves every packing
PACKINGS = {
    "sequence-spans-every-rank": [1, 22, 1],
    "short-sequences-at-rank-boundaries": [8, 1, 15],
    "rank-holds-many-sequences": [2, 1, 21],
}


def case_data(seed, lengths, num_householder):
    rng = np.random.default_rng(seed)
    batch = 2 if lengths is None else 1
    inputs = random_gdp_inputs(rng, batch=batch, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=num_householder)
    sequences = batch if lengths is None else len(lengths)
    initial = rng.normal(size=(sequences, HEADS, KEY_DIM, VALUE_DIM))
    output_grad = rng.normal(size=(batch, TOKENS, HEADS, VALUE_DIM))
    final_grad = rng.normal(size=initial.shape)
    return inputs, initial, output_grad, final_grad


@functools.lru_cache(maxsize=None)
def cp_grads(cp_size, num_householder, packed):
    """jit(value_and_grad) of sum(o * do) + sum(final * dfinal) through the global CP function."""
    mesh = jax.make_mesh((cp_size,), ("cp",))

    def loss(q, k, v, g, beta, initial, output_grad, final_grad, seq_idx):
        o, final = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx if packed else None,
                                                  num_householder=num_householder, backend=JaxGDPBackend(8),
                                                  initial_state=initial, output_final_state=True)
        return jnp.sum(o * output_grad) + jnp.sum(final * final_grad), (o, final)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


@functools.lru_cache(maxsize=None)
def one_device_grads(num_householder, packed):
    def loss(q, k, v, g, beta, init, output_grad, final_grad, cu):
        o, final = gated_delta_product(q, k, v, g, beta, num_householder=num_householder,
                                       cu_seqlens=cu if packed else None, initial_state=init,
                                       backend=JaxGDPBackend(8), check_inputs=False)
        return jnp.sum(o * output_grad) + jnp.sum(final * final_grad), (o, final)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


@pytest.mark.parametrize("cp_size, packed", [(1, True), (2, True), (3, True), (3, False)])
def test_states_and_all_gradients_match_float64_and_one_device(cp_size, packed):
    n_h = 1 + cp_size % 3
    for name, lengths in (PACKINGS.items() if packed else [("rows", None)]):
        inputs, initial, output_grad, final_grad = case_data(7 * cp_size + len(name), lengths, n_h)
        f32 = [jnp.asarray(x, jnp.float32) for x in (*inputs, initial, output_grad, final_grad)]
        ids = jnp.asarray(seq_idx_from_lengths(lengths) if packed else np.zeros((1, TOKENS)), jnp.int32)
        (_, (o, final)), grads = cp_grads(cp_size, n_h, packed)(*f32, ids)
        cu = None if lengths is None else np.r_[0, np.cumsum(lengths)]
        o_ref, final_ref = ref.naive_gated_delta_product(*inputs, num_householder=n_h, cu_seqlens=cu,
                                                         initial_state=initial)
        grads_ref = float64_reference_grads(inputs, output_grad, num_householder=n_h, lengths=lengths,
                                            initial_state=initial, final_grad=final_grad)
        cu_dev = jnp.asarray(cu if packed else [0, TOKENS], jnp.int32)
        (_, (o_one, final_one)), grads_one = one_device_grads(n_h, packed)(*f32, cu_dev)
        length = gdp_length(TOKENS, n_h, KEY_DIM)
        for label, o_exp, final_exp, grads_exp, tol in (
                ("float64", o_ref, final_ref, grads_ref, tolerance(length)),
                ("one-device", o_one, final_one, grads_one, tolerance(length, compared_with="rounded"))):
            assert_close(f"{name} cp {cp_size} o vs {label}", o_exp, o, tol)
            assert_close(f"{name} cp {cp_size} final vs {label}", final_exp, final, tol)
            for grad_name, expected, got in zip(NAMES, grads_exp, grads):
                assert_close(f"{name} cp {cp_size} d{grad_name} vs {label}", expected, got, tol)


def test_per_shard_final_rows_are_zero_where_a_sequence_does_not_end():
    cp_size, lengths = 3, [1, 22, 1]  # ends on ranks 0, 2, 2
    mesh = jax.make_mesh((cp_size,), ("cp",))
    inputs, initial, _, _ = case_data(3, lengths, 1)
    seq_idx = jnp.asarray(seq_idx_from_lengths(lengths), jnp.int32)

    def per_shard(q, k, v, g, beta, ids, init):
        _, final = gdp_chunkwise_context_parallel_shard(q, k, v, g, beta, global_seq_idx=ids, initial_state=init,
                                                        output_final_state=True, backend=JaxGDPBackend(8))
        return final[None]

    run = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, "cp"),) * 5 + (P(), P()),
                                out_specs=P("cp")))
    sharded = [jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, P(None, "cp"))) for x in inputs]
    replicated = [jax.device_put(x, NamedSharding(mesh, P())) for x in (seq_idx, jnp.asarray(initial, jnp.float32))]
    per_rank = np.asarray(run(*sharded, *replicated))
    _, final_ref = ref.naive_gated_delta_product(*inputs, cu_seqlens=np.r_[0, np.cumsum(lengths)],
                                                 initial_state=initial)
    end_rank = [0, 2, 2]
    for rank in range(cp_size):
        for row in range(3):
            if end_rank[row] != rank:
                assert not np.any(per_rank[rank, row]), (rank, row)
    assert_close("summed final", final_ref, per_rank.sum(0), tolerance(gdp_length(TOKENS, 1, KEY_DIM)))


@pytest.mark.parametrize("initial_shape, match", [
    ((4, HEADS, KEY_DIM, VALUE_DIM), r"initial_state must be \[N, H, K, V\] = \(3, 2, 7, 5\)"),
    ((3, HEADS, VALUE_DIM, KEY_DIM), r"initial_state must be \[N, H, K, V\]"),
])
def test_initial_state_of_the_wrong_shape_raises(initial_shape, match):
    inputs, _, _, _ = case_data(1, [1, 22, 1], 1)
    with pytest.raises(ValueError, match=match):
        gdp_chunkwise_context_parallel(*(jnp.asarray(x, jnp.float32) for x in inputs), mesh=jax.make_mesh((2,), ("cp",)),
                                       global_seq_idx=jnp.asarray(seq_idx_from_lengths([1, 22, 1]), jnp.int32),
                                       initial_state=jnp.zeros(initial_shape), output_final_state=True)


def test_integer_initial_state_raises():
    inputs, _, _, _ = case_data(1, None, 1)
    with pytest.raises(ValueError, match="initial_state must be floating point"):
        gdp_chunkwise_context_parallel(*(jnp.asarray(x, jnp.float32) for x in inputs), mesh=jax.make_mesh((2,), ("cp",)),
                                       initial_state=jnp.zeros((2, HEADS, KEY_DIM, VALUE_DIM), jnp.int32))
