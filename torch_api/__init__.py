"""PyTorch frontend of cp_linear: torch.distributed collectives, autograd and nn.Modules.

Names resolve lazily so that ``import torch_api`` stays cheap and optional pieces (the CuTeDSL
backend needs nvidia-cutlass-dsl and a GPU) only load when used.
"""

from __future__ import annotations

from cp_linear._lazy import lazy_exports

_EXPORTS = {
    "GDPInputs": "torch_api.gdp.types",
    "GDPInputGradients": "torch_api.gdp.types",
    "TorchGDPBackend": "torch_api.gdp.chunk",
    "chunkwise_cp_forward": "torch_api.gdp.cp",
    "chunkwise_cp_backward": "torch_api.gdp.cp",
    "gdp_chunkwise_context_parallel": "torch_api.gdp.cp",
    "gated_delta_product": "torch_api.gdp.ops",
    "CuTeDSLGatedDeltaProductCPBackend": "torch_api.gdp.cutedsl",
    "blockdiag_attention": "torch_api.attention.blockdiag",
    "prepare_blockdiag": "torch_api.attention.blockdiag",
    "GatedDeltaProduct": "torch_api.layers",
    "BlockDiagAttention": "torch_api.layers",
    "HybridDecoder": "torch_api.layers",
    "DecoderConfig": "torch_api.layers",
    "build_shard_layout": "torch_api.layers",
    "load_state_table": "torch_api.layers",
    "state_table": "torch_api.layers",
    "load_jax_state": "torch_api.layers",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torch_api", _EXPORTS, globals())
