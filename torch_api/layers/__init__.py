"""torch layers: ``GatedDeltaProduct``, ``BlockDiagAttention``, ``HybridDecoder`` and weight conversion.

Names resolve lazily: ``cp_linear.model_config``, ``cp_linear.packing`` and ``cp_linear.weights``
import neither torch nor jax; ``jax_api.layers`` uses the same parameter table, host layout and
weight tables (``state_table`` / ``load_state_table`` convert weights both ways through them).
"""

from __future__ import annotations

from cp_linear._lazy import lazy_exports

_EXPORTS = {
    "AttentionConfig": "cp_linear.model_config",
    "DecoderConfig": "cp_linear.model_config",
    "GDPConfig": "cp_linear.model_config",
    "parameter_shapes": "cp_linear.model_config",
    "PackedLayout": "cp_linear.packing",
    "ShardLayout": "torch_api.layers.layout",
    "build_shard_layout": "torch_api.layers.layout",
    "GatedDeltaProduct": "torch_api.layers.gdp",
    "BlockDiagAttention": "torch_api.layers.attention",
    "HybridDecoder": "torch_api.layers.model",
    "load_state_table": "torch_api.layers.convert",
    "state_table": "torch_api.layers.convert",
    "load_jax_state": "torch_api.layers.convert",
    "torch_state_arrays": "torch_api.layers.convert",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torch_api.layers", _EXPORTS, globals())
