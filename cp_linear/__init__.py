"""cp_linear: context parallelism for hybrid linear-attention models on packed sequences.

The core is framework-neutral (no torch or jax import here): CP plans, the affine summary
algebra, the backend protocol and float64 references. Frontends live in ``torch_api`` and
``jax_api``; CuTeDSL kernels in ``cp_linear.kernels``.
"""

from cp_linear.plan import (
    EXCHANGE_MODES,
    MODE_CHOICES,
    BlockDiagPlan,
    ExchangeRouting,
    ExchangeShape,
    PackedSequenceCPMetadata,
    SequenceStateRouting,
    build_blockdiag_plan,
    build_packed_sequence_cp_metadata,
    exchange_bytes,
    exchange_routing,
    exchange_shape,
    exchange_tokens_received,
    needed_kv_a2a_splits,
    resolve_exchange_mode,
    sequence_state_routing,
    widest_exchange_shape,
)
from cp_linear.protocol import CPForwardResult, CPSavedContext, LinearAttentionCPBackend
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPBackwardUnpackedSummary,
    CPForwardPackedSummary,
    CPForwardUnpackedSummary,
    combine,
    compose_backward,
    compose_forward,
    inclusive_scan,
    pack,
    unpack,
    validate_packed_summary,
)

__version__ = "0.1.0"

__all__ = [
    "EXCHANGE_MODES",
    "MODE_CHOICES",
    "BlockDiagPlan",
    "CPBackwardPackedSummary",
    "CPBackwardUnpackedSummary",
    "CPForwardPackedSummary",
    "CPForwardResult",
    "CPForwardUnpackedSummary",
    "CPSavedContext",
    "ExchangeRouting",
    "ExchangeShape",
    "LinearAttentionCPBackend",
    "PackedSequenceCPMetadata",
    "SequenceStateRouting",
    "build_blockdiag_plan",
    "build_packed_sequence_cp_metadata",
    "sequence_state_routing",
    "combine",
    "compose_backward",
    "compose_forward",
    "exchange_bytes",
    "exchange_routing",
    "exchange_shape",
    "exchange_tokens_received",
    "inclusive_scan",
    "needed_kv_a2a_splits",
    "pack",
    "resolve_exchange_mode",
    "unpack",
    "validate_packed_summary",
    "widest_exchange_shape",
]
