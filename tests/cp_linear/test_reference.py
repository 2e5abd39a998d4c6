import numpy as np
import pytest

from cp_linear import build_packed_sequence_cp_metadata, compose_forward
from cp_linear import reference as ref
from tests.cp_linear.gdp_cases import random_gdp_inputs, seq_idx_from_lengths
from tests.tolerance import assert_close, attention_length, gdp_length, tolerance

F64 = dict(dtype="float64")  # every comparison here is float64 against float64


def test_naive_single_token_single_step_is_the_delta_rule_by_hand():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=1, heads=1, key_dim=3, value_dim=2)
    state0 = rng.normal(size=(1, 1, 3, 2))
    o, final = ref.naive_gated_delta_product(q, k, v, g, beta, initial_state=state0, scale=0.5)
    s = np.exp(g[0, 0, 0]) * state0[0, 0]
    key, value, b = k[0, 0, 0], v[0, 0, 0], beta[0, 0, 0]
    s = s + b * np.outer(key, value - s.T @ key)
    tol = tolerance(gdp_length(1, 1, 3), compared_with="rounded", **F64)
    assert_close("final state", s, final[0, 0], tol)
    assert_close("output", 0.5 * s.T @ q[0, 0, 0], o[0, 0, 0], tol)


def test_naive_sequences_do_not_share_state():
    rng = np.random.default_rng(1)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=10, num_householder=2)
    o_packed, final = ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=2, cu_seqlens=[0, 4, 10])
    o_second, final_second = ref.naive_gated_delta_product(
        q[:, 4:], k[:, 8:], v[:, 8:], g[:, 4:], beta[:, 8:], num_householder=2)
    tol = tolerance(gdp_length(6, 2, 8), compared_with="rounded", **F64)
    assert_close("output", o_second, o_packed[:, 4:], tol)
    assert_close("final state", final_second[0], final[1], tol)


@pytest.mark.parametrize("num_householder", [1, 2, 3])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 5])
def test_chunked_matches_naive(num_householder, use_qk_l2norm, chunk_size):
    rng = np.random.default_rng(num_householder)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=63, key_dim=12, value_dim=10, num_householder=num_householder)
    cu = [0, 1, 30, 63]
    init = rng.normal(size=(3, 2, 12, 10))
    args = dict(num_householder=num_householder, cu_seqlens=cu, initial_state=init,
                use_qk_l2norm_in_kernel=use_qk_l2norm)
    o_ref, s_ref = ref.naive_gated_delta_product(q, k, v, g, beta, **args)
    o, s = ref.chunked_gated_delta_product(q, k, v, g, beta, chunk_size=chunk_size, **args)
    tol = tolerance(gdp_length(63, num_householder, 12), compared_with="rounded", **F64)
    assert_close("output", o_ref, o, tol)
    assert_close("final state", s_ref, s, tol)


def test_chunk_transition_and_update_map_incoming_state_to_chunk_end():
    rng = np.random.default_rng(3)
    _, k, v, g, beta = random_gdp_inputs(rng, tokens=16, heads=2, key_dim=5, value_dim=4)
    chunk = ref.wy_chunk(k[0], v[0], beta[0], g[0])
    state0 = rng.normal(size=(1, 2, 5, 4))
    q = np.zeros((1, 16, 2, 5))
    _, final = ref.naive_gated_delta_product(q, k, v, g, beta, initial_state=state0)
    assert_close("chunk end state", final[0], chunk["transition"] @ state0[0] + chunk["update"],
                 tolerance(gdp_length(16, 1, 5), compared_with="rounded", **F64))


@pytest.mark.parametrize(
    "lengths, cp",
    [
        pytest.param([5, 4, 7], 4, id="design-example"),
        pytest.param([16], 4, id="one-document-spans-every-rank"),
        pytest.param([4, 4, 8], 4, id="documents-end-on-rank-boundaries"),
        pytest.param([1, 1, 1, 2, 1, 2, 8], 2, id="many-documents-on-a-rank"),
        pytest.param([1, 15], 4, id="one-token-document"),
    ],
)
@pytest.mark.parametrize("num_householder", [1, 3])
def test_composed_shard_summaries_reproduce_the_recurrence(lengths, cp, num_householder):
    rng = np.random.default_rng(len(lengths) * 10 + cp)
    tokens, n = sum(lengths), num_householder
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=tokens, num_householder=n)
    ids = seq_idx_from_lengths(lengths)
    o_ref, _ = ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=n,
                                             cu_seqlens=np.r_[0, np.cumsum(lengths)])
    local = tokens // cp
    metas = [build_packed_sequence_cp_metadata(ids, r, cp) for r in range(cp)]
    shard = lambda r: (slice(r * local, (r + 1) * local), slice(r * local * n, (r + 1) * local * n))  # noqa: E731
    summaries = np.stack([
        ref.shard_forward_summary(k[:, shard(r)[1]], v[:, shard(r)[1]], g[:, shard(r)[0]], beta[:, shard(r)[1]],
                                  num_householder=n, cu_seqlens=metas[r].local_cu_seqlens, chunk_size=3)
        for r in range(cp)])
    for r, md in enumerate(metas):
        incoming = compose_forward(summaries[md.preceding_rank_start:r])
        init = np.zeros((len(md.local_cu_seqlens) - 1,) + incoming.shape)
        init[0] = incoming
        tok, step = shard(r)
        o, _ = ref.naive_gated_delta_product(q[:, tok], k[:, step], v[:, step], g[:, tok], beta[:, step],
                                             num_householder=n, cu_seqlens=md.local_cu_seqlens, initial_state=init)
        assert_close(f"rank {r}", o_ref[:, tok], o, tolerance(gdp_length(tokens, n, 8), compared_with="rounded", **F64))


def test_blockdiag_attention_masks_documents_and_zeroes_padding():
    rng = np.random.default_rng(4)
    q, k, v = rng.normal(size=(1, 6, 4, 3)), rng.normal(size=(1, 6, 2, 3)), rng.normal(size=(1, 6, 2, 3))
    doc_ids = np.array([1, 1, 0, 2, 2, 0])
    o = ref.blockdiag_attention(q, k, v, doc_ids)
    assert np.all(o[0, [2, 5]] == 0)
    # token 4 (doc 2) sees tokens 3 and 4 only; q head 3 reads kv head 1 (GQA 4:2)
    logits = np.array([q[0, 4, 3] @ k[0, j, 1] for j in (3, 4)]) / np.sqrt(3)
    weights = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    tol = tolerance(attention_length(6, 3), compared_with="rounded", **F64)
    assert_close("token 4, head 3", weights @ v[0, [3, 4], 1], o[0, 4, 3], tol)
    assert_close("token 0 sees only itself", v[0, 0, 0], o[0, 0, 0], tol)


def test_empty_sequences_end_in_their_initial_state():
    rng = np.random.default_rng(6)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=8, num_householder=2)
    init = rng.normal(size=(4, 2, 8, 6))
    o, final = ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=2, cu_seqlens=[0, 3, 3, 8, 8],
                                             initial_state=init)
    o_plain, final_plain = ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=2, cu_seqlens=[0, 3, 8],
                                                         initial_state=init[[0, 2]])
    np.testing.assert_array_equal(final[[1, 3]], init[[1, 3]])
    np.testing.assert_array_equal(final[[0, 2]], final_plain)
    np.testing.assert_array_equal(o, o_plain)


def test_no_gate_is_a_zero_gate():
    rng = np.random.default_rng(7)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=6)
    o, final = ref.naive_gated_delta_product(q, k, v, None, beta)
    o_zero, final_zero = ref.naive_gated_delta_product(q, k, v, np.zeros_like(g), beta)
    np.testing.assert_array_equal(o, o_zero)
    np.testing.assert_array_equal(final, final_zero)


@pytest.mark.parametrize("bad, match", [
    (dict(g_shape=(1, 5, 2)), "g must have shape"),
    (dict(num_householder=0), "num_householder"),
    (dict(cu_seqlens=[0, 5, 3, 8]), "nondecreasing"),
    (dict(cu_seqlens=[0, 3, 7]), "from 0 to T = 8"),
])
def test_reference_rejects_bad_shapes(bad, match):
    rng = np.random.default_rng(5)
    q, k, v, g, beta = random_gdp_inputs(rng, tokens=8)
    if "g_shape" in bad:
        g = np.zeros(bad["g_shape"])
    with pytest.raises(ValueError, match=match):
        ref.naive_gated_delta_product(q, k, v, g, beta, num_householder=bad.get("num_householder", 1),
                                      cu_seqlens=bad.get("cu_seqlens"))
