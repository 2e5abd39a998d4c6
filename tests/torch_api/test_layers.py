"""torch layers: parameter table, float64 references on one device, CP == one device over gloo.

One device: ``GatedDeltaProduct`` / ``BlockDiagAttention`` are checked against float64 forwards
written here from plain ops (per-document ``F.conv1d``, the token-by-token GDP recurrence,
complex-number RoPE, a dense masked softmax), outputs and parameter gradients. Under CP every rank
runs its shard through the module and the worker compares the output, the input gradient and the
all-reduced parameter gradients with the one-device run of the same module on the whole sequence.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_linear.plan import build_blockdiag_plan
from tests.tolerance import (
    assert_close,
    assert_within,
    decoder_length,
    layer_length,
    rel_err,
    token_cancellation,
    tolerance,
)
from torch_api.gdp.naive import naive_gated_delta_product
from torch_api.layers import (
    AttentionConfig,
    BlockDiagAttention,
    DecoderConfig,
    GatedDeltaProduct,
    GDPConfig,
    HybridDecoder,
    PackedLayout,
    build_shard_layout,
    parameter_shapes,
)
from torch_api.layers.conv import conv_window, masked_causal_conv, naive_document_conv


GDP_VARIANTS = {
    "default": dict(hidden_size=20, head_dim=6, num_heads=2, expand_v=1.5, num_householder=2),
    "n_h3-GVA-conv-bias": dict(hidden_size=20, head_dim=6, num_heads=1, num_v_heads=2, expand_v=1.0,
                               num_householder=3, conv_bias=True, conv_size=3, allow_neg_eigval=False),
    "no-gates-no-conv": dict(hidden_size=20, head_dim=6, num_heads=2, num_householder=1, use_output_gate=False,
                             use_forget_gate=False, use_short_conv=False),
}
ATTENTION = dict(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=6)


def doc_ids_from_runs(*runs):
    """runs of (doc id, length) -> int64 [T]; id 0 is padding."""
    return np.concatenate([np.full(n, d, np.int64) for d, n in runs])


def seeded(module_cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = module_cls(**kwargs)
    with torch.no_grad():  # make the gates and norms non-trivial (their defaults are ones / zeros)
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(0.3 * torch.randn_like(param))
    return module


# --------------------------------------------------------------------------- float64 references


def reference_positions(doc_ids):
    positions, start = [], 0
    for t in range(len(doc_ids)):
        if t == 0 or doc_ids[t] != doc_ids[t - 1]:
            start = t
        positions.append(t - start)
    return positions


def reference_gdp(module, x, doc_ids):
    """The layer's math, float64, from the module's parameters; x [1, T, D]."""
    c, n = module.config, module.config.num_householder
    p = {name: w.double() for name, w in module.named_parameters()}
    x = x.double()
    _, tokens, _ = x.shape
    runs = np.concatenate([[0], np.nonzero(np.diff(doc_ids))[0] + 1, [tokens]])
    projected = {}
    for name in ("q", "k", "v"):
        y = F.linear(x, p[f"{name}_proj.weight"])
        if c.use_short_conv:
            y = naive_document_conv(y, p[f"{name}_conv1d.weight"], p.get(f"{name}_conv1d.bias"), runs)
        projected[name] = F.silu(y)
    q = projected["q"].view(1, tokens, c.num_heads, c.head_dim)
    k = projected["k"].view(1, tokens * n, c.num_heads, c.head_dim)
    v = projected["v"].view(1, tokens * n, c.value_heads, c.head_v_dim)
    group = c.value_heads // c.num_heads
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    beta = torch.sigmoid(F.linear(x, p["b_proj.weight"])) * (2.0 if c.allow_neg_eigval else 1.0)
    beta = beta.view(1, tokens * n, c.value_heads)
    if c.use_forget_gate:
        g = -torch.exp(p["A_log"]) * F.softplus(F.linear(x, p["a_proj.weight"]) + p["dt_bias"])
    else:
        g = x.new_zeros(1, tokens, c.value_heads)
    o, _ = naive_gated_delta_product(q, k, v, g, beta, num_householder=n, cu_seqlens=runs,
                                     use_qk_l2norm_in_kernel=True)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.norm_eps) * p["o_norm.weight"]
    if c.use_output_gate:
        o = o * F.silu(F.linear(x, p["g_proj.weight"]).view(1, tokens, c.value_heads, c.head_v_dim))
    return F.linear(o.reshape(1, tokens, c.value_dim), p["o_proj.weight"])


def reference_attention(module, x, doc_ids):
    """GQA softmax within documents, RoPE as complex rotations at in-document positions; float64."""
    c, d = module.config, module.config.dim_per_head
    p = {name: w.double() for name, w in module.named_parameters()}
    x = x.double()
    tokens = x.shape[1]
    q = F.linear(x, p["q_proj.weight"]).view(1, tokens, c.num_heads, d)
    k = F.linear(x, p["k_proj.weight"]).view(1, tokens, c.kv_heads, d)
    v = F.linear(x, p["v_proj.weight"]).view(1, tokens, c.kv_heads, d)
    position = torch.tensor(reference_positions(doc_ids), dtype=torch.float64)
    freq = c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rotation = torch.polar(torch.ones(tokens, d // 2, dtype=torch.float64), position[:, None] * freq)

    def rope(t):  # pair dimension i with i + d/2 as one complex number
        z = torch.complex(t[..., :d // 2], t[..., d // 2:]) * rotation[None, :, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    q, k = rope(q), rope(k).repeat_interleave(c.num_heads // c.kv_heads, 2)
    v = v.repeat_interleave(c.num_heads // c.kv_heads, 2)
    ids = torch.as_tensor(doc_ids)
    index = torch.arange(tokens)
    allowed = (ids[:, None] == ids[None, :]) & (index[None, :] <= index[:, None])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", weights, v) * (ids > 0).view(1, tokens, 1, 1)
    return F.linear(out.reshape(1, tokens, c.num_heads * d), p["o_proj.weight"])


def parameter_cancellation(module, forward, x, cotangent):
    """kappa of every parameter gradient of sum(forward(module, x) * cotangent) (tests/tolerance.py)."""
    out = forward(module, x)
    names, params = zip(*module.named_parameters())

    def grads(cot):
        got = torch.autograd.grad(out, params, torch.as_tensor(cot), retain_graph=True, allow_unused=True)
        return {name: np.zeros(p.shape) if g is None else g.numpy() for name, p, g in zip(names, params, got)}

    return token_cancellation(grads, np.asarray(cotangent))


def assert_layer_matches(module, out, grads, ref, ref_grads, kappa, tokens):
    """A float32 layer against its float64 reference, each parameter gradient with its own kappa."""
    length = layer_length(module.config, tokens)
    assert_close("output", ref, out, tolerance(length))
    for name in grads:
        assert_close(name, ref_grads[name], grads[name], tolerance(length, cancellation=kappa[name]))


def outputs_and_grads(module, forward, x, cotangent):
    module.zero_grad(set_to_none=True)
    out = forward(module, x)
    (out * cotangent).sum().backward()
    return out.detach(), {name: p.grad.detach().clone() for name, p in module.named_parameters()}


# --------------------------------------------------------------------------- parameter table


FLA_GDP_NAMES = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "a_proj.weight", "A_log",
                 "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight",
                 "o_norm.weight", "o_proj.weight"]


def test_gdp_parameters_carry_flash_linear_attention_names_and_shapes():
    layer = GatedDeltaProduct(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0, num_householder=3)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert sorted(shapes) == sorted(FLA_GDP_NAMES)
    # key_dim = 2*8, value_dim = 4*16 (FLA's formulas), n_h = 3 keys/values per token
    assert shapes["k_proj.weight"] == (16 * 3, 32) and shapes["v_proj.weight"] == (64 * 3, 32)
    assert shapes["b_proj.weight"] == (4 * 3, 32) and shapes["k_conv1d.weight"] == (48, 1, 4)
    assert shapes["o_norm.weight"] == (16,) and shapes["o_proj.weight"] == (32, 64)


@pytest.mark.parametrize("config", [
    pytest.param(GDPConfig(**GDP_VARIANTS["n_h3-GVA-conv-bias"]), id="gdp-GVA-conv-bias"),
    pytest.param(GDPConfig(**GDP_VARIANTS["no-gates-no-conv"]), id="gdp-no-gates-no-conv"),
    pytest.param(AttentionConfig(qkv_bias=True, **ATTENTION), id="attention-qkv-bias"),
    pytest.param(DecoderConfig(vocab_size=11, hidden_size=20, num_layers=3, head_dim=6), id="decoder"),
])
def test_module_parameters_match_the_shared_table(config):
    module = {GDPConfig: GatedDeltaProduct, AttentionConfig: BlockDiagAttention, DecoderConfig: HybridDecoder}[
        type(config)](config)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == parameter_shapes(config)


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(hidden_size=8, num_heads=3, num_v_heads=4), "multiple of num_heads", id="v-heads-not-multiple"),
    pytest.param(dict(hidden_size=8, head_dim=5, expand_v=0.3), "positive integer", id="fractional-value-dim"),
    pytest.param(dict(hidden_size=0), "positive int", id="zero-width"),
])
def test_bad_gdp_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GDPConfig(**kwargs)


# --------------------------------------------------------------------------- one device vs float64


@pytest.mark.parametrize("variant", list(GDP_VARIANTS))
def test_gdp_layer_matches_float64_reference_with_packed_documents(variant):
    module = seeded(GatedDeltaProduct, 1, **GDP_VARIANTS[variant])
    doc_ids = doc_ids_from_runs((1, 9), (2, 1), (3, 23), (4, 4))  # T = 37, a one-token document
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, 37, 20, generator=generator)
    cotangent = torch.randn(1, 37, 20, generator=generator)
    seq_idx = torch.from_numpy(PackedLayout.from_doc_ids(doc_ids).seq_idx.copy()).view(1, -1)
    forward = lambda m, x: m(x, seq_idx=seq_idx)  # noqa: E731
    out, grads = outputs_and_grads(module, forward, x, cotangent)
    ref, ref_grads = outputs_and_grads(module, lambda m, x: reference_gdp(m, x, doc_ids), x, cotangent)
    kappa = parameter_cancellation(module, forward, x, cotangent)
    assert_layer_matches(module, out, grads, ref, ref_grads, kappa, tokens=37)


def test_attention_layer_matches_float64_reference_with_padding_and_gqa():
    module = seeded(BlockDiagAttention, 3, **ATTENTION)
    doc_ids = doc_ids_from_runs((5, 11), (0, 3), (2, 17), (0, 2), (9, 6))
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, 39, 20, generator=generator)
    cotangent = torch.randn(1, 39, 20, generator=generator)
    ids = torch.from_numpy(doc_ids)
    forward = lambda m, x: m(x, doc_ids=ids)  # noqa: E731
    out, grads = outputs_and_grads(module, forward, x, cotangent)
    ref, ref_grads = outputs_and_grads(module, lambda m, x: reference_attention(m, x, doc_ids), x, cotangent)
    assert out[0, 11:14].abs().max() == 0 and out[0, 31:33].abs().max() == 0  # padding rows
    assert_layer_matches(module, out, grads, ref, ref_grads, parameter_cancellation(module, forward, x, cotangent),
                         tokens=39)


def test_rope_positions_restart_at_every_document():
    layout = PackedLayout.from_doc_ids(doc_ids_from_runs((1, 3), (0, 2), (7, 4)))
    assert layout.position.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert layout.seq_idx.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("module_cls, kwargs", [
    pytest.param(BlockDiagAttention, ATTENTION, id="attention"),
    pytest.param(GatedDeltaProduct, GDP_VARIANTS["default"], id="gdp"),
])
def test_a_document_reads_the_same_wherever_it_is_packed(module_cls, kwargs):
    """Positions restart and no state or conv tap crosses a boundary: output depends on the document only."""
    module = seeded(module_cls, 5, **kwargs)
    generator = torch.Generator().manual_seed(6)
    document, before = torch.randn(1, 13, 20, generator=generator), torch.randn(1, 10, 20, generator=generator)
    alone = module(document, doc_ids=torch.ones(13, dtype=torch.long)) if module_cls is BlockDiagAttention \
        else module(document)
    ids = torch.from_numpy(doc_ids_from_runs((1, 10), (2, 13)))
    packed_kw = {"doc_ids": ids} if module_cls is BlockDiagAttention else {"cu_seqlens": torch.tensor([0, 10, 23])}
    packed = module(torch.cat([before, document], dim=1), **packed_kw)
    # the same document through the same float32 math, chunked / blocked at other offsets
    assert_close("document", alone.detach(), packed[:, 10:].detach(),
                 tolerance(layer_length(module.config, 13), compared_with="rounded"))


def test_masked_conv_matches_per_document_conv():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, 31, 10, dtype=torch.float64, generator=generator)
    weight = torch.randn(10, 1, 4, dtype=torch.float64, generator=generator)
    bias = torch.randn(10, dtype=torch.float64, generator=generator)
    layout = PackedLayout.from_doc_ids(doc_ids_from_runs((1, 2), (2, 1), (3, 20), (0, 3), (4, 5)))
    out = masked_causal_conv(conv_window(x, 3), weight, bias, torch.from_numpy(layout.position.copy()))
    assert_close("conv", naive_document_conv(x, weight, bias, layout.cu_seqlens()), out,
                 tolerance(weight.shape[-1], dtype="float64", compared_with="rounded"))


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda m, x: m(x[:, :, :7]), "D=20", id="wrong-width"),
    pytest.param(lambda m, x: m(torch.cat([x, x]), cu_seqlens=torch.tensor([0, 5, 16])), "B = 1", id="packed-B2"),
    pytest.param(lambda m, x: m(x, cu_seqlens=torch.tensor([0, 5, 15])), "T = 15", id="ids-for-another-T"),
    pytest.param(lambda m, x: m(x, layout=object()), "ShardLayout", id="metadata-of-wrong-type"),
    pytest.param(lambda m, x: m(x, seq_idx=torch.tensor([[0, 1] * 8])), "nondecreasing", id="reappearing-sequence"),
])
def test_gdp_layer_rejects_bad_input(call, match):
    module = GatedDeltaProduct(**GDP_VARIANTS["default"])
    with pytest.raises(ValueError, match=match):
        call(module, torch.randn(1, 16, 20))


# --------------------------------------------------------------------------- CP over gloo

LOCAL_LEN = 12


def cp_layouts(world):
    """Global doc ids (T = world * 12) for the boundary situations, per world size."""
    total, L = world * LOCAL_LEN, LOCAL_LEN
    return {
        # document 2 starts exactly at rank 1's first token; document 1 is cut by nothing
        "document-starts-at-rank-boundary": doc_ids_from_runs((1, L), (2, total - L)),
        # document 3 runs across the boundary (conv halo and RoPE positions continue), padding inside
        "document-crosses-rank-boundary": doc_ids_from_runs((1, 4), (0, 2), (3, L + 2), (4, total - L - 8)),
        # one document over every rank: attention needs a2a (or all-gather) beyond two ranks
        "document-spans-every-rank": doc_ids_from_runs((1, 2), (2, total - 5), (0, 3)),
    }


def _run_cp_case(rank, world, module, x_full, cotangent, one_device, under_cp):
    """Errors of (output, input grad, param grads) of CP vs one device for this rank's shard."""
    shard = slice(rank * x_full.shape[1] // world, (rank + 1) * x_full.shape[1] // world)
    x_ref = x_full.clone().requires_grad_()
    out_full, grads_full = outputs_and_grads(module, one_device, x_ref, cotangent)
    x_grad_ref = x_ref.grad[:, shard]
    module.zero_grad(set_to_none=True)
    x_local = x_full[:, shard].clone().requires_grad_()
    out_local = under_cp(module, x_local)
    (out_local * cotangent[:, shard]).sum().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    dist.all_reduce(flat)
    flat_ref = torch.cat([grads_full[name].reshape(-1) for name, _ in module.named_parameters()])
    return (rel_err(out_local.detach(), out_full[:, shard]), rel_err(x_local.grad, x_grad_ref),
            rel_err(flat, flat_ref))


def layer_cp_cases(rank, world):
    """{case: ((output, input grad, parameter grads) errors, the layer's config)} of this rank."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    total = world * LOCAL_LEN
    errors = {}
    generator = torch.Generator().manual_seed(11)
    x_full = torch.randn(1, total, 20, generator=generator)
    cotangent = torch.randn(1, total, 20, generator=generator)
    for name, doc_ids in cp_layouts(world).items():
        ids = torch.from_numpy(doc_ids)
        layout = build_shard_layout(total_len=total, doc_ids=doc_ids, cp_group=group)
        for variant in ("default", "n_h3-GVA-conv-bias"):
            module = seeded(GatedDeltaProduct, 1, **GDP_VARIANTS[variant])
            errors[f"gdp-{variant}-{name}"] = _run_cp_case(
                rank, world, module, x_full, cotangent,
                lambda m, x: m(x, layout=build_shard_layout(total_len=total, doc_ids=doc_ids)),
                lambda m, x: m(x, layout=layout)), module.config
        modes = ["auto", "allgather", "a2a"] + (["halo"] if build_blockdiag_plan(doc_ids, world).use_halo else [])
        for mode in modes:
            module = seeded(BlockDiagAttention, 3, mode=mode, **ATTENTION)
            errors[f"attention-{mode}-{name}"] = _run_cp_case(
                rank, world, module, x_full, cotangent, lambda m, x: m(x, doc_ids=ids),
                lambda m, x: m(x, doc_ids=ids, cp_group=group)), module.config
    # unpacked rows (B = 2): every row one sequence over all ranks; ids given as seq_idx too
    rows = torch.randn(2, total, 20, generator=generator)
    rows_cotangent = torch.randn(2, total, 20, generator=generator)
    module = seeded(GatedDeltaProduct, 1, **GDP_VARIANTS["default"])
    errors["gdp-rows-B2"] = _run_cp_case(rank, world, module, rows, rows_cotangent, lambda m, x: m(x),
                                         lambda m, x: m(x, cp_group=group)), module.config
    seq_idx = torch.from_numpy(np.repeat([0, 1, 2], [5, total - 7, 2])).view(1, -1)
    errors["gdp-seq_idx"] = _run_cp_case(rank, world, module, x_full, cotangent, lambda m, x: m(x, seq_idx=seq_idx),
                                         lambda m, x: m(x, seq_idx=seq_idx, cp_group=group)), module.config
    # the log-depth summary scan in place of the all-gather (docs/cp_options.md)
    module = seeded(GatedDeltaProduct, 1, cp_summary_exchange="scan", **GDP_VARIANTS["default"])
    errors["gdp-summary-scan"] = _run_cp_case(rank, world, module, x_full, cotangent,
                                              lambda m, x: m(x, seq_idx=seq_idx),
                                              lambda m, x: m(x, seq_idx=seq_idx, cp_group=group)), module.config
    return errors


def decoder_cp_case(rank, world):
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=13, hidden_size=20, num_layers=4, num_heads=2, head_dim=6, num_kv_heads=1)
    model = HybridDecoder(config)
    total = world * LOCAL_LEN
    doc_ids = doc_ids_from_runs((1, 5), (2, total - 9), (0, 4))
    tokens = torch.randint(0, 13, (1, total), generator=torch.Generator().manual_seed(3))
    shard = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    full = model(tokens, doc_ids=torch.from_numpy(doc_ids))
    full.square().mean().backward()
    ref_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    local = model(tokens[:, shard], doc_ids=doc_ids, cp_group=dist.group.WORLD)
    (local.square().sum() / full.numel()).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)
    return rel_err(local.detach(), full.detach()[:, shard]), rel_err(grads, ref_grads)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_layers_and_decoder_under_cp_equal_one_device(gloo_pools, world):
    pool = gloo_pools(world)
    per_rank = pool.run(layer_cp_cases)
    total = world * LOCAL_LEN
    for rank, errors in enumerate(per_rank):
        for case, (case_errors, config) in errors.items():
            # CP against one device: two float32 results (rows: B = 2 token sums)
            tol = tolerance(layer_length(config, total, batch=2), compared_with="rounded")
            for what, err in zip(("output", "input gradient", "parameter gradients"), case_errors):
                assert_within(f"rank {rank} {case} {what}", err, tol)
    config = DecoderConfig(vocab_size=13, hidden_size=20, num_layers=4, num_heads=2, head_dim=6, num_kv_heads=1)
    tol = tolerance(decoder_length(config, total) + config.vocab_size * total, compared_with="rounded")
    for rank, (logits_err, grad_err) in enumerate(pool.run(decoder_cp_case)):
        assert_within(f"rank {rank} logits", logits_err, tol)
        assert_within(f"rank {rank} parameter gradients", grad_err, tol)


def conv_halo_case(rank, world, doc_ids, perturbed_rank):
    """Local CP conv vs the per-document conv of the whole sequence, and what a perturbation reaches."""
    generator = torch.Generator().manual_seed(21)
    total = len(doc_ids)
    x_full = torch.randn(1, total, 5, dtype=torch.float64, generator=generator)
    weight = torch.randn(5, 1, 4, dtype=torch.float64, generator=generator)
    cotangent = torch.randn(1, total, 5, dtype=torch.float64, generator=generator)
    layout = build_shard_layout(total_len=total, doc_ids=doc_ids, cp_group=dist.group.WORLD)
    local_len = total // world
    shard = slice(rank * local_len, (rank + 1) * local_len)

    def local_conv(x):
        window = conv_window(x[:, shard], 3, dist.group.WORLD)
        return masked_causal_conv(window, weight, None, layout.positions(x.device))

    x = x_full.clone().requires_grad_()
    out = local_conv(x)
    (out * cotangent[:, shard]).sum().backward()
    x_ref = x_full.clone().requires_grad_()
    ref = naive_document_conv(x_ref, weight, None, layout.packed.cu_seqlens())
    (ref * cotangent).sum().backward()
    # the halo's gradient returns to its sender: sum the contributions of all ranks
    grad = x.grad.clone()
    dist.all_reduce(grad)
    changed = x_full.clone()
    changed[:, perturbed_rank * local_len:(perturbed_rank + 1) * local_len] += 1.0
    moved = (local_conv(changed) - out).abs().amax(dim=(0, 2))  # [L]: which local outputs moved
    return rel_err(out.detach(), ref.detach()[:, shard]), rel_err(grad, x_ref.grad), moved.gt(0).tolist()


@pytest.mark.multirank
def test_conv_halo_at_document_and_rank_boundaries(gloo_pools):
    pool = gloo_pools(2)
    starts_at_boundary = doc_ids_from_runs((1, 12), (2, 12))
    per_rank = pool.run(conv_halo_case, starts_at_boundary, 0)
    tol = tolerance(4, dtype="float64", compared_with="rounded")  # a 4-tap conv, float64 both ways
    for out_err, grad_err, _ in per_rank:
        assert_within("conv output", out_err, tol)
        assert_within("conv input gradient", grad_err, tol)
    # a document starting exactly at rank 1's first token must not see rank 0's tokens
    assert per_rank[1][2] == [False] * 12
    crosses = doc_ids_from_runs((1, 5), (2, 10), (3, 9))  # document 2 runs over tokens 5..14
    per_rank = pool.run(conv_halo_case, crosses, 0)
    for out_err, grad_err, _ in per_rank:
        assert_within("conv output", out_err, tol)
        assert_within("conv input gradient", grad_err, tol)
    # the continuing document reads the last W - 1 = 3 tokens of rank 0; document 3 (from 15) reads none
    assert per_rank[1][2] == [True, True, True] + [False] * 9


def mismatched_inputs(rank, world, scenario):
    module = GatedDeltaProduct(**GDP_VARIANTS["default"])
    length = LOCAL_LEN + (1 if scenario == "local-length" and rank == world - 1 else 0)
    width = 21 if scenario == "width" and rank == 0 else 20
    x = torch.randn(1, length, width)
    try:
        module(x, cu_seqlens=torch.tensor([0, 7, world * LOCAL_LEN]), cp_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("scenario, expected", [
    pytest.param("local-length", "rejected on 1 rank", id="one-rank-has-a-longer-shard"),
    pytest.param("width", "D=20", id="one-rank-has-the-wrong-width"),
])
def test_bad_input_on_one_rank_raises_on_every_rank(gloo_pools, scenario, expected):
    messages = gloo_pools(2).run(mismatched_inputs, scenario)
    assert all(expected in message for message in messages), messages


def count_decoder_headers(rank, world, checks, compute_dtype=None):
    """Agreement headers of one decoder forward + backward (4 layers: 2 GDP, 2 attention)."""
    import torch_api._dist as dist_module

    calls = []
    original = dist_module.all_gather_single

    def counting(output, tensor, group=None):
        if tensor.dtype == torch.int64 and tensor.numel() == dist_module.HEADER_LEN:
            calls.append(1)
        return original(output, tensor, group=group)

    dist_module.all_gather_single = counting
    try:
        torch.manual_seed(0)
        config = DecoderConfig(vocab_size=16, hidden_size=16, num_layers=4, num_heads=2, head_dim=8, num_kv_heads=1)
        model = HybridDecoder(config, attention_options={"check_inputs": checks}, gdp_options={"cp_check_inputs": checks},
                              compute_dtype=compute_dtype)
        ids = torch.randint(0, 16, (1, LOCAL_LEN))
        doc_ids = doc_ids_from_runs((1, 5), (2, world * LOCAL_LEN - 5))
        model(ids, doc_ids=torch.tensor(doc_ids), cp_group=dist.group.WORLD).sum().backward()
    finally:
        dist_module.all_gather_single = original
    return len(calls)


@pytest.mark.multirank
def test_decoder_agrees_once_per_forward_and_per_op_only_for_value_checks(gloo_pools):
    # checks on: model + 2 GDP x (forward + backward) + 2 attention forwards = 7; off: the model header only
    assert gloo_pools(2).run(count_decoder_headers, True) == [7, 7]
    assert gloo_pools(2).run(count_decoder_headers, False) == [1, 1]
    # a bf16 residual stream: the model's header names the mixers' input dtype, so it still covers them
    assert gloo_pools(2).run(count_decoder_headers, False, torch.bfloat16) == [1, 1]
