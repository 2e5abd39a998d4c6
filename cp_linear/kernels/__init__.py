"""CuTeDSL Gated DeltaProduct forward kernels for Hopper (sm_90a).

Kernels (one module each, a kernel class per module, float32 state and arithmetic):
  chunk_index   per-sequence chunk offsets and the chunk -> sequence table, from cu_seqlens
  wy_prepare    per-chunk UT transform: w, u and the cumulative gates
  state_pass    the chunk-to-chunk state recurrence (forward states, or transition products)
  output        per-chunk outputs on each token's last step
  affine_fold   ascending fold of affine maps (incoming CP state; product of run transitions)

``configs`` holds one frozen config dataclass per kernel (the compile-cache key); ``cache``
compiles on first use with symbolic T / N / H and keeps the compiled function for the
process. Nothing here imports cutlass until a kernel is compiled, so ``import cp_linear`` and
``import cp_linear.kernels`` need neither a GPU nor the DSL. ``python -m cp_linear.kernels
--compile --arch sm_90a`` compiles every kernel without a GPU.
"""

from cp_linear.kernels.configs import (
    AffineFoldConfig,
    ChunkIndexConfig,
    OutputConfig,
    StatePassConfig,
    WYPrepareConfig,
    all_forward_configs,
    describe,
)

__all__ = [
    "AffineFoldConfig",
    "ChunkIndexConfig",
    "OutputConfig",
    "StatePassConfig",
    "WYPrepareConfig",
    "all_forward_configs",
    "describe",
]
