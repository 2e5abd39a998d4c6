"""torch layers: ``GatedDeltaProduct``, ``BlockDiagAttention``, ``HybridDecoder`` and weight conversion.

Names resolve lazily: ``torch_api.layers.config`` and ``torch_api.layers.packing`` import neither
torch nor jax, and ``jax_api.layers`` imports them for the shared parameter table and host layout.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AttentionConfig": "torch_api.layers.config",
    "DecoderConfig": "torch_api.layers.config",
    "GDPConfig": "torch_api.layers.config",
    "parameter_shapes": "torch_api.layers.config",
    "PackedLayout": "torch_api.layers.packing",
    "ShardLayout": "torch_api.layers.layout",
    "build_shard_layout": "torch_api.layers.layout",
    "GatedDeltaProduct": "torch_api.layers.gdp",
    "BlockDiagAttention": "torch_api.layers.attention",
    "HybridDecoder": "torch_api.layers.model",
    "load_jax_state": "torch_api.layers.convert",
    "torch_state_arrays": "torch_api.layers.convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'torch_api.layers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
