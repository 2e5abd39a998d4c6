import numpy as np
import pytest

import cp_linear.summary as S
from tests.tolerance import assert_close, magnitude_cancellation, summary_length, tolerance

HEADS, KEY_DIM, VALUE_DIM = 2, 4, 3


def random_summary(rng, heads=2, key_dim=4, value_dim=3, lead=()):
    return rng.normal(size=lead + (heads, key_dim, value_dim + key_dim)).astype(np.float32)


def apply_seq(summaries, state):
    for packed in summaries:
        e, m = packed[..., :3], packed[..., 3:]
        state = m.astype(np.float64) @ state + e
    return state


def fold_tolerance(stacked, state=None, *, compared_with="exact"):
    """float32 bound of folding ``stacked`` summaries (their length and the cancellation of the fold)."""
    state = np.zeros(stacked.shape[1:-1] + (VALUE_DIM,)) if state is None else state
    kappa = magnitude_cancellation(lambda s, x: apply_seq(s, x), stacked, state)
    return tolerance(summary_length(len(stacked), KEY_DIM), cancellation=kappa, compared_with=compared_with)


def test_combine_is_associative_and_means_earlier_then_later():
    rng = np.random.default_rng(0)
    a, b, c = (random_summary(rng) for _ in range(3))
    state = rng.normal(size=(2, 4, 3))
    assert_close("combine then apply", apply_seq([a, b], state), S.apply_summary(S.combine(a, b), state),
                 fold_tolerance(np.stack([a, b]), state))
    kappa = magnitude_cancellation(lambda *s: S.combine(S.combine(*s[:2]), s[2]), a, b, c)
    assert_close("associativity", S.combine(S.combine(a, b), c), S.combine(a, S.combine(b, c)),
                 tolerance(summary_length(3, KEY_DIM), cancellation=kappa, compared_with="rounded"))
    assert not np.allclose(S.combine(a, b), S.combine(b, a))


def test_compose_forward_and_backward_fold_in_opposite_orders():
    rng = np.random.default_rng(1)
    stacked = random_summary(rng, lead=(4,))
    forward = S.compose_forward(stacked)
    backward = S.compose_backward(stacked)
    zero = np.zeros((2, 4, 3))
    assert_close("forward fold", apply_seq(stacked, zero), forward, fold_tolerance(stacked))
    assert_close("backward fold", apply_seq(stacked[::-1], zero), backward, fold_tolerance(stacked[::-1]))
    assert forward.dtype == np.float32
    empty = S.compose_forward(stacked[:0])
    assert empty.shape == (2, 4, 3) and not empty.any()


def test_backward_summary_is_the_chain_rule_of_the_adjoint():
    rng = np.random.default_rng(2)
    transitions = rng.normal(size=(3, 1, 4, 4))
    grads = rng.normal(size=(3, 1, 4, 3))
    packed = np.stack([S.pack(S.CPBackwardUnpackedSummary(transitions[i], grads[i])).packed for i in range(3)])
    d_in = np.zeros((1, 4, 3))
    for i in (2, 1, 0):  # dS_in_i = M_i^T dS_in_{i+1} + gamma_i
        d_in = transitions[i].swapaxes(-1, -2) @ d_in + grads[i]
    kappa = magnitude_cancellation(lambda s: apply_seq(s[::-1], np.zeros_like(d_in)), packed)
    assert_close("backward fold", d_in, S.compose_backward(packed),
                 tolerance(summary_length(3, 4), cancellation=kappa, dtype="float64"))


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(3)
    m, e = rng.normal(size=(2, 4, 4)).astype(np.float32), rng.normal(size=(2, 4, 3)).astype(np.float32)
    fwd = S.unpack(S.pack(S.CPForwardUnpackedSummary(m, e)))
    np.testing.assert_array_equal(fwd.transition, m)
    np.testing.assert_array_equal(fwd.state_update, e)
    bwd = S.unpack(S.pack(S.CPBackwardUnpackedSummary(m, e)))
    np.testing.assert_array_equal(bwd.transition, m)
    np.testing.assert_array_equal(bwd.local_state_grad, e)


def test_range_folds_match_slices_and_scan_matches_prefix_folds():
    rng = np.random.default_rng(4)
    gathered = random_summary(rng, lead=(5,))
    for start, stop in [(0, 3), (1, 4), (2, 3), (0, 5)]:
        forward, backward = gathered[start:stop], gathered[start:stop][::-1]
        assert_close(f"forward range [{start}, {stop})", S.compose_forward(forward),
                     S.compose_forward_range(gathered, start, stop), fold_tolerance(forward, compared_with="rounded"))
        assert_close(f"backward range [{start}, {stop})", S.compose_backward(gathered[start:stop]),
                     S.compose_backward_range(gathered, start, stop), fold_tolerance(backward, compared_with="rounded"))
    assert not S.compose_forward_range(gathered, 2, 2).any() and not S.compose_backward_range(gathered, 2, 2).any()
    scanned = S.inclusive_scan(gathered)
    zero = np.zeros((2, 4, 3))
    for i in range(5):
        assert_close(f"scan prefix {i}", S.compose_forward(gathered[: i + 1]), S.apply_summary(scanned[i], zero),
                     fold_tolerance(gathered[: i + 1], compared_with="rounded"))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_same_code_path_for_torch_and_jax(framework):
    rng = np.random.default_rng(5)
    gathered = random_summary(rng, lead=(4,))
    expected = S.compose_forward(gathered)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        out = S.compose_forward(torch.from_numpy(gathered)).numpy()
        ranged = S.compose_forward_range(torch.from_numpy(gathered), torch.tensor(0), torch.tensor(4)).numpy()
    else:
        jax = pytest.importorskip("jax")
        out = np.asarray(S.compose_forward(jax.numpy.asarray(gathered)))
        ranged = np.asarray(jax.jit(S.compose_forward_range)(jax.numpy.asarray(gathered), 0, 4))
        scan = jax.lax.associative_scan(S.combine, jax.numpy.asarray(gathered))
        kappa = magnitude_cancellation(lambda g: S.inclusive_scan(g), gathered)
        assert_close("associative_scan", S.inclusive_scan(gathered), np.asarray(scan),
                     tolerance(summary_length(4, KEY_DIM), cancellation=kappa, compared_with="rounded"))
    tol = fold_tolerance(gathered, compared_with="rounded")
    assert_close("compose_forward", expected, out, tol)
    assert_close("compose_forward_range", expected, ranged, tol)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((2, 4, 7), np.float64), "float32"),
    (np.zeros((4, 7), np.float32), r"\[\.\.\., H, K, V \+ K\]"),
    (np.zeros((2, 4, 4), np.float32), "must exceed K"),
    (np.zeros((2, 4, 14), np.float32)[..., ::2], "contiguous"),
])
def test_validate_rejects_bad_summaries(bad, match):
    with pytest.raises(ValueError, match=match):
        S.validate_packed_summary(bad)


def test_validate_checks_expected_sizes():
    with pytest.raises(ValueError, match="expected H = 3"):
        S.validate_packed_summary(np.zeros((2, 4, 7), np.float32), heads=3)


@pytest.mark.parametrize("start, stop", [(0, 0), (0, 3), (1, 4), (2, 3), (4, 4)])
def test_fold_forward_range_summary_keeps_M_for_an_initial_state(start, stop):
    """The folded [E | M] of ranks [start, stop) applied to any S0 is the sequential fold from S0."""
    rng = np.random.default_rng(start * 10 + stop)
    gathered = rng.normal(size=(4, 2, 3, 5 + 3))
    state = rng.normal(size=(2, 3, 5))
    folded = S.fold_forward_range_summary(gathered, start, stop)
    expected = state
    for index in range(start, stop):  # S <- M S + E, written out
        expected = gathered[index, ..., 5:] @ expected + gathered[index, ..., :5]
    np.testing.assert_allclose(S.apply_summary(folded, state), expected, rtol=1e-12, atol=1e-12)
