"""The GDP layer's elementwise kernels against the torch-ops paths they replace: the short conv
(causal depthwise conv + SiLU over packed documents; ``torch_api.layers.conv.masked_causal_conv`` + SiLU)
and the gated output norm (``torch_api.layers.blocks.GatedRMSNorm``).

    python benchmarks/bench_layer_kernels.py [--out DIR] [--repeat 20] [--tokens 8192 32768]
        [--channels 2048 4096] [--pieces 1 2] [--heads 16] [--head-dim 128]

Each conv case (B = 1, documents of random lengths 1..4096, W = 4, bf16; P = 1 piece with a zero halo and
P = 2 with real halos, as zig-zag CP has) first checks the kernels on the GPU against their torch
emulation (``cp_linear.kernels.emulation``, float32) and a second run for bitwise equality, then
times the forward (one ``ShortConv`` launch) and the backward (``ShortConvBackward`` + ``ColumnSum``)
with CUDA events (median of ``--repeat``), and the torch path's forward and autograd backward.
GB/s counts the fewest bytes: forward x + y, backward x + dy + dx. Each norm case (tokens × heads rows
of head-dim values, bf16) checks the kernels against the emulation and a rerun the same way and times
forward (``GatedRMSNorm``) and backward (``GatedRMSNormBackward`` + ``ColumnSum``) against the torch
module's forward and autograd backward (bytes: forward x + gate + out, backward x + gate + dout + dx +
dgate). A third table times the decoder's RMSNorm (float32 residual rows of ``--hidden``): the module's
torch ops against ``torch.nn.functional.rms_norm``. Prints a table per kernel, writes a CSV per kernel.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

from _bench_common import time_ms
from cp_linear.kernels import configs as cfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_three_ways
from torch_api.layers.blocks import GatedRMSNorm, RMSNorm
from torch_api.layers.conv import masked_causal_conv

WIDTH = 4


def document_positions(length: int, generator: torch.Generator) -> torch.Tensor:
    """Positions within documents of random lengths 1..4096 filling ``length`` tokens."""
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(torch.randint(1, 4097, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - length
    return torch.cat([torch.arange(n) for n in lengths if n > 0]).to(torch.int32)


def conv_launches(x, halo, weight, bias, positions, dy, pieces: int):
    """(forward, backward, column sum) launches on fresh outputs."""
    vectors = x.shape[-1] // 8
    view = lambda t: t.reshape(-1, vectors, 8)  # noqa: E731
    rows = kl.short_conv_partial_rows(x.shape[0], x.shape[1], pieces)
    forward = kl.ShortConvLaunch(cfg.ShortConvConfig("bfloat16", WIDTH), view(x), view(halo), weight, bias,
                                 positions, torch.empty_like(view(x)), pieces)
    partials = torch.empty(rows, WIDTH + 1, vectors, 8, device=x.device)
    backward = kl.ShortConvBackwardLaunch(cfg.ShortConvBackwardConfig("bfloat16", WIDTH), view(x), view(halo),
                                          weight, bias, positions, view(dy), torch.empty_like(view(x)),
                                          torch.empty_like(view(halo)), partials, pieces)
    column_sum = kl.ColumnSumLaunch(cfg.ColumnSumConfig(), partials.view(rows, -1, 4),
                                    torch.empty((WIDTH + 1) * vectors * 2, 4, device=x.device))
    return forward, backward, column_sum


def check_and_time(make_launches, names: tuple[str, ...], repeat: int) -> dict:
    """Errors of the named outputs against the emulation (relative to its largest value; absolute where it
    is all zero), bitwise equality of two GPU runs (``run_three_ways``), and the medians of the forward and
    of the backward + column sum."""
    errors, bitwise = {}, True
    for name, (got, rerun, want) in run_three_ways(make_launches, names).items():
        largest = want.float().abs().max()
        difference = (got.float() - want.float()).abs().max()
        errors[f"err_{name.split('.')[1]}"] = float(difference / largest if largest > 0 else difference)
        bitwise = bitwise and torch.equal(got, rerun)
    kernel = make_launches()
    for launch in kernel:
        launch.run()
    return dict(bitwise=bitwise, **errors, forward_ms=time_ms(kernel[0].run, repeat),
                backward_ms=time_ms(lambda: (kernel[1].run(), kernel[2].run()), repeat))


def run_conv_case(tokens: int, channels: int, pieces: int, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(tokens + channels + pieces)
    device = torch.device("cuda")
    x = torch.randn(1, tokens, channels, generator=generator).to(device, torch.bfloat16)
    dy = torch.randn(1, tokens, channels, generator=generator).to(device, torch.bfloat16)
    positions = document_positions(tokens, generator).to(device)
    piece = tokens // pieces
    halo = torch.zeros(1, pieces, WIDTH - 1, channels, device=device, dtype=torch.bfloat16)
    for p in range(1, pieces):  # the tokens before piece p, as a neighbour would send them
        halo[:, p] = x[:, p * piece - (WIDTH - 1):p * piece]
    weight = (torch.randn(WIDTH, channels // 8, 8, generator=generator) / 2).to(device)
    bias = (torch.randn(channels // 8, 8, generator=generator) / 4).to(device)

    result = check_and_time(lambda: conv_launches(x, halo, weight, bias, positions, dy, pieces),
                            ("0.y", "1.dx", "1.dhalo", "2.sums"), repeat)
    forward_ms, backward_ms = result["forward_ms"], result["backward_ms"]

    # the torch path on one piece (P = 1: its window is the zero-padded input)
    window = torch.nn.functional.pad(x, (0, 0, WIDTH - 1, 0)).requires_grad_()
    taps = weight.reshape(WIDTH, channels).t().reshape(channels, 1, WIDTH).contiguous().requires_grad_()
    bias_flat = bias.reshape(channels).clone().requires_grad_()
    torch_forward = lambda: torch.nn.functional.silu(masked_causal_conv(window, taps, bias_flat, positions))  # noqa: E731
    torch_forward_ms = time_ms(lambda: torch_forward().detach(), repeat)
    out = torch_forward()
    grad = dy.float()
    torch_backward_ms = time_ms(lambda: torch.autograd.grad(out, (window, taps, bias_flat), grad, retain_graph=True),
                                repeat)
    element = 2
    return dict(tokens=tokens, channels=channels, pieces=pieces, **result,
                forward_gbs=2 * tokens * channels * element / forward_ms / 1e6,
                backward_gbs=3 * tokens * channels * element / backward_ms / 1e6,
                torch_forward_ms=torch_forward_ms, torch_backward_ms=torch_backward_ms)


def norm_launches(x, gate, weight, dout, eps: float):
    vectors = x.shape[-1] // 8
    view = lambda t: t.reshape(-1, vectors, 8)  # noqa: E731
    dim, rows = x.shape[-1], x.numel() // x.shape[-1]
    blocks = kl.gated_rms_norm_partial_rows(rows)
    forward = kl.GatedRMSNormLaunch(cfg.GatedRMSNormConfig("bfloat16", dim), view(x), view(gate), weight,
                                    torch.empty_like(view(x)), eps)
    partials = torch.empty(blocks, vectors, 8, device=x.device)
    backward = kl.GatedRMSNormBackwardLaunch(cfg.GatedRMSNormBackwardConfig("bfloat16", dim), view(x), view(gate),
                                             weight, view(dout), torch.empty_like(view(x)),
                                             torch.empty_like(view(x)), partials, eps)
    column_sum = kl.ColumnSumLaunch(cfg.ColumnSumConfig(), partials.view(blocks, -1, 4),
                                    torch.empty(dim // 4, 4, device=x.device))
    return forward, backward, column_sum


def run_norm_case(tokens: int, heads: int, dim: int, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(tokens + heads + dim)
    device, eps = torch.device("cuda"), 1e-5
    x, gate, dout = (torch.randn(tokens, heads, dim, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    weight = (1 + torch.randn(dim // 8, 8, generator=generator) / 4).to(device)
    result = check_and_time(lambda: norm_launches(x, gate, weight, dout, eps),
                            ("0.out", "1.dx", "1.dgate", "2.sums"), repeat)
    module = GatedRMSNorm(dim, eps=eps).to(device)
    module.weight.data.copy_(weight.reshape(dim))
    x_grad, gate_grad = x.clone().requires_grad_(), gate.clone().requires_grad_()
    torch_forward_ms = time_ms(lambda: module(x_grad, gate_grad).detach(), repeat)
    out = module(x_grad, gate_grad)
    torch_backward_ms = time_ms(lambda: torch.autograd.grad(out, (x_grad, gate_grad, module.weight), dout,
                                                            retain_graph=True), repeat)
    size = tokens * heads * dim * 2
    return dict(tokens=tokens, heads=heads, dim=dim, **result,
                forward_gbs=3 * size / result["forward_ms"] / 1e6, backward_gbs=5 * size / result["backward_ms"] / 1e6,
                torch_forward_ms=torch_forward_ms, torch_backward_ms=torch_backward_ms)


def run_rms_norm_case(tokens: int, hidden: int, repeat: int) -> dict:
    """The decoder's RMSNorm on the float32 residual stream: the module's torch ops against torch's
    ``F.rms_norm`` (one fused kernel each way where torch has one), forward and backward."""
    generator = torch.Generator().manual_seed(tokens + hidden)
    device = torch.device("cuda")
    x, dout = (torch.randn(tokens, hidden, generator=generator).to(device) for _ in range(2))
    module = RMSNorm(hidden).to(device)
    x_grad = x.clone().requires_grad_()
    fused = lambda: torch.nn.functional.rms_norm(x_grad, (hidden,), module.weight, module.eps)  # noqa: E731
    timings = {}
    for name, forward in (("module", lambda: module(x_grad)), ("f_rms_norm", fused)):
        timings[f"{name}_forward_ms"] = time_ms(lambda: forward().detach(), repeat)
        out = forward()
        timings[f"{name}_backward_ms"] = time_ms(
            lambda: torch.autograd.grad(out, (x_grad, module.weight), dout, retain_graph=True), repeat)
    with torch.no_grad():
        difference = float((module(x_grad) - fused()).abs().max())
    with torch.autocast("cuda", dtype=torch.bfloat16):  # what the decoder's bf16 autocast makes of it
        autocast_dtype = str(fused().dtype)
    return dict(tokens=tokens, hidden=hidden, max_difference=difference, autocast_dtype=autocast_dtype, **timings)


def write_table(rows: list[dict], path: str) -> None:
    header = list(rows[0])
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in header))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/bench_layer_kernels")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--channels", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--pieces", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048, help="the decoder's RMSNorm width (float32 rows)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_table([run_conv_case(t, c, p, args.repeat) for t in args.tokens for c in args.channels for p in args.pieces],
                os.path.join(args.out, "short_conv.csv"))
    write_table([run_norm_case(t, args.heads, args.head_dim, args.repeat) for t in args.tokens],
                os.path.join(args.out, "gated_rms_norm.csv"))
    write_table([run_rms_norm_case(t, args.hidden, args.repeat) for t in args.tokens],
                os.path.join(args.out, "rms_norm.csv"))


if __name__ == "__main__":
    main()
