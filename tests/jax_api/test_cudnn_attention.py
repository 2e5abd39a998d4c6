"""cuDNN's packed attention behind the one-device JAX attention layer (``jax_api.attention.cudnn``).

On the CPU the cuDNN call is replaced by an emulation of its packed-layout contract (causal attention
inside each segment that the offsets and lengths describe, nothing across segments), so the tests
check what is ours: the runs' description, the zeros on padding, the containment of non-finite
inputs, the overflow guard and the layer's choice. Marked ``gpu``: the same checks against the real
cuDNN call, in bf16 against the float64 reference, with gradients.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cp_linear.reference import blockdiag_attention as reference_attention  # noqa: E402
from jax_api.attention import cudnn  # noqa: E402
from tests.tolerance import assert_close, attention_length, tolerance  # noqa: E402

PACKINGS = {
    "documents and padding runs": [(0, 3), (1, 20), (2, 7), (0, 5), (3, 29)],
    "one document": [(1, 64)],
    "padding first and last": [(0, 9), (4, 40), (5, 1), (0, 14)],
}


def doc_ids_from_runs(runs):
    return np.concatenate([np.full(length, doc, np.int32) for doc, length in runs])


def emulated_packed_causal(q, k, v, offsets, lengths, *, scale):
    """cuDNN's packed layout as documented: causal softmax inside each described segment; float32. Rows
    outside every segment are left unwritten by cuDNN, outputs and gradients alike (NaN seen on an H200):
    NaN here, so a caller that lets them through fails."""
    @jax.custom_vjp
    def attend(q, k, v, offsets, lengths):
        out = _segment_softmax(q, k, v, offsets, lengths, scale)
        return jnp.where(_covered_rows(offsets, lengths, q.shape[1]), out, jnp.nan).astype(q.dtype)

    def attend_fwd(q, k, v, offsets, lengths):
        return attend(q, k, v, offsets, lengths), (q, k, v, offsets, lengths)

    def attend_bwd(saved, cotangent):
        q, k, v, offsets, lengths = saved
        _, pullback = jax.vjp(lambda *x: _segment_softmax(*x, offsets, lengths, scale), q, k, v)
        covered = _covered_rows(offsets, lengths, q.shape[1])
        return (*(jnp.where(covered, grad, jnp.nan).astype(grad.dtype) for grad in pullback(cotangent)), None, None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, offsets, lengths)


def _segment_membership(offsets, lengths, tokens):
    """bool [B, T, M]: token t lies in described segment m."""
    position = jnp.arange(tokens)
    starts, stops = offsets[:, None, :-1], (offsets[:, :-1] + lengths)[:, None, :]
    inside = (position[None, :, None] >= starts) & (position[None, :, None] < stops)
    return inside & (lengths >= 0)[:, None, :]


def _covered_rows(offsets, lengths, tokens):
    """bool [B, T, 1, 1]: token t lies in a described segment."""
    return jnp.any(_segment_membership(offsets, lengths, tokens), axis=-1)[:, :, None, None]


def _segment_softmax(q, k, v, offsets, lengths, scale):
    batch, tokens, q_heads, _ = q.shape
    group = q_heads // k.shape[2]
    position = jnp.arange(tokens)
    inside = _segment_membership(offsets, lengths, tokens)
    segment = jnp.where(jnp.any(inside, -1), jnp.argmax(inside, -1), -1)  # [B, T]
    allowed = ((segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
               & (position[None, None, :] <= position[None, :, None]))  # [B, Tq, Tk]
    k32 = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    v32 = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), k32, precision="highest") * scale
    weights = jax.nn.softmax(jnp.where(allowed[:, None], logits, -jnp.inf), axis=-1)
    weights = jnp.where(allowed[:, None], weights, 0.0)
    return jnp.einsum("bhij,bjhd->bihd", weights, v32, precision="highest").astype(q.dtype)


def _inputs(tokens, *, batch=1, q_heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda heads: jnp.asarray(rng.normal(size=(batch, tokens, heads, head_dim)), dtype)  # noqa: E731
    return draw(q_heads), draw(kv_heads), draw(kv_heads)


@pytest.mark.parametrize("name", list(PACKINGS))
def test_segments_describe_every_run_of_equal_ids(name):
    doc_ids = doc_ids_from_runs(PACKINGS[name])
    runs = len(PACKINGS[name])
    offsets, lengths, overflow = cudnn.document_segments(jnp.asarray(doc_ids), 8)
    starts = np.cumsum([0] + [length for _, length in PACKINGS[name]])[:-1]
    assert np.asarray(offsets).tolist() == [starts.tolist() + [-1] * (9 - runs)]
    assert np.asarray(lengths).tolist() == [[length for _, length in PACKINGS[name]] + [-1] * (8 - runs)]
    assert not bool(overflow)
    assert bool(cudnn.document_segments(jnp.asarray(doc_ids), runs - 1)[2])  # one run fewer than the packing


@pytest.mark.parametrize("name", list(PACKINGS))
def test_emulated_call_matches_the_reference_with_zero_padding_rows(name):
    doc_ids = doc_ids_from_runs(PACKINGS[name])
    q, k, v = _inputs(doc_ids.shape[0], batch=2)
    out = cudnn.cudnn_document_attention(q, k, v, jnp.asarray(doc_ids), max_runs=8, scale=0.25,
                                         packed_causal=emulated_packed_causal)
    expected = reference_attention(q, k, v, doc_ids, scale=0.25)
    assert_close("output", expected, out, tolerance(attention_length(doc_ids.shape[0], 16)))
    assert np.all(np.asarray(out)[:, doc_ids == 0] == 0.0)


def test_overflowing_packing_gives_nan_everywhere_not_missing_documents():
    doc_ids = doc_ids_from_runs(PACKINGS["documents and padding runs"])  # 5 runs
    q, k, v = _inputs(doc_ids.shape[0])
    out = cudnn.cudnn_document_attention(q, k, v, jnp.asarray(doc_ids), max_runs=4, scale=0.25,
                                         packed_causal=emulated_packed_causal)
    assert np.all(np.isnan(np.asarray(out)))


def test_nonfinite_value_stays_in_its_document_and_later_tokens():
    doc_ids = doc_ids_from_runs([(1, 10), (0, 3), (2, 12)])
    q, k, v = _inputs(doc_ids.shape[0])
    v = v.at[0, 15, 1].set(jnp.nan)  # document 2, token 2 of it, kv head 1 (q heads 2 and 3 read it)
    out = np.asarray(cudnn.cudnn_document_attention(q, k, v, jnp.asarray(doc_ids), max_runs=4, scale=0.25,
                                                    packed_causal=emulated_packed_causal))
    expected = reference_attention(q, jnp.nan_to_num(k), jnp.nan_to_num(v), doc_ids, scale=0.25)
    bad = np.zeros(out.shape, bool)
    bad[0, 15:, 2:] = True
    assert np.all(np.isnan(out[bad]))
    assert_close("untouched outputs", expected[~bad], out[~bad], tolerance(attention_length(25, 16)))


def test_reason_names_the_platform_on_cpu():
    q, k, _ = _inputs(8, dtype=jnp.bfloat16)
    if jax.default_backend() == "cpu":
        assert "CUDA GPU" in cudnn.cudnn_attention_reason(q, k)


def test_reason_names_dtype_and_head_dim(monkeypatch):
    monkeypatch.setattr(cudnn, "FORCE_CUDNN_ATTENTION", True)
    q32, k32, _ = _inputs(8)
    assert "bfloat16 or float16" in cudnn.cudnn_attention_reason(q32, k32)
    q, k, _ = _inputs(8, head_dim=12, dtype=jnp.bfloat16)
    assert "multiple of 8" in cudnn.cudnn_attention_reason(q, k)
    q, k, _ = _inputs(8, dtype=jnp.bfloat16)
    assert cudnn.cudnn_attention_reason(q, k) is None


def test_layer_takes_the_cudnn_path_when_allowed(monkeypatch):
    from flax import nnx

    from jax_api.layers import BlockDiagAttention, build_layout

    doc_ids = doc_ids_from_runs(PACKINGS["documents and padding runs"])
    layer = BlockDiagAttention(hidden_size=32, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
    layout = build_layout(total_len=doc_ids.shape[0], doc_ids=doc_ids)
    assert layout.max_attention_runs == 8
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, doc_ids.shape[0], 32)), jnp.bfloat16)
    masked = layer(x, layout=layout)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return emulated_packed_causal(*args, **kwargs)

    monkeypatch.setattr(cudnn, "FORCE_CUDNN_ATTENTION", True)
    monkeypatch.setattr(cudnn, "_packed_causal", counted)
    fused = layer(x, layout=layout)
    assert calls, "the layer did not call cuDNN's packed attention"
    # both round q/k/v to bf16 and the output to bf16; the softmax is float32 in both
    assert_close("layer", np.asarray(masked, np.float32), np.asarray(fused, np.float32), 2e-2)


# --------------------------------------------------------------------------- under CP: a window of keys

WINDOW_DOCS = doc_ids_from_runs([(1, 9), (2, 23), (0, 4), (3, 11), (4, 9), (0, 4), (5, 12)])  # T = 72


def _window_problem(doc_ids, query_start, length, *, extra_before, empty, shape, dtype):
    """Inputs of one window case: q [B, length, Hq, D], keys/values over ``_window``'s rows, a cotangent
    for q's shape, the ids and the key positions; ``shape`` = (B, Hq, Hkv, D)."""
    batch, q_heads, kv_heads, head_dim = shape
    positions = _window(doc_ids, query_start, length, extra_before=extra_before, empty=empty, seed=length)
    rng = np.random.default_rng(query_start)
    q = jnp.asarray(rng.normal(size=(batch, length, q_heads, head_dim)), dtype)
    keys, values = (jnp.asarray(rng.normal(size=(positions.shape[0], batch, kv_heads, head_dim)), dtype)
                    for _ in range(2))
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    return q, keys, values, cot, jnp.asarray(doc_ids), jnp.asarray(positions)


def _window(doc_ids, query_start, length, *, extra_before, empty, seed):
    """A key window as an exchange hands it over: every position a local query reads (from its
    document's start), ``extra_before`` more positions before them, ``empty`` rows of -1, shuffled."""
    runs_start = np.concatenate([[0], np.nonzero(doc_ids[1:] != doc_ids[:-1])[0] + 1])
    first_doc_start = runs_start[runs_start <= query_start].max()
    lo = max(0, first_doc_start - extra_before)
    positions = np.concatenate([np.arange(lo, query_start + length), np.full(empty, -1)])
    return np.random.default_rng(seed).permutation(positions).astype(np.int32)


@pytest.mark.parametrize("query_start, length, extra_before, empty", [
    pytest.param(0, 24, 0, 0, id="rank0"),
    pytest.param(24, 24, 0, 3, id="document-continues-from-earlier"),
    pytest.param(24, 24, 24, 0, id="all-gather-window"),
    pytest.param(48, 24, 5, 2, id="last-rank-padding-inside"),
    pytest.param(36, 12, 7, 4, id="starts-on-padding"),
])
def test_window_attention_matches_masked_attention_with_gradients(query_start, length, extra_before, empty):
    """The CP path (queries placed in the window's rows, segments from each document's first row to its
    last local query, top-left causal) against the jnp masked softmax: outputs and q/k/v gradients."""
    from jax_api.attention.blockdiag import masked_attention

    q, keys, values, cot, ids, key_positions = _window_problem(WINDOW_DOCS, query_start, length,
                                                               extra_before=extra_before, empty=empty,
                                                               shape=(2, 4, 2, 16), dtype=jnp.float32)

    def loss(fn, q, keys, values):
        return jnp.sum(fn(q, keys, values, key_positions, ids, query_start=query_start, scale=0.25) * cot)

    fused = lambda *a, **kw: cudnn.cudnn_window_attention(*a, **kw, max_runs=4,  # noqa: E731
                                                         packed_causal=emulated_packed_causal)
    got = jax.value_and_grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(q, keys, values)
    want = jax.value_and_grad(lambda *a: loss(masked_attention, *a), argnums=(0, 1, 2))(q, keys, values)
    bound = tolerance(attention_length(key_positions.shape[0], 16), compared_with="rounded")
    out = cudnn.cudnn_window_attention(q, keys, values, key_positions, ids, query_start=query_start, max_runs=4,
                                       scale=0.25, packed_causal=emulated_packed_causal)
    expected = masked_attention(q, keys, values, key_positions, ids, query_start=query_start, scale=0.25)
    assert_close("output", np.asarray(expected), np.asarray(out), bound)
    assert np.all(np.asarray(out)[:, WINDOW_DOCS[query_start:query_start + length] == 0] == 0)
    for name, g, w in zip(("dq", "dkeys", "dvalues"), got[1], want[1]):
        assert_close(name, np.asarray(w), np.asarray(g), bound)


def test_window_segments_start_at_the_document_and_end_at_the_last_local_query():
    # window rows hold positions 20..59 in order; local queries 24..47: doc 2 (9..31) continues from
    # before the window's local part, padding 32..35, doc 3 (36..46), doc 4 from 47 (local up to 47)
    positions = jnp.arange(20, 60, dtype=jnp.int32)
    local_rows = jnp.arange(4, 28)
    offsets, lengths, overflow = cudnn.window_segments(positions, jnp.asarray(WINDOW_DOCS), local_rows, 8)
    assert np.asarray(offsets).tolist() == [[0, 12, 16, 27, -1, -1, -1, -1, -1]]
    assert np.asarray(lengths).tolist() == [[12, 4, 11, 1, -1, -1, -1, -1]]
    assert not bool(overflow)
    assert bool(cudnn.window_segments(positions, jnp.asarray(WINDOW_DOCS), local_rows, 3)[2])


@pytest.mark.parametrize("cp, layout", [(3, "contiguous"), (2, "zigzag")])
def test_attention_layer_under_cp_on_the_window_path_equals_one_device(cp, layout, monkeypatch):
    """The layer inside shard_map with the CP cuDNN path switched on (emulated call, float32 inputs
    let through) against the one-device layer: outputs and gradients."""
    from flax import nnx

    from jax_api.layers import BlockDiagAttention
    from tests.jax_api import test_layers

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return emulated_packed_causal(*args, **kwargs)

    monkeypatch.setattr(cudnn, "CUDNN_UNDER_CP", True)
    monkeypatch.setattr(cudnn, "cudnn_attention_reason", lambda q, k: None)
    monkeypatch.setattr(cudnn, "_packed_causal", counted)
    doc_ids = WINDOW_DOCS if cp != 3 else WINDOW_DOCS[:69]
    module = BlockDiagAttention(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=8,
                                rngs=nnx.Rngs(0))
    if layout == "contiguous":
        test_layers.assert_cp_matches(module, doc_ids, cp)
    else:
        _assert_zigzag_matches(module, doc_ids, cp)
    assert calls, "the CP path did not call the (emulated) cuDNN attention"


def _assert_zigzag_matches(module, doc_ids, cp):
    """The zig-zag layout's output (rank r holds chunks r and 2·cp−1−r) against one device, permuted alike."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cp_linear.zigzag import layout_permutation
    from jax_api.layers import build_layout

    total = doc_ids.shape[0]
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, total, 20)), jnp.float32)
    one = nnx.jit(lambda module, x, layout: module(x, layout=layout))(module, x, build_layout(total_len=total,
                                                                                            doc_ids=doc_ids))
    layout = build_layout(total_len=total, doc_ids=doc_ids, cp_size=cp, layout="zigzag")
    order = np.asarray(layout_permutation(total, cp, "zigzag"))
    graphdef, state = nnx.split(module)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])

    def per_shard(state, x, layout):
        return nnx.merge(graphdef, state)(x, layout=layout, axis_name="cp")

    run = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(None, "cp"), P()), out_specs=P(None, "cp")))
    out = run(state, jax.device_put(x[:, order], NamedSharding(mesh, P(None, "cp"))), layout)
    assert_close("zig-zag output", np.asarray(one)[:, order], np.asarray(out), 1e-5)


# --------------------------------------------------------------------------- GPU: the real cuDNN call


def _cudnn_here():
    q, k, _ = _inputs(8, dtype=jnp.bfloat16)
    reason = cudnn.cudnn_attention_reason(q, k)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cudnn_matches_the_reference_with_gradients(head_dim):
    _cudnn_here()
    doc_ids = doc_ids_from_runs([(0, 40), (1, 700), (2, 300), (0, 60), (3, 1000), (4, 948)])
    q, k, v = _inputs(doc_ids.shape[0], q_heads=8, kv_heads=2, head_dim=head_dim, dtype=jnp.bfloat16, seed=3)
    weights = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * weights)

    fused = lambda q, k, v: cudnn.cudnn_document_attention(q, k, v, jnp.asarray(doc_ids), max_runs=8,  # noqa: E731
                                                           scale=head_dim**-0.5)
    from jax_api.attention.naive import naive_blockdiag_attention

    dense = lambda q, k, v: naive_blockdiag_attention(q.astype(jnp.float32), k.astype(jnp.float32),  # noqa: E731
                                                      v.astype(jnp.float32), jnp.asarray(doc_ids))
    out = jax.jit(fused)(q, k, v)
    expected = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), doc_ids)
    # bf16 output rounding (2^-9 relative) dominates; P is rounded to bf16 before P·V inside the kernel
    assert_close("output", expected, np.asarray(out, np.float32), 1e-2)
    assert np.all(np.asarray(out)[:, doc_ids == 0] == 0)
    grads = jax.jit(jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2)))(q, k, v)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert_close(name, np.asarray(ref, np.float32), np.asarray(got, np.float32), 2e-2)


@pytest.mark.gpu
def test_cudnn_contains_a_nonfinite_value():
    _cudnn_here()
    doc_ids = doc_ids_from_runs([(1, 300), (0, 20), (2, 200)])
    q, k, v = _inputs(doc_ids.shape[0], q_heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    v = v.at[0, 330, 1].set(jnp.inf)
    out = np.asarray(jax.jit(lambda q, k, v: cudnn.cudnn_document_attention(
        q, k, v, jnp.asarray(doc_ids), max_runs=4, scale=0.125))(q, k, v), np.float32)
    bad = np.zeros(out.shape, bool)
    bad[0, 330:, 2:] = True
    assert np.all(np.isnan(out[bad])) and np.all(np.isfinite(out[~bad]))


@pytest.mark.gpu
def test_layer_step_calls_cudnn_and_a_new_packing_does_not_retrace():
    _cudnn_here()
    from flax import nnx

    from jax_api.layers import BlockDiagAttention, build_layout

    layer = BlockDiagAttention(hidden_size=256, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
    traces = []

    @nnx.jit
    def forward(layer, x, layout):
        traces.append(1)
        return layer(x, layout=layout)

    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 1024, 256)), jnp.bfloat16)
    first = build_layout(total_len=1024, doc_ids=doc_ids_from_runs([(1, 500), (0, 24), (2, 500)]))
    second = build_layout(total_len=1024, doc_ids=doc_ids_from_runs([(1, 100), (2, 900), (3, 24)]))
    assert first.max_attention_runs == second.max_attention_runs == 4
    text = jax.jit(lambda x: layer(x, layout=first)).lower(x).as_text()
    assert "cudnn" in text.lower(), "the one-device layer did not lower to cuDNN's fused attention"
    forward(layer, x, first)
    out = forward(layer, x, second)
    assert len(traces) == 1
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("query_start, extra_before, empty", [(0, 0, 0), (1024, 0, 64), (1024, 700, 0),
                                                              (2048, 300, 128)])
def test_cudnn_window_matches_masked_attention_on_the_gpu(query_start, extra_before, empty):
    """The CP path on the real cuDNN call (what CUDNN_UNDER_CP waits for): segments that do not touch
    each other in the packed buffer and dummy query rows before a continuing document."""
    _cudnn_here()
    from jax_api.attention.blockdiag import masked_attention

    doc_ids = doc_ids_from_runs([(1, 700), (2, 900), (0, 60), (3, 800), (4, 612), (0, 16)])  # T = 3088
    length = 1024
    q, keys, values, cot, ids, key_positions = _window_problem(doc_ids, query_start, length,
                                                               extra_before=extra_before, empty=empty,
                                                               shape=(1, 8, 2, 64), dtype=jnp.bfloat16)

    def loss(fn, q, keys, values):
        out = fn(q, keys, values, key_positions, ids, query_start=query_start, scale=0.125)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    fused = lambda *a, **kw: cudnn.cudnn_window_attention(*a, **kw, max_runs=8)  # noqa: E731
    (_, out), grads = jax.jit(jax.value_and_grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2), has_aux=True))(
        q, keys, values)
    (_, want), want_grads = jax.jit(jax.value_and_grad(lambda *a: loss(masked_attention, *a), argnums=(0, 1, 2),
                                                       has_aux=True))(q, keys, values)
    assert_close("output", np.asarray(want, np.float32), np.asarray(out, np.float32), 1e-2)
    for name, got, ref in zip(("dq", "dkeys", "dvalues"), grads, want_grads):
        assert_close(name, np.asarray(ref, np.float32), np.asarray(got, np.float32), 2e-2)
