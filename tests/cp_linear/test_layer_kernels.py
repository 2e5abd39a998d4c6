"""The GDP layer's elementwise kernels (``cp_linear.kernels.short_conv``, ``gated_rms_norm``).

On the CPU: each launch's emulation (the kernels' oracle) against float64 references written here from
the definitions — the short conv per document with explicit taps (pieces with real halos, as zig-zag CP
feeds them; length-1 documents; widths 2–4; batch rows), the gated norm through torch autograd — and the
column sum. On a GPU (marked ``gpu``): the kernels against the emulation on shapes with every edge
(channel and row counts that leave partial CTAs, runs cut by piece ends, documents starting anywhere),
and a rerun for bitwise equality.
"""

from __future__ import annotations

import pytest
import torch

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated, run_three_ways


def document_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).to(torch.int32)


def reference_conv(x, halo, weight, bias, positions):
    """float64 y = silu(conv) from the definition: token t of piece p reads token t − s (from the piece, or
    the halo before it) for s <= positions[t]. x [B, L, C], halo [B, P, W−1, C], weight [W, C], bias [C]."""
    batch, length, channels = x.shape
    pieces, width = halo.shape[1], weight.shape[0]
    piece = length // pieces
    y = torch.empty(batch, length, channels, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            p, start = t // piece, (t // piece) * piece
            total = bias.clone()
            for s in range(width):
                if s > positions[t]:
                    continue
                source = x[b, t - s] if t - s >= start else halo[b, p, width - 1 + t - s - start]
                total = total + weight[width - 1 - s] * source
            y[b, t] = total * torch.sigmoid(total)
    return y


def conv_launches(x, halo, weight, bias, positions, dy, dtype="bfloat16"):
    """The three launches on [rows, C/8, 8] views (the layouts of ``ShortConvLaunch``)."""
    batch, length, channels = x.shape
    pieces, width = halo.shape[1], weight.shape[0]
    vectors = channels // 8
    view = lambda t: t.reshape(-1, vectors, 8)  # noqa: E731
    rows = kl.short_conv_partial_rows(batch, length, pieces)
    weight = weight.float().reshape(width, vectors, 8)
    bias = bias.float().reshape(vectors, 8)
    forward = kl.ShortConvLaunch(kcfg.ShortConvConfig(dtype, width), view(x), view(halo), weight, bias, positions,
                                 torch.empty_like(view(x)), pieces)
    partials = torch.empty(rows, width + 1, vectors, 8, device=x.device)
    backward = kl.ShortConvBackwardLaunch(kcfg.ShortConvBackwardConfig(dtype, width), view(x), view(halo), weight,
                                          bias, positions, view(dy), torch.empty_like(view(x)),
                                          torch.empty_like(view(halo)), partials, pieces)
    column_sum = kl.ColumnSumLaunch(kcfg.ColumnSumConfig(), partials.view(rows, -1, 4),
                                    torch.empty((width + 1) * channels // 4, 4, device=x.device))
    return forward, backward, column_sum


def conv_case(width: int, pieces: int, batch: int, lengths: list[int], channels: int, with_bias: bool, seed: int = 0,
              device="cpu"):
    """bf16 inputs; the halo of piece p > 0 holds the real tokens before it (what CP sends), piece 0's is
    random (a left neighbour's tokens): positions decide whether they are read."""
    generator = torch.Generator().manual_seed(seed)
    length = sum(lengths)
    x = torch.randn(batch, length, channels, generator=generator).bfloat16()
    halo = torch.randn(batch, pieces, width - 1, channels, generator=generator).bfloat16()
    piece = length // pieces
    for p in range(1, pieces):
        halo[:, p] = x[:, p * piece - (width - 1):p * piece]
    weight = torch.randn(width, channels, generator=generator) / 2
    bias = torch.randn(channels, generator=generator) / 4 if with_bias else torch.zeros(channels)
    dy = torch.randn(batch, length, channels, generator=generator).bfloat16()
    return [t.to(device) for t in (x, halo, weight, bias, document_positions(lengths), dy)]


CONV_CASES = [
    pytest.param(4, 1, 1, [5, 140, 1, 1, 153], 48, True, id="W4-one-piece-length-1-docs"),
    pytest.param(4, 2, 2, [3, 200, 97], 64, True, id="W4-two-pieces-batch-2"),
    pytest.param(3, 2, 1, [150, 150], 16, False, id="W3-doc-starts-at-piece-no-bias"),
    pytest.param(2, 1, 2, [1, 2, 257], 24, True, id="W2-run-boundaries"),
]


@pytest.mark.parametrize("width,pieces,batch,lengths,channels,with_bias", CONV_CASES)
def test_short_conv_emulation_matches_the_definition(width, pieces, batch, lengths, channels, with_bias):
    x, halo, weight, bias, positions, dy = conv_case(width, pieces, batch, lengths, channels, with_bias)
    forward, backward, column_sum = conv_launches(x, halo, weight, bias, positions, dy)
    for launch in (forward, backward, column_sum):
        run_emulated(launch)

    xd, halod = x.double().requires_grad_(), halo.double().requires_grad_()
    weightd, biasd = weight.double().requires_grad_(), bias.double().requires_grad_()
    want = reference_conv(xd, halod, weightd, biasd, positions)
    want.backward(dy.double())
    y = forward.y.reshape(want.shape).double()
    # y is rounded to bf16 once: within half an ulp of bf16 (2^-9 relative) plus float32 noise
    assert torch.allclose(y, want, rtol=2 ** -8, atol=1e-6), (y - want).abs().max()
    assert torch.allclose(backward.dx.reshape(x.shape).double(), xd.grad, rtol=2 ** -8, atol=1e-5)
    halo_grad = halod.grad if halod.grad is not None else torch.zeros_like(halod)  # None: no token read it
    assert torch.allclose(backward.dhalo.reshape(halo.shape).double(), halo_grad, rtol=2 ** -8, atol=1e-5)
    sums = column_sum.sums.reshape(width + 1, channels).double()
    assert torch.allclose(sums[:width], weightd.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(sums[width], biasd.grad, rtol=1e-5, atol=1e-4)
    if pieces == 1:  # token 0 is at position 0: the halo is never read
        assert halod.grad is None and float(backward.dhalo.abs().max()) == 0.0


def test_short_conv_partial_rows_cover_every_run_of_every_piece():
    runs = -(-1000 // kcfg.SHORT_CONV_BACKWARD_TOKENS)
    assert kl.short_conv_partial_rows(2, 2000, 2) == 2 * 2 * runs
    assert kl.short_conv_partial_rows(1, kcfg.SHORT_CONV_BACKWARD_TOKENS, 1) == 1


def reference_gated_norm(x, gate, weight, eps):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight * torch.nn.functional.silu(gate)


def norm_launches(x, gate, weight, dout, eps, dtype="bfloat16"):
    dim = x.shape[-1]
    vectors, rows = dim // 8, x.numel() // dim
    view = lambda t: t.reshape(-1, vectors, 8)  # noqa: E731
    blocks = kl.gated_rms_norm_partial_rows(rows)
    weight = weight.float().reshape(vectors, 8)
    forward = kl.GatedRMSNormLaunch(kcfg.GatedRMSNormConfig(dtype, dim), view(x), view(gate), weight,
                                    torch.empty_like(view(x)), eps)
    partials = torch.empty(blocks, vectors, 8, device=x.device)
    backward = kl.GatedRMSNormBackwardLaunch(kcfg.GatedRMSNormBackwardConfig(dtype, dim), view(x), view(gate), weight,
                                             view(dout), torch.empty_like(view(x)), torch.empty_like(view(x)),
                                             partials, eps)
    column_sum = kl.ColumnSumLaunch(kcfg.ColumnSumConfig(), partials.view(blocks, -1, 4),
                                    torch.empty(dim // 4, 4, device=x.device))
    return forward, backward, column_sum


def norm_case(rows: int, dim: int, seed: int = 0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    x, gate, dout = (torch.randn(rows, dim, generator=generator).bfloat16() for _ in range(3))
    weight = 1 + torch.randn(dim, generator=generator) / 4
    return [t.to(device) for t in (x, gate, weight, dout)]


@pytest.mark.parametrize("rows,dim", [(5, 64), (kcfg.GATED_NORM_ROWS + 3, 128)])
def test_gated_rms_norm_emulation_matches_autograd(rows, dim):
    eps = 1e-5
    x, gate, weight, dout = norm_case(rows, dim)
    launches = norm_launches(x, gate, weight, dout, eps)
    for launch in launches:
        run_emulated(launch)
    forward, backward, column_sum = launches
    xd, gated, weightd = (t.double().requires_grad_() for t in (x, gate, weight))
    want = reference_gated_norm(xd, gated, weightd, eps)
    want.backward(dout.double())
    assert torch.allclose(forward.out.reshape(rows, dim).double(), want, rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(backward.dx.reshape(rows, dim).double(), xd.grad, rtol=2 ** -8, atol=1e-5)
    assert torch.allclose(backward.dgate.reshape(rows, dim).double(), gated.grad, rtol=2 ** -8, atol=1e-5)
    assert torch.allclose(column_sum.sums.reshape(dim).double(), weightd.grad, rtol=1e-5, atol=1e-4)


def test_gated_norm_configs_refuse_unsupported_rows_and_dtypes():
    with pytest.raises(ValueError, match="dim must be one of"):
        kcfg.GatedRMSNormConfig("bfloat16", 96).validate()
    with pytest.raises(ValueError, match="width must be one of"):
        kcfg.ShortConvConfig("bfloat16", 5).validate()
    with pytest.raises(ValueError, match="dtype must be one of"):
        kcfg.ShortConvBackwardConfig("float32", 4).validate()


def _kernels_match_emulation(make_launches, outputs: tuple[str, ...]) -> None:
    for name, (got, rerun, want) in run_three_ways(make_launches, outputs).items():
        assert torch.equal(got, rerun), f"{name} differs between two runs"
        scale = float(want.float().abs().max()) or 1.0
        # bf16 outputs: one rounding apart at most (fast exp, fused multiply-adds); float32 sums: 1e-5
        limit = 2 ** -7 if got.dtype == torch.bfloat16 else 1e-5
        assert float((got.float() - want.float()).abs().max()) <= limit * scale, name


@pytest.mark.gpu
@pytest.mark.parametrize("width,pieces,batch,lengths,channels,with_bias",
                         CONV_CASES + [pytest.param(4, 2, 1, [1, 700, 3000, 5], 2056, True, id="W4-wide-partial-cta")])
def test_short_conv_kernels_match_emulation_on_gpu(width, pieces, batch, lengths, channels, with_bias):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    tensors = conv_case(width, pieces, batch, lengths, channels, with_bias, device="cuda")
    _kernels_match_emulation(lambda: conv_launches(*tensors), ("0.y", "1.dx", "1.dhalo", "2.sums"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim", [(5, 64), (kcfg.GATED_NORM_ROWS + 3, 128), (70000, 128)])
def test_gated_rms_norm_kernels_match_emulation_on_gpu(rows, dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x, gate, weight, dout = norm_case(rows, dim, device="cuda")
    _kernels_match_emulation(lambda: norm_launches(x, gate, weight, dout, 1e-5), ("0.out", "1.dx", "1.dgate", "2.sums"))
