"""The GDP output's gated norm on its fused kernels (``GatedRMSNorm`` over ``cp_linear::gated_rms_norm`` and
``cp_linear::gated_rms_norm_backward``); on the CPU the ops run the kernels' emulation.

* opcheck of both ops;
* the kernel path (forced) against float64 autograd of the definition and against the torch-ops path:
  outputs, dx, dgate, dweight, for D = 64 and 128 and a row count that leaves a partial CTA (on a Hopper
  GPU too, marked ``gpu``: the compiled kernels);
* the path choice: shapes, dtypes and sizes the kernels do not take keep the torch path.
"""

import contextlib

import pytest
import torch

import torch_api.layers.blocks as blocks
from cp_linear.kernels.configs import GATED_NORM_ROWS
from torch_api.layers.blocks import GatedRMSNorm, gated_norm_kernel_reason


@contextlib.contextmanager
def kernel_path():
    blocks.FORCE_GATED_NORM_KERNEL = True
    try:
        yield
    finally:
        blocks.FORCE_GATED_NORM_KERNEL = False


def case(rows: int, dim: int, dtype=torch.bfloat16, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x, gate, dout = (torch.randn(rows, 2, dim, generator=generator).to(device, dtype) for _ in range(3))
    module = GatedRMSNorm(dim, eps=1e-5).to(device)
    module.weight.data.copy_(1 + torch.randn(dim, generator=generator) / 4)
    return module, x, gate, dout


def run(module, x, gate, dout):
    x, gate = x.clone().requires_grad_(), gate.clone().requires_grad_()
    module.weight.grad = None
    out = module(x, gate)
    out.backward(dout)
    return out.detach(), x.grad, gate.grad, module.weight.grad.clone()


def float64_reference(module, x, gate, dout):
    xd, gd = x.double().requires_grad_(), gate.double().requires_grad_()
    weight = module.weight.detach().cpu().double().requires_grad_()
    out = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + module.eps) * weight * torch.nn.functional.silu(gd)
    out.backward(dout.double())
    return out.detach(), xd.grad, gd.grad, weight.grad


def check_kernel_path(rows, dim, dtype, device):
    module, x, gate, dout = case(rows, dim, dtype, device)
    with kernel_path():
        assert gated_norm_kernel_reason(x, gate) is None
        got = run(module, x, gate, dout)
    torch_path = run(module, x, gate, dout)
    want = float64_reference(module, x.cpu(), gate.cpu(), dout.cpu())
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for name, kernel, ours, exact in zip(("out", "dx", "dgate", "dweight"), got, torch_path, want):
        kernel, ours = kernel.cpu().double(), ours.cpu().double()
        # one rounding to the input dtype (dweight: float32 sums of rows) on top of float32 arithmetic
        limit = (unit if name != "dweight" else 1e-5) * float(exact.abs().max()) + 1e-6
        assert float((kernel - exact).abs().max()) <= limit, name
        assert float((ours - exact).abs().max()) <= limit, name  # the torch path meets the same bound


@pytest.mark.parametrize("rows,dim,dtype", [(7, 64, torch.bfloat16), (GATED_NORM_ROWS // 2 + 5, 128, torch.bfloat16),
                                            (9, 128, torch.float16)])
def test_gated_norm_kernel_path_matches_float64_and_torch_path(rows, dim, dtype):
    check_kernel_path(rows, dim, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim", [(7, 64), (3 * GATED_NORM_ROWS + 5, 128), (40000, 128)])
def test_gated_norm_kernels_on_gpu_match_float64_and_torch_path(rows, dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert gated_norm_kernel_reason(torch.empty(1, dim, device="cuda", dtype=torch.bfloat16),
                                    torch.empty(1, dim, device="cuda", dtype=torch.bfloat16)) is None
    check_kernel_path(rows, dim, torch.bfloat16, "cuda")


def test_gated_norm_ops_pass_opcheck():
    _, x, gate, dout = case(5, 64)
    weight = torch.rand(64) + 0.5
    leaves = [t.clone().requires_grad_() for t in (x, gate, weight)]
    torch.library.opcheck(torch.ops.cp_linear.gated_rms_norm, (*leaves, 1e-5))
    torch.library.opcheck(torch.ops.cp_linear.gated_rms_norm_backward, (dout, x, gate, weight, 1e-5))


def test_gated_norm_takes_the_kernel_path_only_for_kernel_shapes():
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    assert gated_norm_kernel_reason(x, x) is not None  # the CPU is no kernel platform
    with kernel_path():
        assert gated_norm_kernel_reason(x, x) is None
        assert "bf16 / fp16" in gated_norm_kernel_reason(x.float(), x.float())
        assert "bf16 / fp16" in gated_norm_kernel_reason(x, x.half())
        assert "rows of" in gated_norm_kernel_reason(x[:, :96], x[:, :96])
