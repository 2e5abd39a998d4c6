"""The fused short conv (``kernel_short_conv`` over the custom ops ``cp_linear::short_conv`` and
``cp_linear::short_conv_backward``) on the CPU, where the ops run the kernels' emulation.

* opcheck of both ops (schema, fake kernels, registered autograd);
* forward and gradients (x, halo, weight, bias) against the per-document float64 conv
  (``naive_document_conv``) for packed documents with length-1 documents, B = 2, one piece (one device)
  and two pieces (zig-zag CP) whose halos hold the real preceding tokens (on a Hopper GPU too, marked
  ``gpu``: the compiled kernels within the same bounds);
* ``GatedDeltaProduct`` on the kernel path (forced) against the torch path with the same weights, on one
  device and under CP (world 2: contiguous, graph-ready and zig-zag layouts), outputs and gradients, and
  its ``torch.compile(fullgraph=True)`` against eager.

Bounds are componentwise (Higham, ch. 3): a bf16 / fp16 result is off by its one rounding, at most
``u |exact|`` (u = 2^-8 / 2^-11), plus the float32 arithmetic before it, a few units of 2^-24 times the
same sums taken over absolute values (``abs_conv_grads``).
"""

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_api.layers.conv as conv
import torch_api.layers.gdp as gdp_layer
from tests.tolerance import rel_err, tolerance, unit_roundoff
from torch_api.layers import GatedDeltaProduct, build_shard_layout
from torch_api.layers.conv import kernel_short_conv, naive_document_conv, short_conv_kernel_reason

FLOAT32_UNIT = 2.0 ** -24
CHANNELS = 24  # three 16-byte vectors of bf16
LENGTH = 30  # tokens of the shard (two pieces of 15 for P = 2)


# --------------------------------------------------------------------------- the op against float64


def shard_case(width, lengths, dtype, with_bias, seed=0):
    """A packed sequence of W - 1 + L tokens whose last L tokens are the shard (B = 2 rows); ``lengths``
    (documents, summing to W - 1 + L) may start the shard inside a document."""
    generator = torch.Generator().manual_seed(seed)
    total = width - 1 + LENGTH
    assert sum(lengths) == total
    x_global = torch.randn(2, total, CHANNELS, generator=generator).to(dtype).double()  # exact in dtype
    weight = (torch.randn(CHANNELS, 1, width, generator=generator) * 0.6).double()  # float32 values
    bias = torch.randn(CHANNELS, generator=generator).double() if with_bias else None
    dy = torch.randn(2, LENGTH, CHANNELS, generator=generator).to(dtype).double()
    cu_seqlens = np.cumsum([0, *lengths])
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])[width - 1:])
    return x_global, weight, bias, dy, cu_seqlens, positions


def document_conv(x_global, weight, bias, cu_seqlens):
    """Pre-activation [B, W - 1 + L, C] of every row: ``naive_document_conv`` takes one row at a time."""
    return torch.cat([naive_document_conv(row[None], weight, bias, cu_seqlens) for row in x_global])


def abs_conv_grads(x_global, weight, bias, cu_seqlens, cotangent):
    """Gradients of the conv over absolute values for a nonnegative output gradient [B, L, C]: for every
    x / weight / bias entry, the sum of |terms| that its gradient adds up (componentwise magnitudes)."""
    leaves = [x_global.abs().requires_grad_(), weight.abs().requires_grad_()]
    leaves.append(None if bias is None else bias.abs().requires_grad_())
    pre = document_conv(*leaves, cu_seqlens)[:, weight.shape[-1] - 1:]
    grads = torch.autograd.grad(pre, [t for t in leaves if t is not None], cotangent)
    return grads if bias is not None else (*grads, None)


def assert_bounded(name, got, want, bound):
    """|got - want| <= bound element by element; the message names the worst element's ratio."""
    got = got.detach()
    ratio = (got.double() - want).abs() / bound
    worst = int(ratio.argmax())
    assert float(ratio.max()) <= 1.0, (f"{name}: error {float(ratio.max()):.2f} x its rounding bound at flat index "
                                       f"{worst} (got {float(got.reshape(-1)[worst]):.6g}, "
                                       f"want {float(want.reshape(-1)[worst]):.6g})")


def run_kernel(x_global, weight, bias, dy, positions, pieces, dtype, device):
    """kernel_short_conv on the shard, each piece's halo the W - 1 tokens before it -> (y, grads of the
    W - 1 + L global tokens (each halo's gradient added to the tokens it copied), weight, bias) on the host."""
    width = weight.shape[-1]
    piece = LENGTH // pieces
    x = x_global[:, width - 1:].to(device, dtype).requires_grad_()
    # piece p covers shard tokens [p·piece, (p + 1)·piece), i.e. global tokens from W - 1 + p·piece
    halo = torch.stack([x_global[:, p * piece:p * piece + width - 1] for p in range(pieces)], dim=1)
    halo = halo.to(device, dtype).requires_grad_()
    weight32 = weight.to(device, torch.float32).requires_grad_()
    bias32 = None if bias is None else bias.to(device, torch.float32).requires_grad_()
    y = kernel_short_conv(x, halo, weight32, bias32, positions.to(device))
    y.backward(dy.to(device, dtype))
    assert y.dtype == dtype and x.grad.dtype == dtype and halo.grad.dtype == dtype
    assert weight32.grad.dtype == torch.float32
    dx_global = torch.zeros_like(x_global)
    dx_global[:, width - 1:] += x.grad.cpu().double()
    for p in range(pieces):
        dx_global[:, p * piece:p * piece + width - 1] += halo.grad[:, p].cpu().double()
    return y.cpu(), dx_global, weight32.grad.cpu(), None if bias is None else bias32.grad.cpu()


def crossing_lengths(width):
    """Documents: the first starts W - 1 + 2 tokens before the shard; length-1 documents; one runs over
    the pieces' boundary (token 15), so piece 1 reads its halo."""
    return [width - 1 + 2, 1, 4, 1, 1, 9, 12]


def boundary_lengths(width):
    """A document starts exactly at piece 1's first token: its halo must be read by nothing."""
    return [width - 1 + 2, 1, 1, 11, 15]


OP_CASES = [pytest.param(width, packing, pieces, with_bias, torch.bfloat16,
                         id=f"W{width}-{packing.__name__.split('_')[0]}-P{pieces}-{'bias' if with_bias else 'nobias'}")
            for width in (4, 2) for packing in (crossing_lengths, boundary_lengths) for pieces in (1, 2)
            for with_bias in (True, False) if width == 4 or (pieces == 2 and with_bias)]
OP_CASES += [pytest.param(3, crossing_lengths, 2, True, torch.float16, id="W3-crossing-P2-bias-float16")]


@pytest.mark.parametrize("width, packing, pieces, with_bias, dtype", OP_CASES)
def test_kernel_short_conv_matches_float64_document_conv(width, packing, pieces, with_bias, dtype):
    check_against_float64(width, packing, pieces, with_bias, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("width, packing, pieces, with_bias, dtype", OP_CASES)
def test_kernel_short_conv_on_gpu_matches_float64_document_conv(width, packing, pieces, with_bias, dtype):
    """The compiled kernels (Hopper), within the same bounds as their emulation."""
    from torch_api.gdp.cutedsl import kernel_platform_reason

    reason = kernel_platform_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    check_against_float64(width, packing, pieces, with_bias, dtype, "cuda")


def check_against_float64(width, packing, pieces, with_bias, dtype, device):
    x_global, weight, bias, dy, cu_seqlens, positions = shard_case(width, packing(width), dtype, with_bias)
    leaves = [x_global.clone().requires_grad_(), weight.clone().requires_grad_()]
    leaves.append(None if bias is None else bias.clone().requires_grad_())
    pre = document_conv(*leaves, cu_seqlens)[:, width - 1:]
    pre.retain_grad()
    want = F.silu(pre)
    want.backward(dy)

    y, dx_global, dweight, dbias = run_kernel(x_global, weight, bias, dy, positions, pieces, dtype, device)
    u = unit_roundoff(dtype)
    # float32 arithmetic: pre's sum of W + 1 terms, then dpre, off by a few units times |dy| (|silu'| + |silu''|
    # |pre|) <= |dy| (1.1 + |pre| / 2); the sums of the gradients carry that and their own rounding
    abs_pre = document_conv(x_global.abs(), weight.abs(), None if bias is None else bias.abs(), cu_seqlens)
    abs_pre = abs_pre[:, width - 1:]
    dx_float32, dweight_float32, dbias_float32 = abs_conv_grads(x_global, weight, bias, cu_seqlens,
                                                                dy.abs() * (1.1 + 0.5 * abs_pre))
    # the output, dx and each halo's gradient are rounded to dtype once: at most u times their terms' sum,
    # or half a subnormal step (u times the smallest normal) below the normal range
    dx_terms = abs_conv_grads(x_global, weight, bias, cu_seqlens, pre.grad.abs())[0]
    subnormal = u * torch.finfo(dtype).smallest_normal
    assert_bounded("y", y, want.detach(),
                   u * want.detach().abs() + subnormal + 8 * (width + 1) * FLOAT32_UNIT * abs_pre)
    assert_bounded("dx (halo gradients added)", dx_global, leaves[0].grad,
                   u * dx_terms + 2 * subnormal + 4 * (2 * width + 4) * FLOAT32_UNIT * dx_float32)
    # float32 sums over the B·L tokens (runs, then the column sum), no rounding to dtype
    chain = 2 * LENGTH + width + 4
    assert_bounded("dweight", dweight, leaves[1].grad, 2 * chain * FLOAT32_UNIT * dweight_float32)
    if bias is not None:
        assert_bounded("dbias", dbias, leaves[2].grad, 2 * chain * FLOAT32_UNIT * dbias_float32)


# --------------------------------------------------------------------------- the ops and the selection rule


def op_inputs(pieces, with_bias, requires_grad):
    """Small bf16 inputs of the ops: B = 2, L = 10, C = 16, W = 4, two documents."""
    generator = torch.Generator().manual_seed(3)

    def leaf(t):
        return t.requires_grad_(requires_grad)

    x = leaf(torch.randn(2, 10, 16, generator=generator).bfloat16())
    halo = leaf(torch.randn(2, pieces, 3, 16, generator=generator).bfloat16())
    weight = leaf(torch.randn(16, 1, 4, generator=generator))
    bias = leaf(torch.randn(16, generator=generator)) if with_bias else None
    positions = torch.tensor([4, 5, 6, 0, 1, 2, 3, 4, 5, 6])
    return x, halo, weight, bias, positions


@pytest.mark.parametrize("pieces, with_bias", [(1, True), (2, False)], ids=["P1-bias", "P2-nobias"])
def test_short_conv_ops_pass_opcheck(pieces, with_bias):
    torch.library.opcheck(torch.ops.cp_linear.short_conv.default, op_inputs(pieces, with_bias, True))
    dy = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    torch.library.opcheck(torch.ops.cp_linear.short_conv_backward.default, (dy, *op_inputs(pieces, with_bias, False)))


def test_kernel_path_needs_a_hopper_gpu_unless_forced_and_takes_kernel_shapes_only(monkeypatch):
    x = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert short_conv_kernel_reason(x, 4, [16]) == "the kernels need a CUDA device; received cpu"
    monkeypatch.setattr(conv, "FORCE_SHORT_CONV_KERNEL", True)
    assert short_conv_kernel_reason(x, 4, [16, 32, 48]) is None
    assert short_conv_kernel_reason(x.half(), 2, [8]) is None
    assert "bfloat16 or float16; received torch.float32" in short_conv_kernel_reason(x.float(), 4, [16])
    assert "widths (2, 3, 4); received 5" in short_conv_kernel_reason(x, 5, [16])
    assert "divisible by 8; received (16, 12)" in short_conv_kernel_reason(x, 4, [16, 12])


@pytest.mark.parametrize("halo_shape, match", [
    pytest.param((2, 1, 2, 16), r"expected halo \[B, P, W - 1, C\] = \[2, P, 3, 16\]", id="halo-width"),
    pytest.param((2, 3, 3, 16), "L = 10 must divide into P = 3 equal pieces", id="uneven-pieces"),
])
def test_kernel_short_conv_rejects_bad_halo(halo_shape, match):
    x, _, weight, bias, positions = op_inputs(1, True, False)
    with pytest.raises(ValueError, match=match):
        kernel_short_conv(x, torch.zeros(halo_shape, dtype=x.dtype), weight, bias, positions)


# --------------------------------------------------------------------------- the layer: kernel path == torch path

LAYER_VARIANTS = {  # every conv's channels a multiple of 8 (q 16, k 32, v 48 / q 16, k 48, v 96)
    "W4": dict(hidden_size=32, head_dim=8, num_heads=2, expand_v=1.5, num_householder=2),
    "W3-bias-GVA": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.0, num_householder=3,
                        conv_bias=True, conv_size=3),
    "W2": dict(hidden_size=32, head_dim=8, num_heads=2, expand_v=1.0, num_householder=1, conv_size=2),
}


@contextlib.contextmanager
def kernel_path():
    """``GatedDeltaProduct`` on the fused conv (emulated on the CPU); yields the halo shapes of its calls.
    Usable inside the pool's ranks, where no monkeypatch fixture runs."""
    calls = []
    original = gdp_layer.kernel_short_conv

    def recorded(x, halo, weight, bias, positions):
        calls.append(tuple(halo.shape))
        return original(x, halo, weight, bias, positions)

    conv.FORCE_SHORT_CONV_KERNEL, gdp_layer.kernel_short_conv = True, recorded
    try:
        yield calls
    finally:
        conv.FORCE_SHORT_CONV_KERNEL, gdp_layer.kernel_short_conv = False, original


def layer_step(module, x, cotangent, layout):
    """Under bf16 autocast (the training setup): (conv outputs q, k, v, layer output, dx, parameter grads)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            convs = module._short_conv(x, layout)
        out = module(x, layout=layout)
    (out.float() * cotangent).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return convs, out.detach(), x.grad, grads


def paths_compared(module, x, cotangent, layout):
    """Errors of the kernel path against the torch path (same module, same inputs) and the kernel calls'
    halo shapes: {what: error}, [halo shape]."""
    torch_convs, torch_out, torch_dx, torch_grads = layer_step(module, x, cotangent, layout)
    with kernel_path() as calls:
        kernel_convs, kernel_out, kernel_dx, kernel_grads = layer_step(module, x, cotangent, layout)
    errors = {}
    for name, got, want in zip("qkv", kernel_convs, torch_convs):
        # the torch path's conv is float32 here (bf16 projections, float32 weights); the kernel rounds it once
        errors[f"conv {name} (x its rounding bound)"] = float(((got.double() - want.double()).abs()
                                                              / (2 ** -8 * want.double().abs() + 1e-6)).max())
    errors["output"] = rel_err(kernel_out.float(), torch_out.float())
    # per token: a halo that went astray spoils a few tokens' input gradients
    errors["input gradient (worst token)"] = max(rel_err(kernel_dx[:, t], torch_dx[:, t]) for t in range(x.shape[1]))
    for name, grad in torch_grads.items():
        errors[f"d{name}"] = rel_err(kernel_grads[name], grad)
    return errors, calls


def assert_paths_agree(label, errors, config):
    """The conv outputs within the kernel's one bf16 rounding of the torch path's float32 values; the rest
    within the bf16 roundings the two paths place differently (the torch path rounds the conv's input
    gradient once per tap, the kernel once; dq after or before the GVA repeat's sum): conv_size + 1."""
    tol = tolerance(config.conv_size + 1, dtype="bfloat16")
    for what, err in errors.items():
        bound = 1.0 if what.startswith("conv") else tol
        assert err <= bound, f"{label} {what}: {err:.3e} exceeds {bound:.3e}"


ONE_DEVICE_IDS = np.repeat([1, 2, 3, 0, 4, 5], [5, 1, 9, 2, 1, 14])  # length-1 documents, padding inside


@pytest.mark.parametrize("variant", LAYER_VARIANTS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "rows-B2"])
def test_gdp_layer_kernel_path_equals_torch_path_on_one_device(variant, packed):
    torch.manual_seed(0)
    module = GatedDeltaProduct(**LAYER_VARIANTS[variant])
    total = len(ONE_DEVICE_IDS)
    generator = torch.Generator().manual_seed(1)
    batch = 1 if packed else 2
    x = torch.randn(batch, total, 32, generator=generator)
    cotangent = torch.randn(batch, total, 32, generator=generator)
    layout = build_shard_layout(total_len=total, doc_ids=ONE_DEVICE_IDS if packed else None)
    errors, calls = paths_compared(module, x, cotangent, layout)
    width = module.config.conv_size
    # two forwards (the conv alone, the layer), three projections each, one piece of zeros each
    assert calls == [(batch, 1, width - 1, channels) for channels in module.config.conv_channels] * 2
    assert_paths_agree(variant, errors, module.config)


LOCAL_LEN = 12  # zig-zag chunks of 6 >= W - 1
# document 3 runs over tokens 3..12 (chunks of 6: the boundaries at 6 and 12, also the contiguous layout's
# rank boundary), document 5 over 16..23 (the boundary at 18); documents 2 and 4 are one token long
CP_IDS = np.repeat([1, 2, 3, 0, 4, 5], [2, 1, 10, 2, 1, 8])


def cp_paths_compared(rank, world, variants):
    """Per (layout, variant): the kernel path against the torch path on this rank's shard (each rank's input
    gradient includes what its tail's halo readers sent back)."""
    generator = torch.Generator().manual_seed(5)
    total = world * LOCAL_LEN
    x_full = torch.randn(1, total, 32, generator=generator)
    cotangent_full = torch.randn(1, total, 32, generator=generator)
    results = {}
    for layout_name, options in (("contiguous", {}), ("graph-ready", dict(max_sequences=8)),
                                 ("zigzag", dict(layout="zigzag"))):
        layout = build_shard_layout(total_len=total, doc_ids=CP_IDS, cp_group=dist.group.WORLD, **options)
        local = torch.from_numpy(layout.global_positions)
        for variant in variants:
            torch.manual_seed(0)
            module = GatedDeltaProduct(**LAYER_VARIANTS[variant])
            results[layout_name, variant] = paths_compared(module, x_full[:, local], cotangent_full[:, local],
                                                           layout)
    return results


@pytest.mark.multirank
def test_gdp_layer_kernel_path_equals_torch_path_under_cp(gloo_pools):
    variants = ("W4", "W3-bias-GVA")
    per_rank = gloo_pools(2).run(cp_paths_compared, variants, timeout=240)
    for rank, results in enumerate(per_rank):
        for (layout_name, variant), (errors, calls) in results.items():
            config = GatedDeltaProduct(**LAYER_VARIANTS[variant]).config
            pieces = 2 if layout_name == "zigzag" else 1
            assert calls == [(1, pieces, config.conv_size - 1, c) for c in config.conv_channels] * 2
            assert_paths_agree(f"rank {rank} {layout_name} {variant}", errors, config)


def test_gdp_layer_kernel_path_compiles_to_one_graph_with_eager_results():
    """torch.compile(fullgraph=True) traces the layer through the custom op (its fake kernel and registered
    backward; ``aot_eager``: no inductor compiler on CI's two cores) and gives the eager results."""
    torch.manual_seed(0)
    module = GatedDeltaProduct(cp_check_inputs=False, **LAYER_VARIANTS["W3-bias-GVA"])
    total = len(ONE_DEVICE_IDS)
    layout = build_shard_layout(total_len=total, doc_ids=ONE_DEVICE_IDS, max_sequences=8).materialize("cpu")
    x = torch.randn(1, total, 32, generator=torch.Generator().manual_seed(2))
    conv_ops = []

    def backend(graph_module, example_inputs):
        conv_ops.extend(str(node.target) for node in graph_module.graph.nodes if "short_conv" in str(node.target))
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

    def step(hidden):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(hidden, layout=layout)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    results = []
    with kernel_path():
        for run in (step, compiled):
            module.zero_grad(set_to_none=True)
            hidden = x.clone().requires_grad_()
            out = run(hidden)
            out.float().square().sum().backward()
            results.append((out.detach(), hidden.grad, [p.grad for p in module.parameters()]))
    assert conv_ops == ["cp_linear.short_conv"] * 3, conv_ops  # one graph, three kernel calls
    (eager_out, eager_dx, eager_grads), (compiled_out, compiled_dx, compiled_grads) = results
    assert torch.equal(compiled_out, eager_out)
    assert all(torch.equal(got, want) for got, want in zip(compiled_grads, eager_grads))
    # the input gradient sums the six projections' bf16 gradients, which eager and compiled autocast round
    # in different places (the torch path's conv alike: 3e-3 both)
    assert rel_err(compiled_dx, eager_dx) <= tolerance(6, dtype="bfloat16")
