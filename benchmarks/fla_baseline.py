"""flash-linear-attention (FLA) as the benchmarks' baseline: its Hopper guard switched off for timing,
and our hybrid decoder rebuilt on FLA's GatedDeltaProduct layer (bench_train.py's "fla-1gpu").

FLA#640 guard. FLA's gated backward (``chunk_bwd_dqkwg`` in ``fla/ops/common/chunk_o.py``) raises on
Hopper with Triton in [3.4, 3.7.1): those Tritons miscompile one of its block widths, so some of its
gradients (dk, dg) come out wrong there. The GPU machines run Triton 3.6, and the benchmarks still want
FLA's backward as a *time* reference: the work is the same, and no benchmark uses those gradients.
The guard reads the module flag ``IS_NVIDIA_HOPPER`` at call time, so clearing that flag lets the
backward run (the flag's import-time uses, such as the autotune warp lists, keep their Hopper values).
bench_gdp_train.py (the GDP op alone), bench_train.py (the model) and cp_gdp_nccl.py (FLA's CP) call
``bypass_fla_hopper_guard``.

FLA's context parallelism (FLA 0.6, ``fla.ops.cp``): ``fla_cp_context`` builds a rank's
``FLACPContext`` from the GLOBAL cu_seqlens and the process group (contiguous layout: rank r holds
tokens [r*L, (r+1)*L), as ours), and ``fla_cp_context_mismatches`` compares it with our
``PackedSequenceCPMetadata`` of the same rank. ``chunk_gated_delta_product(..., cp_context=context)``
then takes the rank's local tensors (q [1, L, H, K], k / v [1, L*n_h, H, K], g [1, L, H], beta
[1, L*n_h, H]) and reads the local cu_seqlens from the context.

The FLA decoder (``fla_decoder``): our ``HybridDecoder`` with its mixers swapped, the rest (embedding,
RMSNorms, SwiGLU MLPs, head, initialisation) our modules as they are::

    GDP layers        FLA's fla.layers.GatedDeltaProduct, loaded with our layer's weights
                      (FLAGatedDeltaProduct: FLA's varlen cu_seqlens from the FlexLayout)
    attention layers  our BlockDiagAttention's projections and RoPE, then torch's compiled
                      flex_attention under a document-causal BlockMask (FlexDocAttention)

It is called like ours, ``model(input_ids [1, T], layout=FlexLayout(shard_layout, device))``, on one
device (no CP). FLA's layer runs Triton kernels only, so the decoder builds on the CPU but runs on a
GPU; the attention alone also runs (forward) on the CPU, eagerly.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn as nn

from cp_linear.model_config import DecoderConfig
from torch_api.layers.blocks import apply_rope, rope_angles
from torch_api.layers.model import HybridDecoder


def bypass_fla_hopper_guard() -> bool:
    """Switch FLA#640's guard off (imports FLA). Returns True when it would have fired on this machine
    (Hopper and a Triton it refuses): FLA's gradients are then timing only, not to be trusted."""
    import fla.ops.common.chunk_o as chunk_o

    hopper = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False))
    refused_triton = getattr(chunk_o, "TRITON_ABOVE_3_4_0", True) and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    if hasattr(chunk_o, "IS_NVIDIA_HOPPER"):
        chunk_o.IS_NVIDIA_HOPPER = False
    return hopper and bool(refused_triton)


def fla_available() -> str | None:
    """None when FLA's CP GDP imports (``fla.ops.cp``, ``fla.ops.gated_delta_product``), else why not."""
    try:
        import fla.ops.cp  # noqa: F401
        import fla.ops.gated_delta_product  # noqa: F401
    except Exception as err:  # ImportError, or FLA failing at import (no Triton)
        return f"{type(err).__name__}: {err}"
    return None


def fla_cp_context(cu_seqlens: torch.Tensor, group):
    """FLA's ``FLACPContext`` for this rank of ``group`` (contiguous layout) from the GLOBAL document
    boundaries ``cu_seqlens`` int [N + 1], the same on every rank (FLA derives the local view)."""
    from fla.ops.cp import build_cp_context

    return build_cp_context(cu_seqlens.long(), group=group)


def fla_cp_context_mismatches(context, meta) -> list[str]:
    """Where FLA's context disagrees with our ``PackedSequenceCPMetadata`` of the same rank; [] when both
    give the rank the same documents and the same document spans over ranks. FLA's fields in ours::

        cu_seqlens (local)          local_cu_seqlens
        pre_num_ranks               cp_rank - preceding_rank_start
        post_num_ranks              following_rank_stop - 1 - cp_rank
        is_first_rank, is_last_rank starts_new_sequence, ends_sequence
        pre_num_conv_tokens         tokens of the rank's first document on earlier ranks
    """
    ids = np.asarray(meta.global_seq_idx).reshape(-1)
    first_token = meta.cp_rank * meta.local_len
    first_document_start = int(np.count_nonzero(ids < meta.local_seq_idx[0, 0]))
    expected = dict(
        layout="contiguous",
        cu_seqlens=np.asarray(meta.local_cu_seqlens).tolist(),
        pre_num_ranks=meta.cp_rank - meta.preceding_rank_start,
        post_num_ranks=meta.following_rank_stop - 1 - meta.cp_rank,
        is_first_rank=meta.starts_new_sequence,
        is_last_rank=meta.ends_sequence,
        pre_num_conv_tokens=first_token - first_document_start,
    )
    received = dict(
        layout=context.layout,
        cu_seqlens=context.cu_seqlens.tolist() if context.cu_seqlens is not None else None,
        pre_num_ranks=context.pre_num_ranks,
        post_num_ranks=context.post_num_ranks,
        is_first_rank=context.is_first_rank,
        is_last_rank=context.is_last_rank,
        pre_num_conv_tokens=context.pre_num_conv_tokens,
    )
    return [f"{name}: FLA {received[name]} vs ours {want}" for name, want in expected.items()
            if received[name] != want]


class FlexLayout:
    """What the baseline's mixers read, built once per batch from our one-device ``ShardLayout`` (so the
    documents, cu_seqlens and RoPE positions are ours exactly):

    cu_seqlens  int64 [N + 1]: document boundaries, FLA's varlen form (a LongTensor)
    positions   int64 [T]: each token's position within its document (RoPE)
    block_mask  flex_attention's BlockMask of ``doc(q) == doc(k) and k <= q``

    ``HybridDecoder`` takes it as its ``layout``: on one device the decoder itself reads only
    ``is_cp`` and hands the layout on to every mixer.
    """

    is_cp = False

    def __init__(self, layout, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        docs = layout.doc_ids_tensor(device)  # int32 [T]

        def document_causal(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

        total = docs.shape[0]
        # compiled, create_block_mask never materialises the [T, T] mask (flex_attention's docs); eager on the CPU
        build = torch.compile(create_block_mask) if device.type == "cuda" else create_block_mask
        self.block_mask = build(document_causal, None, None, total, total, device=device)
        self.cu_seqlens = layout.cu_seqlens(device).long()
        self.positions = layout.positions(device)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # as flex_attention's docs require: compiled, it runs as fused kernels (eager is a slow reference)
    return torch.compile(flex_attention)


class FlexDocAttention(nn.Module):
    """The baseline's attention: the projections and RoPE of one of our ``BlockDiagAttention`` layers
    (its modules, so its weights), then flex_attention (compiled on a GPU, eager on the CPU) under the
    layout's document-causal BlockMask, GQA in the kernel. No CP, no value checks or containment.
    ``forward(hidden_states [1, T, D], *, layout: FlexLayout) -> [1, T, D]``."""

    def __init__(self, ours: nn.Module):
        super().__init__()
        self.config = ours.config
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = ours.q_proj, ours.k_proj, ours.v_proj, ours.o_proj

    def forward(self, hidden_states: torch.Tensor, *, layout: FlexLayout) -> torch.Tensor:
        c, d = self.config, self.config.dim_per_head
        batch, length, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, length, c.num_heads, d)
        k = self.k_proj(hidden_states).view(batch, length, c.kv_heads, d)
        v = self.v_proj(hidden_states).view(batch, length, c.kv_heads, d)
        cos, sin = rope_angles(layout.positions, d, c.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if hidden_states.is_cuda:
            attend = _compiled_flex_attention()
        else:
            from torch.nn.attention.flex_attention import flex_attention as attend
        # flex_attention takes [B, H, T, D]; its default scale is head_dim ** -0.5, as ours
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=layout.block_mask,
                   enable_gqa=c.kv_heads != c.num_heads)
        return self.o_proj(o.transpose(1, 2).reshape(batch, length, c.num_heads * d))


class FLAGatedDeltaProduct(nn.Module):
    """FLA's ``GatedDeltaProduct`` layer as a ``HybridBlock`` mixer: it reads the layout's cu_seqlens
    and returns the output alone (FLA returns ``(o, None, cache)``).
    ``forward(hidden_states [1, T, D], *, layout: FlexLayout) -> [1, T, D]``."""

    def __init__(self, fla_layer: nn.Module):
        super().__init__()
        self.fla = fla_layer

    def forward(self, hidden_states: torch.Tensor, *, layout: FlexLayout) -> torch.Tensor:
        out, _, _ = self.fla(hidden_states, cu_seqlens=layout.cu_seqlens)
        return out


def fla_decoder(config: DecoderConfig, *, compute_dtype=None) -> HybridDecoder:
    """``HybridDecoder(config, compute_dtype=)`` (so the same initial weights and residual stream as ours for
    the same torch seed and dtype) with FLA's GatedDeltaProduct for every GDP mixer and ``FlexDocAttention``
    for every attention mixer; on the CPU (move it with ``.to``). FLA's layer takes a bf16 stream under
    autocast (its own linears cast nothing). Imports FLA (``fla.layers`` also needs ``transformers``)."""
    from fla.layers import GatedDeltaProduct

    model = HybridDecoder(config, compute_dtype=compute_dtype)
    gdp = config.gdp_config()
    for block in model.layers:
        if block.kind != "gdp":
            block.attn = FlexDocAttention(block.attn)
            continue
        # Our GDPConfig is FLA's argument list (cp_linear.model_config), so each option configures FLA's
        # layer as ours: the n_h keys / values per token and expand_v; the output gate (g_proj, then
        # RMSNorm(o) * silu(g_proj x)); the causal depthwise short conv with SiLU on q, k and v (width
        # conv_size, no bias; neither crosses a document start); the forget gate
        # (g = -exp(A_log) softplus(a_proj x + dt_bias)); beta = 2 sigmoid(b_proj x) (allow_neg_eigval);
        # q / k l2-normalised in the kernel (FLA's layer always does, ours too). The differences are in
        # how, not what: FLA's Triton kernels (GDP and conv) against our CuTeDSL kernels and torch conv,
        # and no value containment in FLA (ours sanitises non-finite values when its checks are off).
        fla_layer = GatedDeltaProduct(
            hidden_size=gdp.hidden_size, head_dim=gdp.head_dim, num_heads=gdp.num_heads,
            num_v_heads=gdp.num_v_heads, expand_v=gdp.expand_v, num_householder=gdp.num_householder,
            use_output_gate=gdp.use_output_gate, use_short_conv=gdp.use_short_conv, conv_size=gdp.conv_size,
            conv_bias=gdp.conv_bias, use_forget_gate=gdp.use_forget_gate, allow_neg_eigval=gdp.allow_neg_eigval,
            norm_eps=gdp.norm_eps, mode="chunk")
        # FLA's names and shapes are ours: strict, this raises if the two configurations differ anywhere
        fla_layer.load_state_dict(block.attn.state_dict())
        block.attn = FLAGatedDeltaProduct(fla_layer)
    return model


__all__ = ["FLAGatedDeltaProduct", "FlexDocAttention", "FlexLayout", "bypass_fla_hopper_guard", "fla_available",
           "fla_cp_context", "fla_cp_context_mismatches", "fla_decoder"]
