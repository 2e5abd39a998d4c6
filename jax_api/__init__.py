"""JAX frontend of cp_linear: jax.shard_map collectives, custom_vjp and Flax NNX modules.

Public functions take *global* arrays sharded along T over a mesh axis; ``*_shard`` variants run
inside a caller's own ``shard_map``. Names resolve lazily.
"""

from __future__ import annotations

from cp_linear._lazy import lazy_exports

_EXPORTS = {
    "GDPInputs": "cp_linear.gdp",
    "GDPInputGradients": "cp_linear.gdp",
    "JaxGDPBackend": "jax_api.gdp.chunk",
    "CuTeDSLGatedDeltaProductCPBackend": "jax_api.gdp.cutedsl",
    "gated_delta_product": "jax_api.gdp.ops",
    "gdp_chunkwise_context_parallel": "jax_api.gdp.cp",
    "gdp_chunkwise_context_parallel_shard": "jax_api.gdp.cp",
    "blockdiag_attention": "jax_api.attention.blockdiag",
    "blockdiag_attention_shard": "jax_api.attention.blockdiag",
    "plan_blockdiag_exchange": "jax_api.attention.blockdiag",
    "GatedDeltaProduct": "jax_api.layers",
    "BlockDiagAttention": "jax_api.layers",
    "HybridDecoder": "jax_api.layers",
    "DecoderConfig": "jax_api.layers",
    "build_layout": "jax_api.layers",
    "cp_apply": "jax_api.layers",
    "load_state_table": "jax_api.layers",
    "state_table": "jax_api.layers",
    "load_torch_state_dict": "jax_api.layers",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("jax_api", _EXPORTS, globals())
