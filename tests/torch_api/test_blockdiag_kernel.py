"""Single-process tests of the doc-causal kernel path (torch_api/attention/kernel.py) and naive.py."""

import numpy as np
import pytest
import torch

from cp_linear import build_blockdiag_plan
from cp_linear.reference import blockdiag_attention as reference_blockdiag_attention
from torch_api.attention.kernel import DocCausalLayout, doc_causal_attention, flex_block_mask, resolve_kernel
from tests.tolerance import assert_close, attention_length, tolerance
from torch_api.attention.naive import naive_blockdiag_attention


def host(x):
    return x.detach().double().numpy() if isinstance(x, torch.Tensor) else x


# 63 tokens, cp 3 (L = 21): doc 2 starts on rank 0 and ends on rank 1, interior and tail padding
DOC_IDS_63 = np.array([1] * 9 + [2] * 17 + [0] * 3 + [3] * 11 + [4] * 5 + [0] * 4 + [5] * 10 + [0] * 4)


def random_qkv(batch, tokens, q_heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, q_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, tokens, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, tokens, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def rank_problem(doc_ids, cp_size, rank):
    plan = build_blockdiag_plan(doc_ids, cp_size)
    local_len = plan.local_len
    layout = DocCausalLayout.from_doc_ids(doc_ids, rank * local_len, local_len, plan.s_first[rank], plan.real_end[rank])
    return plan, layout


def test_naive_reference_matches_the_numpy_reference():
    q, k, v = random_qkv(2, 63, 4, 2, 60, torch.float64)
    ours = naive_blockdiag_attention(q, k, v, torch.from_numpy(DOC_IDS_63))
    theirs = reference_blockdiag_attention(q.numpy(), k.numpy(), v.numpy(), DOC_IDS_63)
    assert_close("naive", theirs, host(ours), tolerance(attention_length(63, 60), dtype="float64",
                                                        compared_with="rounded"))
    assert torch.all(ours[:, DOC_IDS_63 == 0] == 0)


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 512], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("rank", [0, 1, 2], ids=lambda r: f"rank{r}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sdpa_kernel_matches_full_sequence_attention_on_the_local_window(chunk_size, rank, dtype):
    """B2-T63-Hq4-Hkv2-D60: the first local document has more keys than queries on rank 1."""
    plan, layout = rank_problem(DOC_IDS_63, 3, rank)
    q, k, v = random_qkv(2, 63, 4, 2, 60, torch.float64, seed=rank)
    query = slice(rank * plan.local_len, (rank + 1) * plan.local_len)
    keys = slice(plan.s_first[rank], plan.real_end[rank])
    grad_out = torch.randn(2, plan.local_len, 4, 60, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_blockdiag_attention(*full, torch.from_numpy(DOC_IDS_63))[:, query]
    ref.backward(grad_out)

    local = [q[:, query].to(dtype).requires_grad_(), k[:, keys].to(dtype).requires_grad_(),
             v[:, keys].to(dtype).requires_grad_()]
    out = doc_causal_attention(*local, layout, kernel="sdpa", chunk_size=chunk_size)
    out.backward(grad_out.to(dtype))

    # float32 against float64; float64 against float64 (both rounded)
    compared_with = "exact" if dtype == torch.float32 else "rounded"
    tol = tolerance(attention_length(63, 60), dtype=str(dtype), compared_with=compared_with)
    assert out.dtype == dtype and out.shape == (2, plan.local_len, 4, 60)
    assert_close("output", host(ref), host(out), tol)
    assert_close("dq", host(full[0].grad[:, query]), host(local[0].grad), tol)
    assert_close("dk", host(full[1].grad[:, keys]), host(local[1].grad), tol)
    assert_close("dv", host(full[2].grad[:, keys]), host(local[2].grad), tol)
    padding = layout.query_doc == 0
    assert torch.all(out[:, padding] == 0) and torch.all(local[0].grad[:, padding] == 0)


def test_sdpa_kernel_gives_zeros_and_zero_gradients_when_every_query_is_padding():
    ids = np.array([1] * 7 + [0] * 7)
    plan, layout = rank_problem(ids, 2, 1)
    q = torch.randn(1, 7, 2, 12, requires_grad=True)
    keys = torch.randn(1, 0, 1, 12, requires_grad=True)
    out = doc_causal_attention(q, keys, keys, layout)
    (out * 3).sum().backward()
    assert torch.all(out == 0) and out.shape == q.shape
    assert q.grad is not None and torch.all(q.grad == 0)
    assert keys.grad is not None and keys.grad.shape == keys.shape


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_forward_matches_full_sequence_attention_on_cpu():
    plan, layout = rank_problem(DOC_IDS_63, 3, 1)
    q, k, v = random_qkv(1, 63, 4, 2, 16, torch.float32, seed=3)
    query = slice(21, 42)
    keys = slice(plan.s_first[1], plan.real_end[1])
    with torch.no_grad():
        flex = doc_causal_attention(q[:, query], k[:, keys], v[:, keys], layout, kernel="flex")
    ref = naive_blockdiag_attention(q.double(), k.double(), v.double(), torch.from_numpy(DOC_IDS_63))[:, query]
    assert_close("flex", host(ref), host(flex), tolerance(attention_length(63, 16)))
    assert torch.all(flex[:, layout.query_doc == 0] == 0)


@pytest.mark.parametrize("block_size", [4, 7, 16, 128], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("rank", [0, 1, 2], ids=lambda r: f"rank{r}")
def test_flex_block_sparsity_matches_the_dense_mask_tile_by_tile(block_size, rank):
    _, layout = rank_problem(DOC_IDS_63, 3, rank)
    dense = layout.allowed(0, layout.query_len, 0, layout.key_len)
    q_blocks, k_blocks = -(-dense.shape[0] // block_size), -(-dense.shape[1] // block_size)
    padded = np.zeros((q_blocks * block_size, k_blocks * block_size), bool)
    padded[:dense.shape[0], :dense.shape[1]] = dense
    tiles = padded.reshape(q_blocks, block_size, k_blocks, block_size).transpose(0, 2, 1, 3)
    any_allowed, all_allowed = layout.block_sparsity(block_size)
    np.testing.assert_array_equal(any_allowed, tiles.any(axis=(2, 3)))
    # full tiles (mask_mod skipped) are exactly the complete tiles whose every pair is allowed
    complete = ((np.arange(q_blocks) + 1) * block_size <= dense.shape[0])[:, None] & (
        (np.arange(k_blocks) + 1) * block_size <= dense.shape[1])[None, :]
    np.testing.assert_array_equal(all_allowed, tiles.all(axis=(2, 3)) & complete)
    block_mask, _ = flex_block_mask(layout, torch.device("cpu"), block_size)
    np.testing.assert_array_equal(block_mask.to_dense()[0, 0].numpy().astype(bool), any_allowed)


def test_query_chunks_split_at_documents_that_continue_from_earlier():
    # rank 1 of DOC_IDS_63: queries 21..41 = doc 2 (21..25, began at 9), padding 26..28,
    # doc 3 (29..39), doc 4 (40..41); keys start at 9
    _, layout = rank_problem(DOC_IDS_63, 3, 1)
    as_tuples = lambda chunks: [(c.query_lo, c.query_hi, c.key_lo, c.key_hi, c.single_doc) for c in chunks]
    assert as_tuples(layout.query_chunks(512)) == [
        (0, 5, 0, 17, True),  # the tail of doc 2 reads from its start: 5 queries, 17 keys
        (8, 21, 20, 33, False),  # docs 3 and 4 whole: keys = queries, block-diagonal mask
    ]
    assert as_tuples(layout.query_chunks(5)) == [
        (0, 5, 0, 17, True), (8, 13, 20, 25, True), (13, 18, 20, 30, True), (18, 19, 20, 31, True),
        (19, 21, 31, 33, True),
    ]


@pytest.mark.parametrize(
    "requested, device, head_dim, needs_grad, expected",
    [
        pytest.param("auto", "cpu", 64, True, ("sdpa", None), id="auto-cpu-is-sdpa"),
        pytest.param("sdpa", "cpu", 60, True, ("sdpa", None), id="sdpa-forced"),
        pytest.param("flex", "cpu", 64, False, ("flex", None), id="flex-cpu-forward-only"),
        pytest.param("flex", "cpu", 64, True, (None, "no CPU backward"), id="flex-cpu-backward-rejected"),
        pytest.param("fast", "cpu", 64, True, (None, "kernel must be one of"), id="unknown-kernel"),
        pytest.param("varlen", "cpu", 64, True, (None, "needs a CUDA GPU"), id="varlen-cpu-rejected"),
    ],
)
def test_resolve_kernel(requested, device, head_dim, needs_grad, expected):
    kernel, error = resolve_kernel(requested, torch.device(device), head_dim, needs_grad)
    assert kernel == expected[0]
    assert (error is None) if expected[1] is None else (expected[1] in error)


def test_resolve_kernel_auto_follows_the_environment_override(monkeypatch):
    monkeypatch.setenv("CP_LINEAR_BLOCKDIAG_KERNEL", "flex")
    assert resolve_kernel("auto", torch.device("cpu"), 64, False) == ("flex", None)
    monkeypatch.setenv("CP_LINEAR_BLOCKDIAG_KERNEL", "fastest")
    kernel, error = resolve_kernel("auto", torch.device("cpu"), 64, False)
    assert kernel is None and "CP_LINEAR_BLOCKDIAG_KERNEL" in error


# --------------------------------------------------------------------------- varlen (FlashAttention)


def emulated_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """FlashAttention's varlen causal contract, in float64 torch ops (differentiable): segment i is
    query rows [cu_q[i], cu_q[i+1]) over key rows [cu_k[i], cu_k[i+1]) of the flattened batch, causal
    aligned bottom-right (the last query reads every key); a row that reads no key outputs 0."""
    batch, queries, q_heads, head_dim = q.shape
    group = q_heads // k.shape[2]
    q_rows, k_rows, v_rows = (x.reshape(-1, x.shape[2], head_dim).double() for x in (q, k, v))
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    assert cu_q[0] == 0 and cu_q[-1] == q_rows.shape[0] and cu_k[-1] <= k_rows.shape[0]
    pieces = []
    for q_lo, q_hi, k_lo, k_hi in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        lq, lk = q_hi - q_lo, k_hi - k_lo
        assert 0 <= lq <= max_q and 0 <= lk <= max_k
        keys = k_rows[k_lo:k_hi].repeat_interleave(group, dim=1)
        values = v_rows[k_lo:k_hi].repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q_rows[q_lo:q_hi], keys) * scale
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        weights = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)
        pieces.append(torch.einsum("hqk,khd->qhd", weights, values))
    return torch.cat(pieces).view(batch, queries, q_heads, head_dim).to(q.dtype)


def _window_layout(doc_ids, cp_size, rank, widen):
    """rank's layout with the plan's key window, or one widened to start at token 0 (all-gather)."""
    plan, layout = rank_problem(doc_ids, cp_size, rank)
    if widen:
        layout = DocCausalLayout.from_doc_ids(doc_ids, rank * plan.local_len, plan.local_len, 0,
                                              max(plan.real_end[rank], (rank + 1) * plan.local_len))
    return plan, layout


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("widen", [False, True], ids=["plan-window", "window-from-0"])
@pytest.mark.parametrize("rank", [0, 1, 2], ids=lambda r: f"rank{r}")
def test_varlen_segments_give_the_doc_causal_attention_and_gradients(rank, widen, batch, monkeypatch):
    """The segments handed to FlashAttention (emulated) reproduce the full-sequence attention on the
    local queries, gradients included: the tail of a document that began on an earlier rank reads
    from its start (more keys than queries), padding rows are 0, and batch rows stay apart."""
    import torch_api.attention.kernel as kernel_module

    monkeypatch.setattr(kernel_module, "varlen_attention", emulated_varlen)
    plan, layout = _window_layout(DOC_IDS_63, 3, rank, widen)
    q, k, v = random_qkv(batch, 63, 4, 2, 16, torch.float64, seed=rank)
    query = slice(rank * plan.local_len, (rank + 1) * plan.local_len)
    keys = slice(layout.key_start, layout.key_start + layout.key_len)
    grad_out = torch.randn(batch, plan.local_len, 4, 16, generator=torch.Generator().manual_seed(3),
                           dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_blockdiag_attention(*full, torch.from_numpy(DOC_IDS_63))[:, query]
    ref.backward(grad_out)
    local = [q[:, query].clone().requires_grad_(), k[:, keys].clone().requires_grad_(),
             v[:, keys].clone().requires_grad_()]
    out = doc_causal_attention(*local, layout, kernel="varlen")
    out.backward(grad_out)
    bound = tolerance(attention_length(63, 16), dtype="float64", compared_with="rounded")
    assert_close("output", host(ref), host(out), bound)
    assert torch.all(out[:, DOC_IDS_63[query] == 0] == 0)
    for name, got, want in (("dq", local[0].grad, full[0].grad[:, query]), ("dk", local[1].grad, full[1].grad[:, keys]),
                            ("dv", local[2].grad, full[2].grad[:, keys])):
        assert_close(name, host(want), host(got), bound)


def test_varlen_segments_of_a_window_describe_runs_and_their_key_ranges():
    # rank 1 of DOC_IDS_63 (queries 21..41, keys from 9): doc 2's tail reads from its start (key 0)
    _, layout = rank_problem(DOC_IDS_63, 3, 1)
    cu_q, cu_k, max_q, max_k = layout.varlen_segments()
    assert cu_q.tolist() == [0, 5, 8, 19, 21]  # doc 2 tail, padding, doc 3, doc 4
    assert cu_k.tolist() == [0, 17, 20, 31, 33]  # doc 2 from its start; padding reads itself
    assert (max_q, max_k) == (11, 17)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rank", [0, 1, 2], ids=lambda r: f"rank{r}")
def test_varlen_kernel_on_the_gpu_matches_the_reference(rank, dtype):
    """FlashAttention itself (CUDA): outputs and gradients against the float64 path within the
    rounding of bf16/fp16 attention, on windows where the first document has more keys than queries."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch_api.attention.kernel import varlen_reason

    reason = varlen_reason(torch.device("cuda"), 64, dtype)
    if reason:
        pytest.skip(reason)
    doc_ids = np.repeat([1, 2, 3, 0, 4, 5, 6, 7], [300, 41, 900, 100, 7, 500, 1300, 23])  # T = 3171 = 3 x 1057
    plan, layout = _window_layout(doc_ids, 3, rank, widen=False)
    q, k, v = random_qkv(2, doc_ids.shape[0], 8, 2, 64, torch.float64, seed=rank)
    query = slice(rank * plan.local_len, (rank + 1) * plan.local_len)
    keys = slice(layout.key_start, layout.key_start + layout.key_len)
    grad_out = torch.randn(2, plan.local_len, 8, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_blockdiag_attention(*full, torch.from_numpy(doc_ids))[:, query]
    ref.backward(grad_out)
    local = [x.to("cuda", dtype).requires_grad_() for x in (q[:, query], k[:, keys], v[:, keys])]
    out = doc_causal_attention(*local, layout, kernel="varlen")
    out.backward(grad_out.to("cuda", dtype))
    assert torch.all(out[:, torch.from_numpy(doc_ids[query] == 0).cuda()] == 0)
    # bf16 / fp16 rounding of q, k, v, P and the output: 1e-2 (bf16) relative is a few unit roundoffs
    bound = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close("output", host(ref), host(out.detach().float().cpu()), bound)
    for name, got, want in (("dq", local[0].grad, full[0].grad[:, query]), ("dk", local[1].grad, full[1].grad[:, keys]),
                            ("dv", local[2].grad, full[2].grad[:, keys])):
        assert_close(name, host(want), host(got.float().cpu()), 2 * bound)
