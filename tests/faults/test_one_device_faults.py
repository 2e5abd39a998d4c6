"""The fault suite's one-device torch cases (no process group): classes 5 and 6 of issue 16.

With checks on, non-finite or out-of-domain inputs raise ValueError; with ``check_inputs=False`` a
non-finite input changes only the outputs that really read it (its document, from it onward).
"""

import numpy as np
import pytest
import torch

from tests.faults.cases import N_H, contained_gdp_gradients, docs, expected_gdp_poison, gdp_full_inputs
from torch_api.attention.kernel import DocCausalLayout, doc_causal_attention
from torch_api.gdp.ops import gated_delta_product

LENGTHS = [10, 30, 24]  # 64 tokens, the example size
CU = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32)


def gdp(inputs, **options):
    return gated_delta_product(*inputs, num_householder=N_H, cu_seqlens=CU, **options)


@pytest.mark.parametrize("name, index", [("q", 0), ("k", 1), ("v", 2), ("g", 3), ("beta", 4)])
def test_class5_one_device_gdp_rejects_nonfinite_inputs(name, index):
    inputs = gdp_full_inputs(64)
    inputs[index] = inputs[index].clone()
    inputs[index][0, 20].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"gated_delta_product: non-finite values \(NaN or Inf\) in {name}$"):
        gdp(inputs)


def test_class5_one_device_gdp_keeps_a_nan_inside_its_sequence_and_after_it():
    clean = gdp_full_inputs(64)
    dirty = [x.clone() for x in clean]
    dirty[2][0, 25 * N_H, 0, 1] = float("nan")  # token 25 (sequence 1 = tokens 10..39), head 0
    reference, reference_final = gdp(clean)
    out, final = gdp(dirty, check_inputs=False)
    poisoned = expected_gdp_poison(LENGTHS, [25], 64)
    bad = ~torch.isfinite(out[0]).all(-1)  # [T, H]
    assert np.array_equal(bad[:, 0].numpy(), poisoned) and not bad[:, 1].any()
    assert torch.equal(out[0][~bad], reference[0][~bad])
    assert torch.isnan(final[1, 0]).all() and torch.equal(final[[0, 2]], reference_final[[0, 2]])
    assert torch.equal(final[1, 1], reference_final[1, 1])


def test_class5_one_device_gdp_gradients_are_zero_at_poisoned_inputs_and_clean_elsewhere():
    """A NaN / Inf in each input: the gradients are finite, exactly zero at every input of a poisoned
    (token, head), bad entries included (sanitising passes the gradient through: ``_Sanitize``), and
    elsewhere those of the clean inputs with no gradient through the poisoned outputs."""
    clean = gdp_full_inputs(64)
    dirty = [x.clone() for x in clean]
    bad = {0: (5, 0), 1: (15, 1), 2: (45, 0), 3: (50, 1), 4: (62, 0)}  # input -> (token, head)
    per = (1, N_H, N_H, 1, N_H)
    for index, (token, head) in bad.items():
        dirty[index][0, token * per[index] + per[index] - 1, head] = float("inf") if index == 3 else float("nan")
    state_poisoned = np.stack([expected_gdp_poison(LENGTHS, [t for i, (t, h) in bad.items() if h == head and i], 64)
                               for head in range(2)], axis=1)  # [T, H]
    poisoned = state_poisoned.copy()
    poisoned[5, 0] = True  # a non-finite q poisons its own token alone
    final_bad = np.array([[False, False], [False, True], [True, True]])  # [sequence, head]
    out, _ = gdp(dirty, check_inputs=False)
    assert np.array_equal(~torch.isfinite(out[0]).all(-1).numpy(), poisoned)
    assert out.is_contiguous()  # not in the [B, H, T] order of the poison mask's scan (a copy for every consumer)
    dirty_grads, clean_grads, zero = contained_gdp_gradients(gdp, clean, dirty, poisoned, state_poisoned, final_bad,
                                                             N_H)
    for name, mine, reference, must_be_zero in zip(("q", "k", "v", "g", "beta"), dirty_grads, clean_grads, zero):
        assert torch.isfinite(mine).all(), name
        assert not mine[0][must_be_zero].any(), name
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6, msg=name)


def test_class5_one_device_gdp_contains_a_nonfinite_initial_state():
    inputs = gdp_full_inputs(64)
    initial = torch.zeros(3, 2, 8, 6)
    initial[2, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="in initial_state"):
        gdp(inputs, initial_state=initial)
    out, final = gdp(inputs, initial_state=initial, check_inputs=False)
    reference, _ = gdp(inputs)
    bad = ~torch.isfinite(out[0]).all(-1)
    assert bad[40:, 1].all() and not bad[:40].any() and not bad[:, 0].any()
    assert torch.equal(out[0][~bad], reference[0][~bad]) and torch.isnan(final[2, 1]).all()


ATTENTION_IDS = np.array(docs((1, 3), (2, 8), (0, 4), (3, 15)))  # 30 tokens: padding at 11..14


def attention_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 30, heads, 8, generator=gen) for heads in (4, 2, 2)]


def test_class5_one_device_attention_keeps_a_nan_in_its_document_and_after_it():
    """The issue's example: one NaN in v at token 3 made all 30 real outputs NaN."""
    layout = DocCausalLayout.from_doc_ids(ATTENTION_IDS, 0, 30, 0, 30)
    q, k, v = attention_inputs()
    reference = doc_causal_attention(q, k, v, layout)
    v_bad = v.clone()
    v_bad[0, 3, 1, 0] = float("nan")  # document 2, kv head 1 -> q heads 2, 3
    v_bad[0, 12, 0, 0] = float("inf")  # padding
    out = doc_causal_attention(q, k, v_bad, layout, contain=True)
    bad = ~torch.isfinite(out[0]).all(-1)  # [T, Hq]
    expected = torch.zeros(30, 4, dtype=torch.bool)
    expected[3:11, 2:] = True
    assert torch.equal(bad, expected)
    assert torch.allclose(out[0][~bad], reference[0][~bad], rtol=0, atol=1e-6)
    assert torch.equal(out[0, 11:15], torch.zeros_like(out[0, 11:15]))


@pytest.mark.parametrize("check_inputs", [True, False])
def test_class5_one_device_attention_layer_reports_or_contains(check_inputs):
    from torch_api.layers import BlockDiagAttention

    torch.manual_seed(0)
    layer = BlockDiagAttention(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, check_inputs=check_inputs)
    x = torch.randn(1, 30, 16)
    clean = layer(x, doc_ids=torch.tensor(ATTENTION_IDS))
    x[0, 16, 3] = float("nan")  # document 3 = tokens 15..29
    if check_inputs:
        with pytest.raises(ValueError, match=r"BlockDiagAttention: non-finite values \(NaN or Inf\) in q, k, v"):
            layer(x, doc_ids=torch.tensor(ATTENTION_IDS))
        return
    out = layer(x, doc_ids=torch.tensor(ATTENTION_IDS))
    bad = ~torch.isfinite(out[0]).all(-1)
    assert bad[16:].all() and not bad[:16].any()
    assert torch.allclose(out[0, :16], clean[0, :16], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fault, message", [
    ("g_positive", r"g > 0"),
    ("beta_above_2", r"beta outside \[0, 2\]"),
    ("beta_negative", r"beta outside \[0, 2\]"),
    ("key_dim_300", r"K = 300 exceeds the supported maximum K = 256"),
    ("value_dim_600", r"V = 600 exceeds the supported maximum V = 512"),
    ("empty_sequence", r"empty inputs are not supported"),
])
def test_class6_one_device_gdp_rejects_out_of_domain_inputs(fault, message):
    q, k, v, g, beta = gdp_full_inputs(64)
    cu = CU
    if fault == "g_positive":
        g = g.clone()
        g[0, 3, 1] = 20.0
    elif fault == "beta_above_2":
        beta = beta + 1.5
    elif fault == "beta_negative":
        beta = beta - 0.5
    elif fault == "key_dim_300":
        q, k = torch.zeros(*q.shape[:3], 300), torch.zeros(*k.shape[:3], 300)
    elif fault == "value_dim_600":
        v = torch.zeros(*v.shape[:3], 600)
    elif fault == "empty_sequence":
        q, k, v, g, beta = (x[:, :0] for x in (q, k, v, g, beta))
        cu = None
    with pytest.raises(ValueError, match=message):
        gated_delta_product(q, k, v, g, beta, num_householder=N_H, cu_seqlens=cu)


def test_class6_g_zero_and_beta_two_are_inside_the_domain():
    q, k, v, g, beta = gdp_full_inputs(64)
    out, _ = gated_delta_product(q, k, v, torch.zeros_like(g), torch.full_like(beta, 2.0), num_householder=N_H,
                                 cu_seqlens=CU)
    assert torch.isfinite(out).all()
