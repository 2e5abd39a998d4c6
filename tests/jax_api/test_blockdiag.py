"""Block-diagonal attention under CP on CPU host devices: every mode against full-sequence references.

Outputs are checked against the float64 numpy reference, dq/dk/dv against ``jax.grad`` of the
plain jnp reference over the full (unsharded) sequence. The ragged all-to-all HLO has no XLA:CPU
implementation, so its routing is checked here through an emulation of the documented
``lax.ragged_all_to_all`` semantics; the real collective runs only on GPU.
"""

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from cp_linear import build_blockdiag_plan
from cp_linear.plan import exchange_tokens_received
from cp_linear.reference import blockdiag_attention as reference_attention
from jax_api import blockdiag_attention, blockdiag_attention_shard
from jax_api.attention import exchange
from jax_api.attention.blockdiag import plan_blockdiag_exchange, received_tokens_per_rank
from jax_api.attention.naive import naive_blockdiag_attention
from tests.tolerance import assert_close, attention_length, tolerance, unit_roundoff

LOCAL_LEN = 15  # odd, so that documents and tiles never line up by accident
HEAD_DIM = 20
BATCH = 2


def attention_tolerance(tokens, compared_with="exact"):
    """float32 bound of attention over ``tokens`` keys of dimension HEAD_DIM (tests/tolerance.py)."""
    return tolerance(attention_length(tokens, HEAD_DIM), compared_with=compared_with)


def doc_ids_from_runs(runs):
    """[(doc id, length), ...] -> int32 [T]; id 0 = padding."""
    return np.concatenate([np.full(length, doc, np.int32) for doc, length in runs])


# (id, cp, runs, (Hq, Hkv)); every case has T = cp * LOCAL_LEN.
CASES = [
    pytest.param(2, [(1, 9), (2, 14), (3, 7)], (4, 2), id="cp2-doc-straddles-two-ranks-gqa4to2"),
    pytest.param(4, [(1, 60)], (4, 2), id="cp4-one-document-over-all-ranks"),
    pytest.param(3, [(1, 8), (0, 5), (2, 14), (0, 3), (3, 10), (0, 5)], (2, 1), id="cp3-interior-padding-gqa2to1"),
    pytest.param(4, [(1, 12), (0, 18), (2, 20), (3, 10)], (4, 2), id="cp4-all-padding-rank"),
    pytest.param(3, [(1, 15), (2, 15), (3, 10), (0, 5)], (2, 1), id="cp3-documents-end-on-boundaries"),
    pytest.param(4, [(0, 4), (7, 35), (5, 16), (0, 5)], (4, 2), id="cp4-document-spans-three-ranks"),
    pytest.param(1, [(2, 6), (0, 2), (1, 7)], (2, 1), id="cp1-single-device"),
]


def make_inputs(cp, heads, seed=0):
    q_heads, kv_heads = heads
    tokens = cp * LOCAL_LEN
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, tokens, q_heads, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((BATCH, tokens, kv_heads, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((BATCH, tokens, kv_heads, HEAD_DIM)).astype(np.float32)
    cotangent = rng.standard_normal((BATCH, tokens, q_heads, HEAD_DIM)).astype(np.float32)
    return q, k, v, cotangent


@lru_cache(maxsize=None)
def cp_mesh(cp, axis_name="cp"):
    return Mesh(np.array(jax.devices()[:cp]), (axis_name,))


@lru_cache(maxsize=None)
def cp_value_and_grad(cp):
    """One jitted (loss, out) and (dq, dk, dv) per mesh; the plan is an argument, so cases share it."""
    mesh = cp_mesh(cp)

    def loss(q, k, v, plan, cotangent):
        out = blockdiag_attention(q, k, v, plan, mesh=mesh)
        return jnp.sum(out * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _naive_loss(q, k, v, doc_ids, cotangent):
    return jnp.sum(naive_blockdiag_attention(q, k, v, doc_ids) * cotangent)


naive_grads = jax.jit(jax.grad(_naive_loss, argnums=(0, 1, 2)))


def check_against_references(doc_ids, inputs, out, grads):
    q, k, v, cotangent = inputs
    want_out = reference_attention(q, k, v, doc_ids)
    assert_close("output", want_out, out, attention_tolerance(len(doc_ids)))
    padding = doc_ids == 0
    assert np.all(np.asarray(out)[:, padding] == 0), "padding rows must be exactly zero"
    want_grads = naive_grads(q, k, v, doc_ids, cotangent)  # float32 jax.grad of the naive attention
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(name, want, got, attention_tolerance(len(doc_ids), compared_with="rounded"))
        assert np.all(np.asarray(got)[:, padding] == 0), f"{name} of padding tokens must be exactly zero"


def modes_for(cp, doc_ids):
    host_plan = build_blockdiag_plan(doc_ids, cp)
    return ["allgather", "a2a"] + (["halo"] if host_plan.use_halo else [])


@pytest.mark.parametrize("cp, runs, heads", CASES)
def test_every_mode_matches_full_sequence_attention_and_grads(cp, runs, heads):
    doc_ids = doc_ids_from_runs(runs)
    inputs = make_inputs(cp, heads)
    for mode in modes_for(cp, doc_ids):
        plan = plan_blockdiag_exchange(doc_ids, cp, mode=mode, platform="cpu")
        (_, out), grads = cp_value_and_grad(cp)(*inputs[:3], plan, inputs[3])
        check_against_references(doc_ids, inputs, out, grads)


def test_auto_picks_halo_when_straddles_fit_and_a2a_for_one_document_over_all_ranks():
    straddle = doc_ids_from_runs([(1, 9), (2, 14), (3, 7)])
    assert plan_blockdiag_exchange(straddle, 2).mode == "halo"
    everywhere = doc_ids_from_runs([(1, 60)])
    plan = plan_blockdiag_exchange(everywhere, 4, platform="cpu")
    assert (plan.mode, plan.a2a_impl) == ("a2a", "ppermute")
    assert plan_blockdiag_exchange(everywhere, 4, platform="gpu").a2a_impl == "ragged"


def test_eager_call_with_concrete_doc_ids_matches_reference_and_keeps_sharding():
    doc_ids = doc_ids_from_runs([(1, 9), (2, 14), (3, 7)])
    q, k, v, _ = make_inputs(2, (4, 2), seed=1)
    out = blockdiag_attention(q, k, v, doc_ids, mesh=cp_mesh(2), mode="halo")
    assert_close("output", reference_attention(q, k, v, doc_ids), out, attention_tolerance(len(doc_ids)))
    assert out.sharding.spec == P(None, "cp")


def test_explicit_mesh_under_jit_and_grad():
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(jax.sharding.AxisType.Explicit,))
    doc_ids = doc_ids_from_runs([(1, 9), (2, 14), (3, 7)])
    inputs = make_inputs(2, (4, 2), seed=2)
    plan = plan_blockdiag_exchange(doc_ids, 2)

    def loss(q, k, v, plan, cotangent):
        out = blockdiag_attention(q, k, v, plan, mesh=mesh)
        return jnp.sum(out * cotangent), out

    with jax.set_mesh(mesh):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *inputs[:3], plan, inputs[3])
    check_against_references(doc_ids, inputs, out, grads)


def test_new_packing_of_the_same_shape_class_does_not_retrace():
    traces = []
    mesh = cp_mesh(2)

    @jax.jit
    def attend(q, k, v, plan):
        traces.append(plan.halo_len)
        return blockdiag_attention(q, k, v, plan, mesh=mesh)

    q, k, v, _ = make_inputs(2, (2, 1), seed=3)
    first = doc_ids_from_runs([(1, 9), (2, 14), (3, 7)])  # back = [0, 6] -> halo 8
    second = doc_ids_from_runs([(4, 10), (0, 2), (6, 13), (5, 5)])  # back = [0, 3] -> halo 4 ... class differs
    third = doc_ids_from_runs([(2, 8), (1, 12), (9, 10)])  # back = [0, 7] -> halo 8, same class as first
    for doc_ids in (first, third):
        out = attend(q, k, v, plan_blockdiag_exchange(doc_ids, 2))
        assert_close("output", reference_attention(q, k, v, doc_ids), out, attention_tolerance(len(doc_ids)))
    assert traces == [8]
    attend(q, k, v, plan_blockdiag_exchange(second, 2))
    assert traces == [8, 4]


def test_shard_variant_inside_a_callers_shard_map():
    doc_ids = doc_ids_from_runs([(1, 12), (0, 18), (2, 20), (3, 10)])
    q, k, v, _ = make_inputs(4, (4, 2), seed=4)
    mesh = cp_mesh(4, "seq")
    plan = plan_blockdiag_exchange(doc_ids, 4, mode="allgather")

    def body(q, k, v, plan):
        return blockdiag_attention_shard(q, k, v, plan=plan, axis_name="seq") * 2.0

    spec = P(None, "seq")
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec))(q, k, v, plan)
    assert_close("output", 2.0 * reference_attention(q, k, v, doc_ids), out, attention_tolerance(len(doc_ids)))


def test_bfloat16_inputs_give_bfloat16_outputs_close_to_reference():
    doc_ids = doc_ids_from_runs([(1, 9), (2, 14), (3, 7)])
    q, k, v, _ = make_inputs(2, (4, 2), seed=5)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    out = blockdiag_attention(*bf16, doc_ids, mesh=cp_mesh(2))
    assert out.dtype == jnp.bfloat16
    want = reference_attention(*[np.asarray(x.astype(jnp.float32)) for x in bf16], doc_ids)
    # float32 math on the bfloat16 inputs, then one bfloat16 rounding of the output
    assert_close("bfloat16 output", want, out.astype(jnp.float32),
                 unit_roundoff("bfloat16") + attention_tolerance(len(doc_ids)))


# ------------------------------------------------------------------ collectives and bytes


def _primitive_names(fn, *args):
    return [eqn.primitive.name for eqn in _all_eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def _all_eqns(jaxpr):
    """Every equation, descending into sub-jaxprs (jit, shard_map, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@pytest.mark.parametrize(
    "mode, runs, forward, backward",
    [
        pytest.param("allgather", [(1, 9), (2, 21)], {"all_gather": 1}, {"reduce_scatter": 1}, id="allgather"),
        pytest.param("halo", [(1, 9), (2, 21)], {"ppermute": 1}, {"ppermute": 2}, id="halo"),
        pytest.param("a2a", [(1, 45)], {"ppermute": 2}, {"ppermute": 4}, id="a2a-one-ppermute-per-distance"),
    ],
)
def test_exchange_collectives_and_their_transposes(mode, runs, forward, backward):
    doc_ids = doc_ids_from_runs(runs)
    cp = len(doc_ids) // LOCAL_LEN
    q, k, v, _ = make_inputs(cp, (2, 1))
    plan = plan_blockdiag_exchange(doc_ids, cp, mode=mode, platform="cpu")
    mesh = cp_mesh(cp)

    def attend(q, k, v):
        return blockdiag_attention(q, k, v, plan, mesh=mesh)

    names = _primitive_names(attend, q, k, v)
    grad_names = _primitive_names(jax.grad(lambda *a: attend(*a).sum(), argnums=(0, 1, 2)), q, k, v)
    for name, count in forward.items():
        assert names.count(name) == count, names
    for name, count in backward.items():
        assert grad_names.count(name) == count, grad_names


def test_received_tokens_match_the_exact_plan_counts_without_bucketing():
    doc_ids = doc_ids_from_runs([(0, 4), (7, 35), (5, 16), (0, 5)])
    host_plan = build_blockdiag_plan(doc_ids, 4)
    ragged = plan_blockdiag_exchange(doc_ids, 4, mode="a2a", platform="gpu")
    assert received_tokens_per_rank(ragged) == exchange_tokens_received(host_plan, "a2a")
    exact = plan_blockdiag_exchange(doc_ids, 4, mode="a2a", a2a_impl="ppermute", bucket_sizes=False)
    # rank 2 needs 15 tokens from rank 1 and 11 from rank 0, so distance 2 carries 11 rows everywhere.
    assert exact.piece_lens == (15, 11, 0)
    assert received_tokens_per_rank(exact) == [0, 15, 26, 26]
    assert received_tokens_per_rank(plan_blockdiag_exchange(doc_ids, 4, mode="allgather")) == [45] * 4
    halo_ids = doc_ids_from_runs([(1, 9), (2, 14), (3, 22)])
    halo = plan_blockdiag_exchange(halo_ids, 3, mode="halo", bucket_sizes=False)
    assert received_tokens_per_rank(halo) == exchange_tokens_received(build_blockdiag_plan(halo_ids, 3), "halo")
    assert plan_blockdiag_exchange(halo_ids, 3, mode="halo").halo_len == 8  # back 7 rounds up to 8


# ------------------------------------------------------------------ ragged all-to-all routing (emulated on CPU)


def _dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """The documented forward semantics of ``lax.ragged_all_to_all`` from dense collectives."""
    width = operand.shape[0]
    rows = jnp.arange(width)
    take = jnp.clip(input_offsets[:, None] + rows[None, :], 0, width - 1)
    sending = rows[None, :] < send_sizes[:, None]
    mask_shape = (*sending.shape, *([1] * (operand.ndim - 1)))
    pieces = jnp.where(sending.reshape(mask_shape), operand[take], 0)  # [peers, width, ...]
    received = jax.lax.all_to_all(pieces, axis_name, 0, 0, tiled=True)
    where_written = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = where_written[:, None] + rows[None, :]
    target = jnp.where(rows[None, :] < recv_sizes[:, None], target, output.shape[0])  # out of range: dropped
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _emulated_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    return _dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)


def _emulated_ragged_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    out = _dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)
    return out, (jnp.zeros_like(operand), input_offsets, send_sizes, output_offsets, recv_sizes)


def _emulated_ragged_bwd(axis_name, residuals, cotangent):
    # JAX's own transpose rule: send the received slices back and *write* (not add) them at the
    # senders' offsets, so overlapping sends would lose gradient exactly as on GPU.
    zeros, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
    written_at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    sent_from = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
    operand_t = _dense_ragged_all_to_all(cotangent, zeros, written_at, recv_sizes, sent_from, send_sizes, axis_name)
    # exchange.py passes a constant zeros buffer as ``output``: it needs no cotangent.
    return operand_t, None, None, None, None, None


_emulated_ragged.defvjp(_emulated_ragged_fwd, _emulated_ragged_bwd)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """``lax.ragged_all_to_all`` (forward and JAX's transpose rule) emulated with dense collectives."""
    assert axis_index_groups is None
    return _emulated_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)


def test_emulated_ragged_all_to_all_reproduces_the_documented_example():
    mesh = cp_mesh(2, "x")

    def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        return emulated_ragged_all_to_all(operand, jnp.zeros(4), input_offsets[0], send_sizes[0], output_offsets[0],
                                          recv_sizes[0], axis_name="x")

    args = (
        np.array([1, 2, 2, 3, 4, 0], np.float32),
        np.array([[0, 1], [0, 1]], np.int32),
        np.array([[1, 2], [1, 1]], np.int32),
        np.array([[0, 0], [1, 2]], np.int32),
        np.array([[1, 1], [2, 1]], np.int32),
    )
    out = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))(*args)
    assert np.asarray(out).tolist() == [1, 3, 0, 0, 2, 2, 4, 0]


@pytest.mark.parametrize("cp, runs, heads", [CASES[1], CASES[3], CASES[5]])
def test_ragged_routing_matches_references_through_an_emulated_collective(monkeypatch, cp, runs, heads):
    monkeypatch.setattr(exchange.jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    doc_ids = doc_ids_from_runs(runs)
    inputs = make_inputs(cp, heads, seed=6)
    plan = plan_blockdiag_exchange(doc_ids, cp, mode="a2a", platform="gpu")
    assert plan.a2a_impl == "ragged"
    mesh = cp_mesh(cp)

    def loss(q, k, v, plan, cotangent):
        out = blockdiag_attention(q, k, v, plan, mesh=mesh)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs[:3], plan, inputs[3])
    check_against_references(doc_ids, inputs, out, grads)


# ------------------------------------------------------------------ bad input: clear errors at trace time


def _call(q_shape=(2, 30, 4, 20), kv_shape=(2, 30, 2, 20), q_dtype=np.float32, kv_dtype=np.float32,
          doc_ids=None, axis_name="cp", mode="auto", cp=2):
    q = np.zeros(q_shape, q_dtype)
    k = np.zeros(kv_shape, kv_dtype)
    doc_ids = doc_ids_from_runs([(1, q_shape[1])]) if doc_ids is None else doc_ids
    # jax.eval_shape traces without running anything: the errors come from tracing alone.
    return jax.eval_shape(lambda q, k, v: blockdiag_attention(q, k, v, doc_ids, mesh=cp_mesh(cp), axis_name=axis_name,
                                                              mode=mode), q, k, k)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(q_shape=(2, 30, 4)), "must be 4-D", id="q-not-4d"),
        pytest.param(dict(kv_shape=(2, 30, 2, 16)), r"k/v must be \[B, T, Hkv, D\]", id="head-dim-mismatch"),
        pytest.param(dict(kv_shape=(2, 28, 2, 20)), r"k/v must be \[B, T, Hkv, D\]", id="length-mismatch"),
        pytest.param(dict(kv_shape=(2, 30, 3, 20)), "multiple of k/v heads", id="gqa-heads-not-divisible"),
        pytest.param(dict(kv_dtype=np.float16), "one floating dtype", id="dtype-mismatch"),
        pytest.param(dict(q_dtype=np.int32, kv_dtype=np.int32), "one floating dtype", id="integer-inputs"),
        pytest.param(dict(q_shape=(2, 31, 4, 20), kv_shape=(2, 31, 2, 20)), "must be divisible by the size 2",
                     id="T-not-divisible-by-axis"),
        pytest.param(dict(axis_name="sp"), "not an axis of the mesh", id="unknown-axis-name"),
        pytest.param(dict(doc_ids=doc_ids_from_runs([(1, 5), (2, 5), (1, 20)])), "more than one contiguous run",
                     id="document-id-reappears"),
        pytest.param(dict(doc_ids=doc_ids_from_runs([(1, 28)])), r"doc_ids must have shape \[T\]",
                     id="doc-ids-wrong-length"),
        pytest.param(dict(doc_ids=doc_ids_from_runs([(1, 10), (-1, 20)])), "must be ≥ 0", id="negative-doc-id"),
        pytest.param(dict(mode="ring"), "mode must be one of", id="unknown-mode"),
        pytest.param(dict(doc_ids=doc_ids_from_runs([(1, 60)]), q_shape=(2, 60, 4, 20), kv_shape=(2, 60, 2, 20),
                          cp=4, mode="halo"), "mode='halo' needs every document straddle", id="halo-impossible"),
    ],
)
def test_bad_input_raises_a_clear_value_error_at_trace_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _call(**kwargs)


def test_halo_raises_when_a_document_spans_three_ranks_even_with_a_prebuilt_plan():
    doc_ids = doc_ids_from_runs([(0, 4), (7, 35), (5, 16), (0, 5)])
    with pytest.raises(ValueError, match="mode='halo' needs every document straddle"):
        plan_blockdiag_exchange(doc_ids, 4, mode="halo")
    plan = plan_blockdiag_exchange(doc_ids, 4)
    q = np.zeros((1, 60, 2, 8), np.float32)
    with pytest.raises(ValueError, match="mode='halo' was requested but the plan was built for mode='a2a'"):
        jax.eval_shape(lambda q: blockdiag_attention(q, q, q, plan, mesh=cp_mesh(4), mode="halo"), q)


def test_traced_doc_ids_raise_and_point_to_the_plan():
    q = np.zeros((1, 30, 2, 8), np.float32)
    with pytest.raises(ValueError, match="doc_ids must be concrete"):
        jax.jit(lambda q, ids: blockdiag_attention(q, q, q, ids, mesh=cp_mesh(2)))(q, np.ones(30, np.int32))


def test_plan_for_another_world_size_raises():
    plan = plan_blockdiag_exchange(doc_ids_from_runs([(1, 30)]), 3)
    q = np.zeros((1, 30, 2, 8), np.float32)
    with pytest.raises(ValueError, match="the plan is for cp_size = 3"):
        jax.eval_shape(lambda q: blockdiag_attention(q, q, q, plan, mesh=cp_mesh(2)), q)


def test_shard_variant_raises_for_an_unbound_axis_name():
    plan = plan_blockdiag_exchange(doc_ids_from_runs([(1, 30)]), 2)

    def body(q):
        return blockdiag_attention_shard(q, q, q, plan=plan, axis_name="sequence")

    spec = P(None, "cp")
    with pytest.raises(ValueError, match="axis name 'sequence' is not bound"):
        jax.eval_shape(jax.shard_map(body, mesh=cp_mesh(2), in_specs=spec, out_specs=spec), np.zeros((1, 30, 2, 8)))


def test_query_blocks_give_the_same_output_and_gradients_as_one_block():
    from jax_api.attention.blockdiag import masked_attention

    rng = np.random.default_rng(7)
    doc_ids = jnp.asarray(np.array([0, 1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 3, 3, 3, 3, 3, 3, 0, 4, 4, 4]), jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 13, 4, 8)), jnp.float32)  # queries at global positions 8..20
    keys = jnp.asarray(rng.normal(size=(17, 2, 2, 8)), jnp.float32)  # the key window holds positions 4..20
    values = jnp.asarray(rng.normal(size=(17, 2, 2, 8)), jnp.float32)
    key_positions = jnp.arange(4, 21, dtype=jnp.int32)

    def loss(q, keys, values, block):
        out = masked_attention(q, keys, values, key_positions, doc_ids, query_start=8, scale=0.3, query_block=block)
        return jnp.sum(out * jnp.cos(out)), out

    (_, whole), whole_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, keys, values, 64)
    (_, blocked), blocked_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, keys, values, 5)
    expected = reference_blockdiag_attention_window(q, keys, values, np.asarray(doc_ids), query_start=8,
                                                    key_start=4, scale=0.3)
    length = attention_length(17, 8)
    assert_close("one block", expected, whole, tolerance(length))
    assert_close("blocks of 5", whole, blocked, tolerance(length, compared_with="rounded"))
    for name, got, want in zip(("dq", "dkeys", "dvalues"), blocked_grads, whole_grads):
        assert_close(name, want, got, tolerance(length, compared_with="rounded"))


def reference_blockdiag_attention_window(q, keys, values, doc_ids, *, query_start, key_start, scale):
    """float64 reference: the full-sequence doc-masked attention restricted to the queried rows."""
    tokens = doc_ids.shape[0]
    batch, length, q_heads, dim = q.shape
    full_q = np.zeros((batch, tokens, q_heads, dim))
    full_q[:, query_start:query_start + length] = np.asarray(q)
    full_k = np.zeros((batch, tokens, keys.shape[2], dim))
    full_v = np.zeros_like(full_k)
    full_k[:, key_start:] = np.moveaxis(np.asarray(keys), 0, 1)
    full_v[:, key_start:] = np.moveaxis(np.asarray(values), 0, 1)
    # keys before key_start are outside every queried row's document here (positions 0..3 are docs 0, 1)
    return reference_attention(full_q, full_k, full_v, doc_ids, scale=scale)[:, query_start:query_start + length]
