"""``BlockDiagAttention``: GQA softmax attention with RoPE, causal within each packed document.

Parameter names follow flash-linear-attention's ``fla/layers/attn.py`` (q_proj, k_proj, v_proj,
o_proj; no qk-norm, no window). RoPE uses the rotate-half convention and each token's *global*
position within its document (global index minus the document start, from the replicated ids),
so a document that straddles ranks gets the same angles as on one device::

    doc_ids   1 1 1 2 2 | 2 2 2 3 3     (cp 2, L = 5)
    position  0 1 2 0 1 | 2 3 4 0 1     rank 1's first tokens continue document 2 at positions 2, 3, 4

Under CP the attention itself is ``torch_api.blockdiag_attention`` (K/V exchange per the plan);
on one device it is the same doc-masked kernel over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_api.layers.blocks import Linear, apply_rope, rope_angles
from cp_linear.model_config import AttentionConfig, config_fingerprint, document_layer_signature, resolve_config
from cp_linear.validation import digest
from torch_api.layers.convert import StateTableMixin
from torch_api.layers.layout import compiling, resolve_layout


class BlockDiagAttention(StateTableMixin, nn.Module):
    """Block-diagonal causal GQA attention; keyword arguments as ``AttentionConfig``.

    ``forward(hidden_states [B, L, D], *, doc_ids=None, cu_seqlens=None, seq_idx=None,
    cp_group=None, layout=None) -> [B, L, D]``. ``doc_ids`` int [T] (0 = padding: those rows
    output 0), ``seq_idx`` [1, T] or ``cu_seqlens`` [N + 1] (no padding) describe the global packed
    sequence (replicated under CP); none of them: each batch row is one causal document.
    ``mode`` picks the CP exchange ("auto", "allgather", "halo", "a2a"); ``kernel`` the local
    attention kernel ("auto", "sdpa", "flex", "varlen"), both as in ``torch_api.blockdiag_attention``;
    ``check_inputs`` NaN/Inf in q/k/v is a ValueError (False: contained, docs/failure_modes.md).
    Under CP the layer's own agreement rides in the attention op's header (one per call); a call a
    ``HybridDecoder`` agreement covered, with ``check_inputs=False``, sends none and runs the
    ``cp_linear::blockdiag_attention`` custom op, which ``torch.compile(fullgraph=True)`` traces.
    """

    AGREEMENT = "BlockDiagAttention inputs"

    def __init__(self, config: AttentionConfig | None = None, *, mode: str = "auto", kernel: str = "auto",
                 check_inputs: bool = True, **kwargs):
        super().__init__()
        self.config = config = resolve_config(AttentionConfig, config, kwargs)
        self.mode = mode
        self.kernel = kernel
        self.check_inputs = check_inputs
        c, d = config, config.dim_per_head
        self.q_proj = Linear(c.hidden_size, c.num_heads * d, bias=c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, c.kv_heads * d, bias=c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, c.kv_heads * d, bias=c.qkv_bias)
        self.o_proj = Linear(c.num_heads * d, c.hidden_size, bias=False)

    def cp_signature(self) -> tuple[int, ...]:
        """Configuration, options and grad requirement: what the ranks must share."""
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        return (*config_fingerprint(self.config), digest([self.mode, self.kernel]), int(bool(self.check_inputs)),
                int(needs_grad))

    def forward(self, hidden_states: torch.Tensor, *, doc_ids=None, cu_seqlens=None, seq_idx=None, cp_group=None,
                layout=None) -> torch.Tensor:
        c, d = self.config, self.config.dim_per_head
        layout = resolve_layout(hidden_states, layout=layout, cp_group=cp_group, doc_ids=doc_ids,
                                seq_idx=seq_idx, cu_seqlens=cu_seqlens)
        error = layout.hidden_error(hidden_states, c.hidden_size)
        # under torch.compile no header runs (the batch agreed eagerly, ``HybridDecoder.agree``)
        compiled = compiling()
        signature = layout.signature(hidden_states, self.cp_signature()) if layout.is_cp and not compiled else ()
        covered = layout.is_cp and (compiled or layout.covers(signature, self.AGREEMENT))
        if error or layout.packed.error or not layout.is_cp or covered:
            # a failing rank sends its header now; the others meet it in the attention op's header
            # below, which carries the same site name and this layer's signature
            layout.agree(error, signature, self.AGREEMENT)

        x = hidden_states
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, c.num_heads, d)
        k = self.k_proj(x).view(batch, length, c.kv_heads, d)
        v = self.v_proj(x).view(batch, length, c.kv_heads, d)
        cos, sin = rope_angles(layout.positions(x.device), d, c.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if layout.static_shapes:
            o = self._static_attention(q, k, v, layout, signature, covered)
        elif layout.is_cp:
            from torch_api.attention.blockdiag import attend, run_blockdiag_op
            from torch_api.attention.kernel import resolve_kernel

            if covered and not self.check_inputs:
                # no header: the routing and the kernel come from replicated ids and the same
                # hardware, so their errors are the same on every rank
                routing = layout.attention_routing(self.mode)
                kernel, error = resolve_kernel(self.kernel, q.device, d, True, q.dtype)
                if routing.error or error:
                    raise ValueError(f"{self.AGREEMENT}: {routing.error or error}")
                o = run_blockdiag_op(q, k, v, routing, scale=None, kernel=kernel, contain=True)
            else:
                o = attend(q, k, v, layout.attention_routing(self.mode), cp_group=layout.group, mode=self.mode,
                           kernel=self.kernel, check_inputs=self.check_inputs, extra_signature=signature,
                           what=self.AGREEMENT, agreed=covered, layout=layout.shard_layout)
        else:
            from torch_api.attention.kernel import doc_causal_attention, resolve_kernel
            from torch_api.attention.blockdiag import QKV_CHECKS
            from torch_api.gdp.validation import PendingValueChecks, nonfinite_flags

            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            kernel, error = resolve_kernel(self.kernel, q.device, d, needs_grad, q.dtype)
            if error:
                raise ValueError(f"BlockDiagAttention: {error}")
            # one device: the checks are read once the attention is queued (no collective can hang)
            pending = PendingValueChecks(QKV_CHECKS, nonfinite_flags(q, k, v), "BlockDiagAttention") \
                if self.check_inputs else None
            o = doc_causal_attention(q, k, v, layout.attention_layout(), kernel=kernel,
                                     contain=not self.check_inputs)
            if pending is not None:
                pending.raise_if_failed()
        return self.o_proj(o.reshape(batch, length, c.num_heads * d))

    def _static_attention(self, q, k, v, layout, signature, covered: bool):
        """A graph-ready layout's attention (``torch_api.attention.static``: ids as a device tensor, K/V
        all-gathered). Under CP a call that a model agreement covered, with checks off, sends no header
        and reads nothing on the host; otherwise one header carries the kernel choice and the value flags."""
        from torch_api._dist import agree_or_raise
        from torch_api.attention.blockdiag import QKV_CHECKS
        from torch_api.attention.kernel import KERNELS, resolve_kernel
        from torch_api.attention.static import run_static_attention
        from torch_api.gdp.validation import PendingValueChecks, nonfinite_flags

        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        # no dtype: "auto" keeps to sdpa / flex here (the varlen kernel's offsets are built on the host)
        kernel, error = resolve_kernel(self.kernel, q.device, q.shape[-1], needs_grad)
        if error is None and kernel not in STATIC_KERNELS:
            error = f"a graph-ready layout (max_sequences) runs kernel 'sdpa' or 'flex'; received {self.kernel!r}"
        if error is None and self.mode not in STATIC_MODES:
            error = (f"a graph-ready layout (max_sequences) exchanges K/V with an all-gather; mode={self.mode!r} "
                     f"is not one of {STATIC_MODES}")
        if layout.is_cp and not compiling() and (not covered or self.check_inputs or error):
            flags = nonfinite_flags(q, k, v) if self.check_inputs and error is None else None
            kernel_id = KERNELS.index(kernel) if kernel in KERNELS else -1
            agree_or_raise(layout.group, error, [*signature, kernel_id], what=self.AGREEMENT, value_flags=flags,
                           value_checks=QKV_CHECKS)
        elif error:
            raise ValueError(f"{self.AGREEMENT}: {error}")
        pending = None
        if not layout.is_cp and self.check_inputs:  # read once the attention is queued
            pending = PendingValueChecks(QKV_CHECKS, nonfinite_flags(q, k, v), "BlockDiagAttention")
        o = run_static_attention(q, k, v, layout, kernel=kernel, contain=not self.check_inputs)
        if pending is not None:
            pending.raise_if_failed()
        return o


STATIC_MODES = ("auto", "allgather")  # what a graph-ready layout runs (torch_api.attention.static)
STATIC_KERNELS = ("sdpa", "flex")


# help() and inspect.signature list every keyword argument (a metaclass hides __init__ from them)
document_layer_signature(BlockDiagAttention, AttentionConfig, mode="auto", kernel="auto", check_inputs=True)

__all__ = ["BlockDiagAttention"]
