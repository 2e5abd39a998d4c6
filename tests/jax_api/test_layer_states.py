"""Sequence states through the JAX layers: a document split into two training windows, window 2
started from window 1's final states, equals the one-window run (outputs, final states, parameter
gradients with the states kept attached), on one device and under CP (host devices, ``cp_apply``).

The short conv does not carry its ``conv_size - 1`` tokens across windows, so these models have no
conv reach (``use_short_conv=False`` for the layer, ``conv_size=1`` for the decoder).
"""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_api.layers import DecoderConfig, GatedDeltaProduct, HybridDecoder, build_layout, cp_apply  # noqa: E402
from tests.layer_state_cases import DECODER, DOC_IDS, GDP, WINDOW  # noqa: E402



def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(got, expected, bound=2e-5, leaf_bound=1e-4):
    """Every gradient together within ``bound``, each leaf within ``leaf_bound``: a per-head scalar's
    gradient (A_log) is a float32 sum over every token with cancellation; splitting it over two windows moved
    it by 2.9e-5 of itself (XLA CPU, jax 0.10.2, a fresh venv). A wrong hand-off between the windows moves
    gradients by far more, and the outputs are checked at 2e-6."""
    leaves_got, leaves_expected = jax.tree.leaves(got), jax.tree.leaves(expected)
    flat = lambda leaves: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])  # noqa: E731
    assert relative(flat(leaves_got), flat(leaves_expected)) <= bound
    for path, (x, y) in zip(jax.tree_util.tree_leaves_with_path(expected), zip(leaves_got, leaves_expected)):
        assert relative(x, y) <= leaf_bound, (path[0], relative(x, y))


def continued_state(final_state, window_ids):
    """Window 1's final states -> window 2's initial states: the document crossing the boundary keeps
    its state, every sequence that starts in window 2 starts from zeros."""
    rows = 1 + int(np.count_nonzero(np.diff(window_ids)))
    initial = jnp.zeros((rows, *final_state.shape[1:]), final_state.dtype)
    return initial.at[0].set(final_state[-1])


def test_gdp_layer_two_windows_equal_one_window_on_one_device():
    module = GatedDeltaProduct(**GDP, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    x = jax.random.normal(jax.random.key(1), (1, DOC_IDS.shape[0], GDP["hidden_size"]))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    full_layout = build_layout(total_len=DOC_IDS.shape[0], doc_ids=DOC_IDS)
    layouts = [build_layout(total_len=WINDOW, doc_ids=DOC_IDS[:WINDOW]),
               build_layout(total_len=WINDOW, doc_ids=DOC_IDS[WINDOW:])]

    def one_window(params):
        out, final = nnx.merge(graphdef, params)(x, layout=full_layout, output_final_state=True, num_sequences=3)
        return jnp.sum(out * cotangent), (out, final)

    def two_windows(params):
        layer = nnx.merge(graphdef, params)
        out1, final1 = layer(x[:, :WINDOW], layout=layouts[0], output_final_state=True, num_sequences=2)
        out2, final2 = layer(x[:, WINDOW:], layout=layouts[1], output_final_state=True,
                             initial_state=continued_state(final1, DOC_IDS[WINDOW:]))
        out = jnp.concatenate([out1, out2], axis=1)
        return jnp.sum(out * cotangent), (out, jnp.concatenate([final1[:1], final2]))

    (_, (out, final)), grads = jax.value_and_grad(one_window, has_aux=True)(params)
    (_, (out_w, final_w)), grads_w = jax.value_and_grad(two_windows, has_aux=True)(params)
    assert relative(out_w, out) <= 2e-6 and relative(final_w, final) <= 2e-6
    assert_trees_close(grads_w, grads)


@functools.lru_cache(maxsize=None)
def decoder_runs(cp_size):
    """(one-window, two-window) jitted value_and_grad of sum(logits * cotangent) over the model state."""
    model = HybridDecoder(DECODER, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    mesh = jax.make_mesh((cp_size,), ("cp",), devices=jax.devices()[:cp_size])
    full_layout = build_layout(total_len=DOC_IDS.shape[0], doc_ids=DOC_IDS, cp_size=cp_size)
    layouts = [build_layout(total_len=WINDOW, doc_ids=ids, cp_size=cp_size)
               for ids in (DOC_IDS[:WINDOW], DOC_IDS[WINDOW:])]

    def run(params, tokens, layout, **states):
        model = nnx.merge(graphdef, params)
        if cp_size == 1:
            return model(tokens, layout=layout, output_gdp_states=True, **states)
        return cp_apply(model, tokens, layout, mesh=mesh, output_gdp_states=True, **states)

    def one_window(params, tokens, cotangent):
        logits, finals = run(params, tokens, full_layout, num_sequences=3)
        return jnp.sum(logits * cotangent), (logits, finals)

    def two_windows(params, tokens, cotangent):
        logits1, finals1 = run(params, tokens[:, :WINDOW], layouts[0], num_sequences=2)
        states = {i: continued_state(f, DOC_IDS[WINDOW:]) for i, f in finals1.items()}
        logits2, finals2 = run(params, tokens[:, WINDOW:], layouts[1], gdp_states=states)
        logits = jnp.concatenate([logits1, logits2], axis=1)
        finals = {i: jnp.concatenate([finals1[i][:1], finals2[i]]) for i in finals2}
        return jnp.sum(logits * cotangent), (logits, finals)

    return params, (jax.jit(jax.value_and_grad(one_window, has_aux=True)),
                    jax.jit(jax.value_and_grad(two_windows, has_aux=True)))


@pytest.mark.parametrize("cp_size", [1, 2])
def test_decoder_two_windows_equal_one_window(cp_size):
    params, (one_window, two_windows) = decoder_runs(cp_size)
    tokens = jax.random.randint(jax.random.key(4), (1, DOC_IDS.shape[0]), 0, DECODER.vocab_size)
    cotangent = jax.random.normal(jax.random.key(5), (1, DOC_IDS.shape[0], DECODER.vocab_size))
    (_, (logits, finals)), grads = one_window(params, tokens, cotangent)
    (_, (logits_w, finals_w)), grads_w = two_windows(params, tokens, cotangent)
    assert sorted(finals_w) == [0, 1]
    assert relative(logits_w, logits) <= 2e-6
    for index in finals:
        assert relative(finals_w[index], finals[index]) <= 2e-6, index
    assert_trees_close(grads_w, grads)


def test_decoder_rejects_states_of_a_layer_that_is_not_gdp():
    model = HybridDecoder(DecoderConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, head_dim=4),
                          rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"gdp_states must be a dict keyed by GDP layer indices \[0\]"):
        model(jnp.zeros((1, 8), jnp.int32), gdp_states={1: jnp.zeros((1, 2, 4, 4))})
