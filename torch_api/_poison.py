"""``poison`` for torch tensors: NaN where a mask is True, by selection, in one pass over x.

The contained paths (``check_inputs=False``) poison every GDP and attention output with a
[..., 1] mask broadcast over the last axis. ``torch.where`` with a broadcast bool mask reads and
writes 2-byte elements one by one (0.20 ms for a [1, 32768, 16, 128] bf16 output on an H200, and
as much again for its gradient); selecting whole 8-byte words of a NaN pattern under the same mask
is bitwise the same result at 0.09 ms (benchmarks/NOTES.md, session 2026-12-05).
"""

from __future__ import annotations

import torch

from cp_linear.validation import poison as _poison_by_where

# a quiet NaN repeated in every lane of an 8-byte word, per element type
_NAN_WORDS = {
    torch.bfloat16: 0x7FC07FC07FC07FC0,
    torch.float16: 0x7E007E007E007E00,
    torch.float32: 0x7FC000007FC00000,
}


def _word_selectable(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether x can be viewed as 8-byte words with the mask broadcast over whole words."""
    row_bytes = x.shape[-1] * x.element_size() if x.dim() else 0
    return (x.dtype in _NAN_WORDS and x.dim() >= 1 and row_bytes % 8 == 0 and x.is_contiguous()
            and x.storage_offset() * x.element_size() % 8 == 0 and mask.dtype == torch.bool and mask.dim() == x.dim()
            and mask.shape[-1] == 1 and mask.shape[:-1] == x.shape[:-1])


def _select_words(mask: torch.Tensor, word: int, x: torch.Tensor) -> torch.Tensor:
    # the word as a Python scalar (a kernel argument): a tensor of it would be a host-to-device copy per
    # call, which CUDA graph capture refuses
    return torch.where(mask.contiguous(), word, x.view(torch.int64)).view(x.dtype)


class _PoisonWords(torch.autograd.Function):
    """where(mask, NaN, x) on 8-byte words; the gradient is where(mask, 0, grad) on words likewise
    (a dtype view has no gradient of its own, hence the Function)."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return _select_words(mask, _NAN_WORDS[x.dtype], x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        if _word_selectable(grad, mask):
            return _select_words(mask, 0, grad), None
        return torch.where(mask.contiguous(), 0.0, grad), None


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN where ``mask`` (broadcast against x) is True; bitwise ``cp_linear.validation.poison``.
    Eager only: under ``torch.compile`` Inductor fuses the plain ``where`` into its neighbours."""
    if torch.compiler.is_compiling() or not _word_selectable(x, mask):
        return _poison_by_where(x, mask)
    if torch.is_grad_enabled() and x.requires_grad:
        return _PoisonWords.apply(x, mask)
    return _select_words(mask, _NAN_WORDS[x.dtype], x)


__all__ = ["poison"]
