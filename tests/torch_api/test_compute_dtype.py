"""``HybridDecoder(compute_dtype=)``: a residual stream in the compute dtype over float32 weights, as the JAX
model's option, with and without autocast; the default (None) keeps the float32 model as it was.

The values against the JAX model are tests/parity/test_layer_parity.py's; here the dtypes every block sees,
the layers that make them (``Linear``, ``RMSNorm``, ``ShortConvolution``) and the option's validation.
"""

import contextlib

import numpy as np
import pytest
import torch

from torch_api.layers import DecoderConfig, HybridDecoder
from torch_api.layers.blocks import Linear, RMSNorm, ShortConvolution

CONFIG = DecoderConfig(vocab_size=17, hidden_size=24, num_layers=2, num_heads=2, head_dim=8, num_kv_heads=1)
DOC_IDS = np.repeat([1, 0, 2, 3], [9, 2, 14, 6])  # T = 31, with padding


def cpu_autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def run_recording_dtypes(model, autocast: bool):
    """(logits, grads, [dtype of every block's input and output, every mixer's output]) of one step."""
    seen = []
    hooks = []
    for block in model.layers:
        hooks.append(block.register_forward_hook(lambda m, args, out: seen.append(("block", args[0].dtype, out.dtype))))
        hooks.append(block.attn.register_forward_hook(lambda m, args, out: seen.append(("mixer", args[0].dtype,
                                                                                        out.dtype))))
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (1, DOC_IDS.size)))
    model.zero_grad(set_to_none=True)
    try:
        with cpu_autocast(autocast):
            logits = model(tokens, doc_ids=torch.from_numpy(DOC_IDS))
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, {name: p.grad for name, p in model.named_parameters()}, seen


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "cpu-autocast"])
def test_bf16_compute_dtype_keeps_every_block_in_bf16_over_float32_weights(autocast):
    torch.manual_seed(0)
    model = HybridDecoder(CONFIG, compute_dtype=torch.bfloat16)
    logits, grads, seen = run_recording_dtypes(model, autocast)
    assert seen and all(dtypes == torch.bfloat16 for _, *pair in seen for dtypes in pair), seen
    assert logits.dtype == torch.bfloat16  # as the JAX model's: lm_head(norm(h)) in the residual dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


def test_bf16_compute_dtype_gives_the_same_step_with_and_without_autocast():
    """Every linear casts its float32 weight to the bf16 activations as autocast would, and every other op
    already sees bf16 or computes in float32: the two steps are bitwise equal."""
    torch.manual_seed(0)
    model = HybridDecoder(CONFIG, compute_dtype=torch.bfloat16)
    eager_logits, eager_grads, _ = run_recording_dtypes(model, autocast=False)
    autocast_logits, autocast_grads, _ = run_recording_dtypes(model, autocast=True)
    assert torch.equal(eager_logits, autocast_logits)
    assert all(torch.equal(eager_grads[name], autocast_grads[name]) for name in eager_grads)


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "cpu-autocast"])
def test_default_keeps_the_float32_residual_stream(autocast):
    """None leaves the embeddings' float32 stream (autocast lowers only the mixers' outputs, as before);
    compute_dtype=float32 is the same model, bitwise."""
    torch.manual_seed(0)
    model = HybridDecoder(CONFIG)
    logits, grads, seen = run_recording_dtypes(model, autocast)
    assert all(kind != "block" or (given, made) == (torch.float32, torch.float32) for kind, given, made in seen), seen
    assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    explicit = HybridDecoder(CONFIG, compute_dtype=torch.float32)
    explicit.load_state_dict(model.state_dict())
    explicit_logits, explicit_grads, _ = run_recording_dtypes(explicit, autocast)
    assert torch.equal(logits, explicit_logits)
    assert all(torch.equal(grads[name], explicit_grads[name]) for name in grads)


@pytest.mark.parametrize("compute_dtype", [
    pytest.param(torch.int32, id="integer-dtype"),
    pytest.param("bfloat16", id="a-name-not-a-dtype"),
    pytest.param(np.float32, id="numpy-dtype"),
])
def test_compute_dtype_must_be_a_floating_torch_dtype(compute_dtype):
    with pytest.raises(ValueError, match="compute_dtype must be a floating torch dtype"):
        HybridDecoder(CONFIG, compute_dtype=compute_dtype)


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "cpu-autocast"])
def test_rms_norm_of_a_bf16_row_computes_in_float32_and_rounds_once(autocast):
    torch.manual_seed(0)
    norm = RMSNorm(24)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(24))
    x = (3 * torch.randn(5, 24)).bfloat16()
    x32 = x.double()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()).bfloat16()
    with cpu_autocast(autocast):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    # float32 statistics then one rounding: the correctly rounded value up to one bf16 ulp where float32
    # lands next to a rounding boundary
    assert torch.allclose(out.float(), expected.float(), rtol=2**-8, atol=0)
    assert (out == expected).float().mean() > 0.95


def test_linear_casts_its_weight_only_for_narrower_activations():
    torch.manual_seed(0)
    linear = Linear(24, 7, bias=True)
    x = torch.randn(3, 24)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))  # float32: nn.Linear's
    out = linear(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, linear(x.bfloat16()))  # what autocast's own cast gives


def test_short_conv_of_a_bf16_window_rounds_once_after_the_silu():
    torch.manual_seed(0)
    conv = ShortConvolution(16, 4, bias=True)
    window = torch.randn(1, 3 + 10, 16).bfloat16()
    positions = torch.arange(10)
    out = conv(window, positions)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, conv(window.float(), positions).bfloat16())  # float32 math, one rounding
