"""Flax NNX layers: ``GatedDeltaProduct``, ``BlockDiagAttention``, ``HybridDecoder``, weight conversion.

Same parameter names and shapes as ``torch_api.layers`` (one table: ``cp_linear.model_config``).
Under CP the modules run inside ``jax.shard_map`` (``axis_name``) with a replicated ``TokenLayout``;
``cp_apply`` wraps a whole model for global arrays. Names resolve lazily.
"""

from __future__ import annotations

from cp_linear._lazy import lazy_exports

_EXPORTS = {
    "AttentionConfig": "cp_linear.model_config",
    "DecoderConfig": "cp_linear.model_config",
    "GDPConfig": "cp_linear.model_config",
    "TokenLayout": "jax_api.layers.layout",
    "build_layout": "jax_api.layers.layout",
    "GatedDeltaProduct": "jax_api.layers.gdp",
    "BlockDiagAttention": "jax_api.layers.attention",
    "HybridDecoder": "jax_api.layers.model",
    "cp_apply": "jax_api.layers.model",
    "load_state_table": "jax_api.layers.convert",
    "state_table": "jax_api.layers.convert",
    "load_torch_state_dict": "jax_api.layers.convert",
    "flatten_jax_state": "jax_api.layers.convert",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("jax_api.layers", _EXPORTS, globals())
