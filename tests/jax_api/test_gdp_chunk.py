"""Pure-JAX GDP: the naive jnp recurrence, the chunked backend's four functions and the one-device op,
against the float64 numpy reference (outputs, summaries) and float64 ``jax.grad`` of the naive
recurrence (gradients)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cp_linear import compose_backward, compose_forward
from cp_linear import reference as ref
from cp_linear.gdp import GDPInputs
from jax_api.gdp.chunk import JaxGDPBackend
from jax_api.gdp.naive import naive_gated_delta_product, naive_recurrence
from jax_api.gdp.ops import gated_delta_product
from tests.cp_linear.gdp_cases import random_gdp_inputs, seq_idx_from_lengths
from tests.tolerance import SAFETY, assert_close, gdp_length, tolerance, unit_roundoff

HEADS, KEY_DIM, VALUE_DIM = 2, 7, 5  # odd sizes on purpose


def as_f32(*arrays):
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def sequence_index(lengths):
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _float64_vjp(num_householder, use_qk_l2norm, packed):
    def loss(q, k, v, g, beta, initial_state, seq_index, output_grad, final_grad):
        o, final = naive_recurrence(q, k, v, g, beta, seq_index if packed else None, initial_state,
                                    num_householder=num_householder, use_qk_l2norm_in_kernel=use_qk_l2norm)
        return jnp.sum(o * output_grad) + jnp.sum(final * final_grad)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def float64_reference_grads(inputs, output_grad, *, num_householder, use_qk_l2norm_in_kernel=False, lengths=None,
                            initial_state=None, final_grad=None):
    """Gradients of sum(o * output_grad) + sum(final * final_grad) w.r.t. (q, k, v, g, beta, initial_state).

    float64 ``jax.grad`` of the naive recurrence, jitted once per (n_h, l2norm, packed, shapes):
    the packing travels as data, with N = T states so every packing has the same shapes.
    """
    q = inputs[0]
    batch, tokens, heads, key_dim = q.shape
    states = tokens if lengths is not None else batch
    shape = (states, heads, key_dim, inputs[2].shape[-1])
    initial = np.zeros(shape) if initial_state is None else np.pad(initial_state, [(0, states - len(initial_state))]
                                                                   + [(0, 0)] * 3)
    dfinal = np.zeros(shape) if final_grad is None else np.pad(final_grad, [(0, states - len(final_grad))]
                                                               + [(0, 0)] * 3)
    seq = sequence_index(lengths) if lengths is not None else np.zeros((tokens,), np.int32)
    with jax.enable_x64(True):
        fn = _float64_vjp(num_householder, use_qk_l2norm_in_kernel, lengths is not None)
        grads = fn(*(jnp.asarray(x, jnp.float64) for x in inputs), jnp.asarray(initial, jnp.float64),
                   jnp.asarray(seq), jnp.asarray(output_grad, jnp.float64), jnp.asarray(dfinal, jnp.float64))
        grads = [np.asarray(x) for x in grads]
    grads[5] = grads[5][: (len(initial_state) if initial_state is not None else states)]
    return grads


# --------------------------------------------------------------------------- the naive recurrence


@pytest.mark.parametrize("num_householder", [3])
def test_naive_recurrence_matches_numpy_reference_in_float64(num_householder):
    rng = np.random.default_rng(num_householder)
    lengths = [4, 1, 8]
    inputs = random_gdp_inputs(rng, tokens=13, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=num_householder)
    cu = np.r_[0, np.cumsum(lengths)]
    init = rng.normal(size=(3, HEADS, KEY_DIM, VALUE_DIM))
    o_ref, final_ref = ref.naive_gated_delta_product(*inputs, num_householder=num_householder, cu_seqlens=cu,
                                                     initial_state=init, use_qk_l2norm_in_kernel=True)
    with jax.enable_x64(True):
        o, final = naive_gated_delta_product(*(jnp.asarray(x) for x in inputs), num_householder=num_householder,
                                             cu_seqlens=cu, initial_state=jnp.asarray(init),
                                             use_qk_l2norm_in_kernel=True)
        assert o.dtype == jnp.float64
    tol = tolerance(gdp_length(13, num_householder, KEY_DIM), dtype="float64", compared_with="rounded")
    assert_close("output", o_ref, o, tol)
    assert_close("final state", final_ref, final, tol)


def test_naive_recurrence_gradient_matches_finite_differences():
    rng = np.random.default_rng(7)
    inputs = random_gdp_inputs(rng, tokens=3, heads=1, key_dim=3, value_dim=2, num_householder=2)
    output_grad = rng.normal(size=(1, 3, 1, 2))
    grads = float64_reference_grads(inputs, output_grad, num_householder=2, lengths=[1, 2])
    cu = [0, 1, 3]

    def loss(arrays):
        o, _ = ref.naive_gated_delta_product(*arrays, num_householder=2, cu_seqlens=cu)
        return float(np.sum(o * output_grad))

    eps = 1e-6
    # central differences, per entry: truncation ~ eps^2 (unit-scale third derivatives), rounding ~ u |loss| / eps
    fd_error = eps**2 + unit_roundoff("float64") * abs(loss(inputs)) / eps
    for index, name in enumerate("q k v g beta".split()):
        flat = inputs[index].reshape(-1)
        numeric = np.zeros_like(flat)
        for j in range(flat.size):
            bumped = [x.copy() for x in inputs]
            bumped[index].reshape(-1)[j] += eps
            lowered = [x.copy() for x in inputs]
            lowered[index].reshape(-1)[j] -= eps
            numeric[j] = (loss(bumped) - loss(lowered)) / (2 * eps)
        assert_close(name, numeric, grads[index].reshape(-1), SAFETY * fd_error * np.sqrt(flat.size)
                     / np.linalg.norm(numeric))


# --------------------------------------------------------------------------- backend protocol


def packed_shard(rng, lengths, num_householder):
    """Random inputs of one packed shard and its local cu_seqlens int32 [N + 1]."""
    inputs = random_gdp_inputs(rng, tokens=sum(lengths), heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=num_householder)
    return inputs, jnp.asarray(np.r_[0, np.cumsum(lengths)], jnp.int32)


@pytest.mark.parametrize("num_householder, chunk_size", [(1, 4), (2, 64), (3, 4)])
def test_forward_summary_matches_reference_for_packed_and_batched_shards(num_householder, chunk_size):
    rng = np.random.default_rng(num_householder * 100 + chunk_size)
    backend = JaxGDPBackend(chunk_size=chunk_size)
    prepare = jax.jit(lambda shard: backend.cp_forward_prepare(shard)[0].packed)  # one compile per shape
    # a 1-token sequence, a start on a chunk boundary (token 4 with n_h = 1, chunk 4), a long tail
    lengths = [4, 1, 3, 9]
    inputs, cu = packed_shard(rng, lengths, num_householder)
    summary = prepare(GDPInputs(*as_f32(*inputs), scale=KEY_DIM**-0.5, cu_seqlens=cu, num_householder=num_householder))
    want = ref.shard_forward_summary(*inputs[1:], num_householder=num_householder,
                                     cu_seqlens=np.r_[0, np.cumsum(lengths)])
    assert summary.shape == (HEADS, KEY_DIM, VALUE_DIM + KEY_DIM) and summary.dtype == jnp.float32
    assert_close("packed summary", want, summary, tolerance(gdp_length(sum(lengths), num_householder, KEY_DIM)))

    rows = random_gdp_inputs(rng, batch=2, tokens=11, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                             num_householder=num_householder)
    summary = prepare(GDPInputs(*as_f32(*rows), scale=0.3, num_householder=num_householder,
                                use_qk_l2norm_in_kernel=True))
    want = ref.shard_forward_summary(*rows[1:], num_householder=num_householder, use_qk_l2norm_in_kernel=True)
    assert summary.shape == (2, HEADS, KEY_DIM, VALUE_DIM + KEY_DIM)
    assert_close("row summaries", want, summary, tolerance(gdp_length(11, num_householder, KEY_DIM)))


def random_summaries(rng, count, batch_shape=()):
    """Stacked forward/backward summaries [count, ..., H, K, V + K] with contractive transitions."""
    update = rng.normal(size=(count, *batch_shape, HEADS, KEY_DIM, VALUE_DIM))
    transition = 0.5 * rng.normal(size=(count, *batch_shape, HEADS, KEY_DIM, KEY_DIM)) / np.sqrt(KEY_DIM)
    return np.concatenate([update, transition], axis=-1)


@pytest.mark.parametrize("num_householder, use_qk_l2norm", [(1, False), (3, True)])
def test_apply_and_backward_match_float64_oracle_for_a_packed_shard(num_householder, use_qk_l2norm):
    rng = np.random.default_rng(num_householder)
    backend = JaxGDPBackend(chunk_size=8)
    lengths = [6, 1, 2, 8]
    inputs, cu = packed_shard(rng, lengths, num_householder)
    preceding, following = random_summaries(rng, 2), random_summaries(rng, 3)
    incoming, outgoing_grad = compose_forward(preceding), compose_backward(following)
    output_grad = rng.normal(size=(1, sum(lengths), HEADS, VALUE_DIM))

    local_inputs = GDPInputs(*as_f32(*inputs), scale=KEY_DIM**-0.5, cu_seqlens=cu, num_householder=num_householder,
                             use_qk_l2norm_in_kernel=use_qk_l2norm)

    @jax.jit
    def protocol(local_inputs, preceding, output_grad, following):  # the frontend's call order
        summary, local = backend.cp_forward_prepare(local_inputs)
        output, saved = backend.cp_forward_apply(local, preceding)
        backward_summary, context = backend.cp_backward_prepare(output_grad, saved)
        return summary.packed, output, backward_summary.packed, backend.cp_backward_apply(context, following)

    summary, output, backward_summary, grads = protocol(local_inputs, *as_f32(preceding, output_grad, following))

    initial = np.zeros((len(lengths), HEADS, KEY_DIM, VALUE_DIM))
    initial[0] = incoming  # the incoming state reaches only the first sequence
    o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=num_householder,
                                             cu_seqlens=np.r_[0, np.cumsum(lengths)],
                                             initial_state=initial, use_qk_l2norm_in_kernel=use_qk_l2norm)
    tol = tolerance(gdp_length(sum(lengths), num_householder, KEY_DIM))
    assert output.dtype == jnp.float32
    assert_close("output", o_ref, output, tol)
    # gamma: gradient of the local loss w.r.t. the incoming state, at zero outgoing gradient
    local_only = float64_reference_grads(inputs, output_grad, num_householder=num_householder,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm, lengths=lengths, initial_state=initial)
    gamma, transposed = np.split(np.asarray(backward_summary), [VALUE_DIM], axis=-1)
    assert_close("gamma", local_only[5][0], gamma, tol)
    np.testing.assert_array_equal(transposed, np.swapaxes(np.asarray(summary)[..., VALUE_DIM:], -1, -2))
    # input gradients: local loss plus dS_out flowing into the last sequence's final state
    final_grad = np.zeros_like(initial)
    final_grad[-1] = outgoing_grad
    want = float64_reference_grads(inputs, output_grad, num_householder=num_householder, lengths=lengths,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm, initial_state=initial, final_grad=final_grad)
    for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, want):
        assert got.dtype == jnp.float32
        assert_close(name, expected, got, tol)


def test_apply_accepts_an_empty_preceding_stack_and_batched_rows():
    rng = np.random.default_rng(11)
    backend = JaxGDPBackend(chunk_size=4)
    rows = random_gdp_inputs(rng, batch=2, tokens=9, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                             num_householder=2)

    @jax.jit
    def forward(shard):
        _, local = backend.cp_forward_prepare(shard)
        return backend.cp_forward_apply(local, jnp.zeros((0, 2, HEADS, KEY_DIM, VALUE_DIM + KEY_DIM))).output

    output = forward(GDPInputs(*as_f32(*rows), scale=0.4, num_householder=2))
    o_ref, _ = ref.naive_gated_delta_product(*rows, num_householder=2, scale=0.4)
    assert_close("output", o_ref, output, tolerance(gdp_length(9, 2, KEY_DIM)))


def test_empty_sequences_in_cu_seqlens_change_nothing():
    rng = np.random.default_rng(5)
    backend = JaxGDPBackend(chunk_size=4)
    inputs, cu = packed_shard(rng, [3, 6], 1)
    preceding = jnp.asarray(random_summaries(rng, 1), jnp.float32)

    @jax.jit
    def forward(shard):
        summary, local = backend.cp_forward_prepare(shard)
        return summary.packed, backend.cp_forward_apply(local, preceding).output

    plain = forward(GDPInputs(*as_f32(*inputs), scale=0.5, cu_seqlens=cu))
    with_empty = forward(GDPInputs(*as_f32(*inputs), scale=0.5, cu_seqlens=jnp.asarray([0, 3, 3, 9, 9], jnp.int32)))
    tol = tolerance(gdp_length(9, 1, KEY_DIM), compared_with="rounded")  # more chunk slots: other batch shapes
    assert_close("summary", plain[0], with_empty[0], tol)
    assert_close("output", plain[1], with_empty[1], tol)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_backend_rejects_a_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        JaxGDPBackend(chunk_size=chunk_size)


# --------------------------------------------------------------------------- one-device op


@functools.lru_cache(maxsize=None)
def _jitted_op(num_householder, use_qk_l2norm, chunk_size, packed):
    backend = JaxGDPBackend(chunk_size=chunk_size)

    def loss(q, k, v, g, beta, initial_state, cu_seqlens, output_grad, final_grad):
        o, final = gated_delta_product(q, k, v, g, beta, num_householder=num_householder,
                                       cu_seqlens=cu_seqlens if packed else None, initial_state=initial_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm, backend=backend)
        return jnp.sum(o * output_grad) + jnp.sum(final * final_grad), (o, final)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


@pytest.mark.parametrize(
    "num_householder, use_qk_l2norm, chunk_size",
    [pytest.param(2, True, 5, id="nh2-l2norm-chunk5"), pytest.param(3, False, 64, id="nh3-chunk64-multichunk")],
)
def test_op_with_cu_seqlens_matches_references_and_reuses_its_program(num_householder, use_qk_l2norm, chunk_size):
    rng = np.random.default_rng(num_householder)
    tokens = 45  # 135 steps with n_h = 3: three chunks of 64
    fn = _jitted_op(num_householder, use_qk_l2norm, chunk_size, True)
    for lengths in ([1, 30, 14], [20, 24, 1]):  # same N: the compiled program is reused
        inputs = random_gdp_inputs(rng, tokens=tokens, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                                   num_householder=num_householder)
        cu = np.r_[0, np.cumsum(lengths)]
        init = rng.normal(size=(3, HEADS, KEY_DIM, VALUE_DIM))
        output_grad = rng.normal(size=(1, tokens, HEADS, VALUE_DIM))
        final_grad = rng.normal(size=init.shape)
        (_, (o, final)), grads = fn(*as_f32(*inputs, init), jnp.asarray(cu, jnp.int32),
                                    *as_f32(output_grad, final_grad))
        o_ref, final_ref = ref.naive_gated_delta_product(*inputs, num_householder=num_householder, cu_seqlens=cu,
                                                         initial_state=init, use_qk_l2norm_in_kernel=use_qk_l2norm)
        tol = tolerance(gdp_length(tokens, num_householder, KEY_DIM))
        assert_close(f"{lengths} output", o_ref, o, tol)
        assert_close(f"{lengths} final state", final_ref, final, tol)
        want = float64_reference_grads(inputs, output_grad, num_householder=num_householder, lengths=lengths,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm, initial_state=init, final_grad=final_grad)
        for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads, want):
            assert_close(f"{lengths} {name}", expected, got, tol)
    assert fn._cache_size() == 1


def test_op_with_batch_rows_matches_references():
    rng = np.random.default_rng(3)
    inputs = random_gdp_inputs(rng, batch=3, tokens=10, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                               num_householder=2)
    init = rng.normal(size=(3, HEADS, KEY_DIM, VALUE_DIM))
    output_grad, final_grad = rng.normal(size=(3, 10, HEADS, VALUE_DIM)), rng.normal(size=init.shape)
    (_, (o, final)), grads = _jitted_op(2, False, 4, False)(*as_f32(*inputs, init), jnp.zeros((2,), jnp.int32),
                                                             *as_f32(output_grad, final_grad))
    o_ref, final_ref = ref.naive_gated_delta_product(*inputs, num_householder=2, initial_state=init)
    tol = tolerance(gdp_length(10, 2, KEY_DIM))
    assert_close("output", o_ref, o, tol)
    assert_close("final state", final_ref, final, tol)
    want = float64_reference_grads(inputs, output_grad, num_householder=2, initial_state=init, final_grad=final_grad)
    for name, got, expected in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads, want):
        assert_close(name, expected, got, tol)


def test_op_with_seq_idx_equals_op_with_cu_seqlens():
    rng = np.random.default_rng(4)
    lengths = [2, 5, 1]
    inputs = as_f32(*random_gdp_inputs(rng, tokens=8, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM))
    backend = JaxGDPBackend(chunk_size=4)
    cu = np.r_[0, np.cumsum(lengths)]
    by_cu = jax.jit(lambda cu: gated_delta_product(*inputs, cu_seqlens=cu, backend=backend))(cu)
    ids = seq_idx_from_lengths(lengths) + 7  # concrete ids: N is read on the host
    by_ids = jax.jit(lambda *x: gated_delta_product(*x, seq_idx=ids, backend=backend))(*inputs)
    tol = tolerance(gdp_length(8, 1, KEY_DIM), compared_with="rounded")
    assert_close("output", by_cu[0], by_ids[0], tol)
    assert_close("final state", by_cu[1], by_ids[1], tol)
    # traced ids need initial_state to fix the number of sequences
    init = jnp.zeros((3, HEADS, KEY_DIM, VALUE_DIM))
    traced = jax.jit(lambda ids: gated_delta_product(*inputs, seq_idx=ids, initial_state=init, backend=backend))
    assert_close("output, traced ids", by_cu[0], traced(jnp.asarray(seq_idx_from_lengths(lengths)))[0], tol)


def test_op_takes_no_gate_and_empty_sequences():
    """g=None is a zero gate; an empty sequence of cu_seqlens ends in its initial state and passes
    its final-state gradient to it (flash-linear-attention's varlen conventions)."""
    rng = np.random.default_rng(12)
    inputs = random_gdp_inputs(rng, tokens=14, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, num_householder=2)
    q, k, v, _, beta = as_f32(*inputs)
    init = jnp.asarray(rng.normal(size=(4, HEADS, KEY_DIM, VALUE_DIM)), jnp.float32)
    dfinal = jnp.asarray(rng.normal(size=init.shape), jnp.float32)
    cu = np.array([0, 0, 5, 5, 14])
    backend = JaxGDPBackend(chunk_size=4)

    def loss(q, initial):
        o, final = gated_delta_product(q, k, v, None, beta, num_householder=2, cu_seqlens=cu, initial_state=initial,
                                       backend=backend)
        return jnp.sum(o) + jnp.sum(final * dfinal), (o, final)

    (_, (o, final)), (dq, dinit) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, init)
    empty = np.array([0, 2])
    np.testing.assert_array_equal(np.asarray(final)[empty], np.asarray(init)[empty])
    np.testing.assert_array_equal(np.asarray(dinit)[empty], np.asarray(dfinal)[empty])
    o_ref, final_ref = ref.naive_gated_delta_product(*inputs[:3], None, inputs[4], num_householder=2, cu_seqlens=cu,
                                                     initial_state=np.asarray(init, np.float64))
    tol = tolerance(gdp_length(14, 2, KEY_DIM))
    assert_close("output", o_ref, o, tol)
    assert_close("final state", final_ref, final, tol)
    want = float64_reference_grads((*inputs[:3], np.zeros_like(inputs[3]), inputs[4]), np.ones(o.shape),
                                   num_householder=2, lengths=[5, 9], initial_state=np.asarray(init)[[1, 3]],
                                   final_grad=np.asarray(dfinal)[[1, 3]])
    assert_close("dq", want[0], dq, tol)
    assert_close("dinitial_state of the nonempty sequences", want[5], np.asarray(dinit)[[1, 3]], tol)


def test_op_keeps_bfloat16_inputs_in_bfloat16_with_a_float32_state():
    rng = np.random.default_rng(9)
    inputs = random_gdp_inputs(rng, tokens=12, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, num_householder=2)
    low = [jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]] + list(as_f32(*inputs[3:]))
    o, final = jax.jit(lambda *x: gated_delta_product(*x, num_householder=2, cu_seqlens=np.array([0, 5, 12]),
                                                      backend=JaxGDPBackend(chunk_size=4)))(*low)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    rounded = [np.asarray(x, np.float64) for x in low]
    o_ref, _ = ref.naive_gated_delta_product(*rounded, num_householder=2, cu_seqlens=[0, 5, 12])
    # one bfloat16 rounding of the output (at most u) on top of the float32 computation
    assert_close("bfloat16 output", o_ref, o, unit_roundoff("bfloat16") + tolerance(gdp_length(12, 2, KEY_DIM)))
    grads = jax.jit(jax.grad(lambda v: jnp.sum(gated_delta_product(low[0], low[1], v, *low[3:], num_householder=2)[0]
                                               .astype(jnp.float32))))(low[2])
    assert grads.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param(dict(k_len=11), "k must have shape", id="k-length-mismatch"),
        pytest.param(dict(k_dtype=jnp.bfloat16), "q, k and v must share one dtype", id="k-dtype-mismatch"),
        pytest.param(dict(q_int=True), "q must have a floating dtype", id="integer-q"),
        pytest.param(dict(cu_seqlens=np.array([0, 5, 3, 12])), "nondecreasing from 0 to T = 12", id="decreasing"),
        pytest.param(dict(cu_seqlens=np.array([0, 5, 11])), "nondecreasing from 0 to T = 12", id="cu-short-of-T"),
        pytest.param(dict(seq_idx=np.array([[0] * 6 + [1] * 3 + [0] * 3])), "nondecreasing", id="seq-idx-drops"),
        pytest.param(dict(initial_state=np.zeros((3, HEADS, KEY_DIM, VALUE_DIM))),
                     r"initial_state must be \[N, H, K, V\]",
                     id="initial-state-count"),
        pytest.param(dict(both=True), "cu_seqlens or seq_idx, not both", id="cu-and-seq-idx"),
    ],
)
def test_op_rejects_bad_input_with_a_clear_message(change, message):
    rng = np.random.default_rng(0)
    q, k, v, g, beta = as_f32(*random_gdp_inputs(rng, tokens=12, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM))
    kwargs = dict(cu_seqlens=np.array([0, 5, 12]))
    if "k_len" in change:
        k = k[:, : change["k_len"]]
    if "k_dtype" in change:
        k = k.astype(change["k_dtype"])
    if change.get("q_int"):
        q = q.astype(jnp.int32)
    if "cu_seqlens" in change:
        kwargs["cu_seqlens"] = change["cu_seqlens"]
    if "seq_idx" in change:
        kwargs = dict(seq_idx=change["seq_idx"])
    if "initial_state" in change:
        kwargs["initial_state"] = change["initial_state"]
    if change.get("both"):
        kwargs["seq_idx"] = seq_idx_from_lengths([5, 7])
    with pytest.raises(ValueError, match=message):
        gated_delta_product(q, k, v, g, beta, **kwargs)
