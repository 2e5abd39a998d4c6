import numpy as np
import pytest

import cp_linear.summary as S


def random_summary(rng, heads=2, key_dim=4, value_dim=3, lead=()):
    return rng.normal(size=lead + (heads, key_dim, value_dim + key_dim)).astype(np.float32)


def apply_seq(summaries, state):
    for packed in summaries:
        e, m = packed[..., :3], packed[..., 3:]
        state = m.astype(np.float64) @ state + e
    return state


def test_combine_is_associative_and_means_earlier_then_later():
    rng = np.random.default_rng(0)
    a, b, c = (random_summary(rng) for _ in range(3))
    state = rng.normal(size=(2, 4, 3))
    np.testing.assert_allclose(S.apply_summary(S.combine(a, b), state), apply_seq([a, b], state), rtol=1e-5)
    np.testing.assert_allclose(S.combine(S.combine(a, b), c), S.combine(a, S.combine(b, c)), rtol=1e-5, atol=1e-5)
    assert not np.allclose(S.combine(a, b), S.combine(b, a))


def test_compose_forward_and_backward_fold_in_opposite_orders():
    rng = np.random.default_rng(1)
    stacked = random_summary(rng, lead=(4,))
    forward = S.compose_forward(stacked)
    backward = S.compose_backward(stacked)
    zero = np.zeros((2, 4, 3))
    np.testing.assert_allclose(forward, apply_seq(stacked, zero), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backward, apply_seq(stacked[::-1], zero), rtol=1e-5, atol=1e-6)
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
    np.testing.assert_allclose(S.compose_backward(packed), d_in, rtol=1e-12)


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
    for start, stop in [(0, 3), (1, 4), (2, 2), (0, 5)]:
        np.testing.assert_allclose(S.compose_forward_range(gathered, start, stop),
                                   S.compose_forward(gathered[start:stop]), rtol=1e-6)
        np.testing.assert_allclose(S.compose_backward_range(gathered, start, stop),
                                   S.compose_backward(gathered[start:stop]), rtol=1e-6)
    scanned = S.inclusive_scan(gathered)
    zero = np.zeros((2, 4, 3))
    for i in range(5):
        np.testing.assert_allclose(S.apply_summary(scanned[i], zero), S.compose_forward(gathered[: i + 1]),
                                   rtol=1e-4, atol=1e-5)


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
        np.testing.assert_allclose(np.asarray(scan), S.inclusive_scan(gathered), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(ranged, expected, rtol=1e-6)


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
