"""CuTeDSL Gated DeltaProduct forward kernels for Hopper (sm_90a), on tensor cores.

Kernels (one module each, a kernel class per module; ``docs/kernels.md`` has the design):
  chunk_prep     per chunk (parallel): T = (I + A)^-1 scaled two ways, the output mixer P and
                 the decay scalars; k k^T and q k^T on mma.sync
  chunk_scan     per segment: the chunk-to-chunk recurrence with the transposed state in
                 registers, all products on mma.sync; mode "summary" builds [E^T ; M^T],
                 mode "output" writes outputs and end states
  segment_fold   float32 fold of segment summaries into each segment's incoming state
  value_checks   the inputs' value checks (NaN/Inf, g > 0, beta range) in one launch: int32 flags
  token_checks   the containment's per-token flags and sanitised input copies in one pass

``configs`` holds one frozen config dataclass per kernel (the compile-cache key); ``launch``
the typed launches (from which compile-time arguments are derived) and the device work layout;
``cache`` compiles on first use, or loads a prebuilt library; ``emulation`` runs the same
launches in torch (the kernels' CPU oracle). Nothing here imports cutlass until a kernel is
compiled, so ``import cp_linear.kernels`` needs neither a GPU nor the DSL.
``python -m cp_linear.kernels --compile --arch sm_90a`` compiles every kernel without a GPU.
"""

from cp_linear.kernels.configs import (
    ChunkPrepConfig,
    ChunkScanConfig,
    SegmentFoldConfig,
    all_configs,
    describe,
)

__all__ = [
    "ChunkPrepConfig",
    "ChunkScanConfig",
    "SegmentFoldConfig",
    "all_configs",
    "describe",
]
