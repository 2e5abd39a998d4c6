"""torch_api._poison.poison (8-byte word selection) against the plain where of cp_linear.validation."""

import pytest
import torch

from cp_linear.validation import poison as poison_by_where
from torch_api import _poison
from torch_api._poison import poison


def _case(dtype, shape=(2, 37, 3, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    x[0, 1, 2, 5] = float("inf")
    x[-1, 0, 0, 0] = -0.0
    mask = torch.rand(shape[:-1] + (1,), generator=gen) < 0.3
    return x, mask


def _bits(x):
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_word_selection_is_bitwise_the_plain_where(dtype):
    x, mask = _case(dtype)
    assert _poison._word_selectable(x, mask)
    assert torch.equal(_bits(poison(x, mask)), _bits(poison_by_where(x, mask)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_is_the_plain_where_gradient(dtype):
    x, mask = _case(dtype, seed=1)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    fast, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    poison(fast, mask).backward(grad)
    poison_by_where(plain, mask).backward(grad)
    assert torch.equal(_bits(fast.grad), _bits(plain.grad))
    assert fast.grad[mask.expand_as(x)].eq(0).all() and not fast.grad[~mask.expand_as(x)].eq(0).all()


@pytest.mark.parametrize("layout", ["odd row bytes", "strided", "full mask", "offset view"])
def test_other_layouts_fall_back_to_the_plain_where(layout):
    x, mask = _case(torch.bfloat16, shape=(2, 9, 3, 6) if layout == "odd row bytes" else (2, 9, 3, 64))
    if layout == "strided":
        x = x.transpose(1, 2)
        mask = mask.transpose(1, 2)
    elif layout == "full mask":
        mask = mask.expand_as(x)
    elif layout == "offset view":
        x = x.flatten()[1:1 + x.numel() // 2].view(9, 3, 64)[:8]
        mask = mask.flatten()[:8 * 3].view(8, 3, 1)
    assert not _poison._word_selectable(x, mask)
    assert torch.equal(_bits(poison(x, mask)), _bits(poison_by_where(x, mask)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_word_selection_on_the_gpu_is_bitwise_the_plain_where(dtype):
    x, mask = (t.cuda() for t in _case(dtype, shape=(1, 4096, 16, 128)))
    grad = torch.randn(x.shape, device="cuda").to(dtype)
    fast, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_fast, out_plain = poison(fast, mask), poison_by_where(plain, mask)
    out_fast.backward(grad)
    out_plain.backward(grad)
    assert torch.equal(_bits(out_fast), _bits(out_plain)) and torch.equal(_bits(fast.grad), _bits(plain.grad))
