"""``BlockDiagAttention`` as a Flax NNX module: GQA softmax attention with RoPE at global
in-document positions, causal within each packed document; same parameters and math as
``torch_api.layers.BlockDiagAttention``.

``__call__(hidden_states [B, L, D], *, layout=None, axis_name=None, doc_ids=None, cu_seqlens=None,
seq_idx=None) -> [B, L, D]``: one device (axis_name None: cuDNN's packed flash attention on a Hopper
GPU with bf16/fp16 activations, ``cudnn_layer_reason``; else the float32 doc-masked softmax over all T
tokens) or inside ``jax.shard_map`` (``jax_api.blockdiag_attention_shard`` with the layout's plan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_api.layers.blocks import Linear, apply_rope, rope_angles
from jax_api.layers.layout import resolve_layout
from cp_linear.model_config import AttentionConfig, REQUIRED, document_layer_signature, resolve_config
from jax_api.layers.convert import StateTableMixin


class BlockDiagAttention(StateTableMixin, nnx.Module):
    """Block-diagonal causal GQA attention; keyword arguments as ``AttentionConfig``.

    ``mode`` must match the layout's plan under CP ("auto" accepts the plan's own mode).
    """

    def __init__(self, config: AttentionConfig | None = None, *, rngs: nnx.Rngs, mode: str = "auto", **kwargs):
        self.config = config = resolve_config(AttentionConfig, config, kwargs)
        self.mode = mode
        c, d = config, config.dim_per_head
        self.q_proj = Linear(c.hidden_size, c.num_heads * d, bias=c.qkv_bias, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, c.kv_heads * d, bias=c.qkv_bias, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, c.kv_heads * d, bias=c.qkv_bias, rngs=rngs)
        self.o_proj = Linear(c.num_heads * d, c.hidden_size, rngs=rngs)

    def __call__(self, hidden_states: jax.Array, *, layout=None, axis_name: str | None = None, doc_ids=None,
                 cu_seqlens=None, seq_idx=None) -> jax.Array:
        x = hidden_states
        c, d = self.config, self.config.dim_per_head
        layout = resolve_layout(x, layout=layout, axis_name=axis_name, doc_ids=doc_ids, seq_idx=seq_idx,
                                cu_seqlens=cu_seqlens)
        if x.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have D = {c.hidden_size}; received shape {tuple(x.shape)}")
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, c.num_heads, d)
        k = self.k_proj(x).reshape(batch, length, c.kv_heads, d)
        v = self.v_proj(x).reshape(batch, length, c.kv_heads, d)
        cos, sin = rope_angles(layout.local(layout.position, axis_name), d, c.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if axis_name is not None:
            from jax_api.attention.blockdiag import blockdiag_attention_shard

            o = blockdiag_attention_shard(q, k, v, plan=layout.attention_plan, axis_name=axis_name, mode=self.mode,
                                          layout=layout.shard_layout, max_runs=layout.max_attention_runs)
        elif cudnn_layer_reason(q, k, layout) is None:
            from jax_api.attention.cudnn import cudnn_document_attention

            o = cudnn_document_attention(q, k, v, layout.doc_ids, max_runs=layout.max_attention_runs, scale=d**-0.5)
        else:
            from jax_api.attention.blockdiag import masked_attention

            keys, values = jnp.moveaxis(k, 1, 0), jnp.moveaxis(v, 1, 0)  # [T, B, Hkv, D]
            positions = jnp.arange(length, dtype=jnp.int32)
            o = masked_attention(q, keys, values, positions, layout.doc_ids, query_start=0,
                                 scale=d**-0.5).astype(q.dtype)
        return self.o_proj(o.reshape(batch, length, c.num_heads * d))


def cudnn_layer_reason(q, k, layout) -> str | None:
    """Why the one-device layer runs the float32 masked softmax rather than cuDNN's packed attention
    (None: cuDNN, ``jax_api.attention.cudnn``): its platform and input rules (every ``TokenLayout``
    bounds the packing's runs)."""
    from jax_api.attention.cudnn import cudnn_attention_reason

    return cudnn_attention_reason(q, k)


# help() and inspect.signature list every keyword argument (a metaclass hides __init__ from them)
document_layer_signature(BlockDiagAttention, AttentionConfig, rngs=REQUIRED, mode="auto")

__all__ = ["BlockDiagAttention", "cudnn_layer_reason"]
