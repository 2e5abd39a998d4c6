"""Framework-neutral launch plan of the tensor-core GDP forward.

Two halves, both free of torch and jax imports:

* **Typed launches.** One dataclass per kernel (``ChunkPrepLaunch``, ``ChunkScanLaunch``,
  ``SegmentFoldLaunch``) whose fields are the kernel's arguments in order, each with a spec
  (dtype and shape, symbolic where the extent varies at run time). The compile-time fake
  arguments are derived from the same specs (``fake_arguments``), so the launch site and the
  compiled signature cannot drift apart; ``run()`` calls the compiled kernel with the fields.
  A frontend passes its own arrays (torch tensors, or XLA buffers through its bridge).

* **The work layout** (``forward_layout``): chunk and segment tables computed on the device from
  ``cu_seqlens`` with array-API operations (any namespace: torch, jax, numpy) and fixed-size
  bounds from host-known shapes, so a new packing never recompiles and never synchronises.

    sequence n:  tokens [cu[n], cu[n+1]);  chunks of ``tokens_per_chunk`` whole tokens
    chunk c:     first_step, steps (0 for c >= the real chunk count)
    segment s:   ``segment_chunks`` consecutive chunks of one sequence (the last may be shorter);
                 flags bit 0 = build its [E | M] summary (every segment but a sequence's last,
                 and every segment of ``summary_sequence`` for the CP summary), bit 1 = only its
                 value rows E are needed (``values_only_from``); grad flags bit 0 =
                 build its backward summary, bit 1 = the forward summarised it (its transition
                 rows come from the forward: ChunkGamma writes only the gamma rows)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from cp_linear.chunking import bounds_after_first
from cp_linear.kernels import configs as cfg

SUMMARY_FLAG = cfg.SUMMARY_FLAG  # forward_layout writes flag words as int32 bools: this must stay bit 0
FORWARD_TRANSITION_FLAG = cfg.FORWARD_TRANSITION_FLAG
VALUES_ONLY_FLAG = cfg.VALUES_ONLY_FLAG
# SegmentFoldLaunch.write_final: which sequences write their final rows (the trailing ones: the last
# sequence with segments and the empty ones after it, whose index may be data; the leading one: 0)
FINAL_NONE, FINAL_EVERY, FINAL_TRAILING, FINAL_LEADING = 0, 1, 2, 3
# SegmentFoldLaunch.add_mode: which sequences add ``addend`` to their start rows (every one: addend[n];
# the trailing one: addend[0], and only it runs)
ADD_NONE, ADD_EVERY, ADD_TRAILING = 0, 1, 2


@dataclass(frozen=True)
class TensorSpec:
    """dtype: "input" (the config's dtype), "float32", "int32" or "uint8"; shape entries: an int, a config
    attribute name (static), or None (symbolic); align: the base alignment in bytes the kernel
    relies on (16 for tensors it copies with 16-byte vectors; None: one element)."""

    dtype: str
    shape: tuple
    align: int | None = None


@dataclass(frozen=True)
class ScalarSpec:
    dtype: str  # "float32" or "int32"


def _spec(*shape, dtype="input", align=None) -> Any:
    return field(metadata={"spec": TensorSpec(dtype, tuple(shape), align)})


def _scalar(dtype: str) -> Any:
    return field(metadata={"spec": ScalarSpec(dtype)})


_ARGUMENT_NAMES: dict[type, tuple[str, ...]] = {}  # argument names of each launch class, in order


class _Launch:
    """Base of the typed launches: fields after ``config`` are the kernel's arguments in order.

    ``OUTPUTS`` names the tensors the kernel writes (torch passes them preallocated; JAX receives
    them as the results of the custom call). Every kernel takes its inputs first, then its
    outputs, then its scalars (``argument_roles``)."""

    config: Any
    KERNEL: ClassVar[str]
    OUTPUTS: ClassVar[tuple[str, ...]]

    @classmethod
    def argument_specs(cls) -> list[tuple[str, Any]]:
        return [(f.name, f.metadata["spec"]) for f in fields(cls) if "spec" in f.metadata]

    @classmethod
    def argument_roles(cls) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(input tensors, output tensors, scalars) in argument order; raises unless the kernel's
        arguments come in that order (what a custom call's operands, results, attributes need)."""
        specs = cls.argument_specs()
        roles = ["scalar" if isinstance(spec, ScalarSpec) else "output" if name in cls.OUTPUTS else "input"
                 for name, spec in specs]
        order = {"input": 0, "output": 1, "scalar": 2}
        if [order[r] for r in roles] != sorted(order[r] for r in roles) or set(cls.OUTPUTS) - {n for n, _ in specs}:
            raise TypeError(f"{cls.__name__}: arguments must be inputs, then OUTPUTS {cls.OUTPUTS}, then scalars")
        return tuple(tuple(n for (n, _), r in zip(specs, roles) if r == role) for role in ("input", "output", "scalar"))

    def arguments(self) -> tuple:
        names = _ARGUMENT_NAMES.get(type(self))
        if names is None:  # dataclasses.fields on every launch cost ~15 us of host time per kernel
            names = _ARGUMENT_NAMES[type(self)] = tuple(name for name, _ in self.argument_specs())
        return tuple(getattr(self, name) for name in names)

    def run(self) -> None:
        from cp_linear.kernels.cache import compiled

        compiled(self.config)(*self.arguments())


@dataclass
class ChunkPrepLaunch(_Launch):
    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_prep:ChunkPrepKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("ta", "tb", "p", "scalars")
    config: cfg.ChunkPrepConfig
    q: Any = _spec(None, None, "key_dim", align=16)
    k: Any = _spec(None, None, "key_dim", align=16)
    g: Any = _spec(None, None, dtype="float32")
    beta: Any = _spec(None, None, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    num_chunks: Any = _spec(1, dtype="int32")
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    ta: Any = _spec(None, None, 64, 64, align=16)
    tb: Any = _spec(None, None, 64, 64, align=16)
    p: Any = _spec(None, None, "query_tile", 64)
    scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    scale: Any = _scalar("float32")
    use_l2: Any = _scalar("int32")
    num_householder: Any = _scalar("int32")


@dataclass
class ChunkScanLaunch(_Launch):
    """``state_out`` is [N, H, K, V] in modes "output" and "output_states" (each sequence's final state,
    written by its last segment: an empty sequence's row is not written), [S, H, V + K, K] (summaries)
    in "summary"; mode "summary" does not read q, p, state_in or seq_first_segment. Modes "states" and
    "output_states" write each chunk's start state into ``chunk_states`` [C_max, H, V·K] (the
    [C_max, H, V, K] chunk states, flattened so that one spec serves every V and K); mode "states"
    does not read q or p nor write ``state_out``. An output a mode does not write may be any array
    of the right type and trailing extent (a one-row placeholder)."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_scan:ChunkScanKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("state_out", "o", "chunk_states")
    config: cfg.ChunkScanConfig
    k: Any = _spec(None, None, "key_dim", align=16)
    v: Any = _spec(None, None, "value_dim", align=16)
    q: Any = _spec(None, None, "key_dim", align=16)
    ta: Any = _spec(None, None, 64, 64, align=16)
    tb: Any = _spec(None, None, 64, 64, align=16)
    p: Any = _spec(None, None, "query_tile", 64, align=16)
    scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    seg_first_chunk: Any = _spec(None, dtype="int32")
    seg_chunks: Any = _spec(None, dtype="int32")
    seg_order: Any = _spec(None, dtype="int32")  # grid slot -> segment (forward_layout: longest first)
    seg_flags: Any = _spec(None, dtype="int32")
    num_segments: Any = _spec(1, dtype="int32")
    seq_first_segment: Any = _spec(None, dtype="int32")
    state_in: Any = _spec(None, None, "value_dim", "key_dim", dtype="float32")
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    state_out: Any = _spec(None, None, "state_rows", "state_cols", dtype="float32")
    o: Any = _spec(None, None, "value_dim", align=16)  # written by 16-byte rows
    chunk_states: Any = _spec(None, None, "chunk_state_size", align=16)  # written by 16-byte rows
    num_householder: Any = _scalar("int32")
    clear_unsummarised: Any = _scalar("int32")  # mode "summary": zero rows for the segments not summarised


@dataclass
class SegmentFoldLaunch(_Launch):
    """Mode "fold": the sequential fold (all fields). Mode "apply_affine": ``summaries`` holds the
    fold's per-segment prefix maps (its ``incoming`` at R = V + K), ``init`` the start rows of the
    sequences below ``init_count``; writes ``incoming`` [S_max, H, V, K] and reads no other scalar
    (``addend`` is not read, ``final`` not written: pass any array of the right type)."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.segment_fold:SegmentFoldKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("incoming", "final")
    config: cfg.SegmentFoldConfig
    summaries: Any = _spec(None, None, None, "key_dim", dtype="float32", align=16)
    seq_first_segment: Any = _spec(None, dtype="int32")
    init: Any = _spec(None, None, None, "key_dim", dtype="float32", align=16)  # apply_affine copies it by 16 B
    addend: Any = _spec(None, None, "key_dim", None, dtype="float32")  # [A, H, K, R]: read only with add_mode
    incoming: Any = _spec(None, None, None, "key_dim", dtype="float32")
    final: Any = _spec(None, None, None, "key_dim", dtype="float32")
    init_count: Any = _scalar("int32")
    value_rows: Any = _scalar("int32")
    identity_row: Any = _scalar("int32")
    transition_count: Any = _scalar("int32")  # rows >= value_rows folded only for n < it (or final rows)
    add_mode: Any = _scalar("int32")  # ADD_NONE, ADD_EVERY or ADD_TRAILING (segment_fold's doc)
    write_final: Any = _scalar("int32")  # FINAL_NONE, _EVERY, _TRAILING or _LEADING (segment_fold's doc)
    descending: Any = _scalar("int32")  # fold each sequence's segments last to first (the backward)


@dataclass
class ChunkGammaLaunch(_Launch):
    """Backward segment summaries into ``summaries`` [S, H, V + K, K] for segments flagged in ``seg_flags``
    (bit 0); for those that also carry ``FORWARD_TRANSITION_FLAG`` the K transition rows are the forward
    summary's transposed, copied from ``forward_summaries`` [S, H, V + K, K] (the forward scan's rows, kept
    in its saved buffer) instead of scanned."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_reverse:ChunkGammaKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("summaries",)
    config: cfg.ChunkGammaConfig
    k: Any = _spec(None, None, "key_dim", align=16)
    q: Any = _spec(None, None, "key_dim", align=16)
    do: Any = _spec(None, None, "value_dim", align=16)
    ta: Any = _spec(None, None, 64, 64, align=16)
    p: Any = _spec(None, None, "query_tile", 64, align=16)
    scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    seg_first_chunk: Any = _spec(None, dtype="int32")
    seg_chunks: Any = _spec(None, dtype="int32")
    seg_order: Any = _spec(None, dtype="int32")  # grid slot -> segment (forward_layout: longest first)
    seg_flags: Any = _spec(None, dtype="int32")
    num_segments: Any = _spec(1, dtype="int32")
    forward_summaries: Any = _spec(None, None, "gamma_rows", "key_dim", dtype="float32", align=16)
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    summaries: Any = _spec(None, None, "gamma_rows", "key_dim", dtype="float32")
    num_householder: Any = _scalar("int32")


@dataclass
class ChunkReverseScanLaunch(_Launch):
    """The state-gradient pass of every segment from ``grad_out``: ``chunk_grads`` [C_max, H, V, K]
    gets the gradient at each chunk's end (input dtype), ``grad_in`` each segment's incoming gradient."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_reverse:ChunkReverseScanKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("chunk_grads", "grad_in")
    config: cfg.ChunkReverseScanConfig
    k: Any = _spec(None, None, "key_dim", align=16)
    q: Any = _spec(None, None, "key_dim", align=16)
    do: Any = _spec(None, None, "value_dim", align=16)
    ta: Any = _spec(None, None, 64, 64, align=16)
    p: Any = _spec(None, None, "query_tile", 64, align=16)
    scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    seg_first_chunk: Any = _spec(None, dtype="int32")
    seg_chunks: Any = _spec(None, dtype="int32")
    seg_order: Any = _spec(None, dtype="int32")  # grid slot -> segment (forward_layout: longest first)
    num_segments: Any = _spec(1, dtype="int32")
    grad_out: Any = _spec(None, None, "value_dim", "key_dim", dtype="float32")
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    chunk_grads: Any = _spec(None, None, "value_dim", "key_dim", align=16)  # written as 16-byte rows
    grad_in: Any = _spec(None, None, "value_dim", "key_dim", dtype="float32")
    num_householder: Any = _scalar("int32")


@dataclass
class ChunkReverseLaunch(_Launch):
    """The chunk-parallel rest of the backward scan, from each chunk's start state ``chunk_states``
    (``chunk_scan`` mode "states") and end gradient ``chunk_grads`` (``ChunkReverseScanLaunch``);
    writes the per-step / per-chunk gradients of chunks below ``num_chunks``.

    d_scalars rows: 0 db, 1 dc, 2 dd (column 0), 3 unused."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_reverse:ChunkReverseKernel"
    KERNEL_WGMMA: ClassVar[str] = "cp_linear.kernels.chunk_reverse_wgmma:ChunkReverseWgmmaKernel"  # config.mma
    OUTPUTS: ClassVar[tuple[str, ...]] = ("dv", "dq_scan", "dk_scan", "d_ta", "d_tb", "d_p", "d_scalars")
    config: cfg.ChunkReverseConfig
    k: Any = _spec(None, None, "key_dim", align=16)
    v: Any = _spec(None, None, "value_dim", align=16)
    q: Any = _spec(None, None, "key_dim", align=16)
    do: Any = _spec(None, None, "value_dim", align=16)
    ta: Any = _spec(None, None, 64, 64, align=16)
    tb: Any = _spec(None, None, 64, 64, align=16)
    p: Any = _spec(None, None, "query_tile", 64, align=16)
    scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    num_chunks: Any = _spec(1, dtype="int32")
    chunk_states: Any = _spec(None, None, "value_dim", "key_dim", align=16)
    chunk_grads: Any = _spec(None, None, "value_dim", "key_dim", align=16)
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    # every output but d_scalars is stored as 16-byte rows (staged in shared memory)
    dv: Any = _spec(None, None, "value_dim", align=16)  # the input dtype: the final gradient, rounded once
    dq_scan: Any = _spec(None, None, "key_dim", dtype="float32", align=16)
    dk_scan: Any = _spec(None, None, "key_dim", dtype="float32", align=16)
    d_ta: Any = _spec(None, None, 64, 64, dtype="float32", align=16)
    d_tb: Any = _spec(None, None, 64, 64, dtype="float32", align=16)
    d_p: Any = _spec(None, None, "query_tile", 64, dtype="float32", align=16)
    d_scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    num_householder: Any = _scalar("int32")


@dataclass
class ChunkPrepBackwardLaunch(_Launch):
    """dq, dk, dg, dbeta from the prep outputs' gradients plus the scan's parts of dq and dk."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.chunk_prep_backward:ChunkPrepBackwardKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("dq", "dk", "dg", "dbeta")
    config: cfg.ChunkPrepBackwardConfig
    q: Any = _spec(None, None, "key_dim", align=16)
    k: Any = _spec(None, None, "key_dim", align=16)
    g: Any = _spec(None, None, dtype="float32")
    beta: Any = _spec(None, None, dtype="float32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    num_chunks: Any = _spec(1, dtype="int32")
    state_bad: Any = _spec(None, None, dtype="uint8")  # [T_all, H] token flags: read by a contained config
    read_bad: Any = _spec(None, None, dtype="uint8")
    any_flagged: Any = _spec(1, dtype="int32")  # nonzero when any token is flagged: else the flags are not read
    d_ta: Any = _spec(None, None, 64, 64, dtype="float32", align=16)  # staged in shared memory by 16-byte copies
    d_tb: Any = _spec(None, None, 64, 64, dtype="float32", align=16)
    d_p: Any = _spec(None, None, "query_tile", 64, dtype="float32", align=16)
    d_scalars: Any = _spec(None, None, 4, 64, dtype="float32")
    dq_scan: Any = _spec(None, None, "key_dim", dtype="float32")
    dk_scan: Any = _spec(None, None, "key_dim", dtype="float32")
    dq: Any = _spec(None, None, "key_dim", align=16)  # the input dtype (final gradients), stored as 16-byte rows
    dk: Any = _spec(None, None, "key_dim", align=16)
    dg: Any = _spec(None, None, dtype="float32")
    dbeta: Any = _spec(None, None, dtype="float32")
    scale: Any = _scalar("float32")
    use_l2: Any = _scalar("int32")
    num_householder: Any = _scalar("int32")


LAUNCHES = {cfg.ChunkPrepConfig: ChunkPrepLaunch, cfg.ChunkScanConfig: ChunkScanLaunch,
            cfg.SegmentFoldConfig: SegmentFoldLaunch, cfg.ChunkGammaConfig: ChunkGammaLaunch,
            cfg.ChunkReverseScanConfig: ChunkReverseScanLaunch, cfg.ChunkReverseConfig: ChunkReverseLaunch,
            cfg.ChunkPrepBackwardConfig: ChunkPrepBackwardLaunch}


def _extent(config, entry):
    if entry is None or isinstance(entry, int):
        return entry
    if entry == "query_tile" and config.query_tile == 0:  # mode "summary" reads no query tiles: any size
        return None
    if entry == "gamma_rows":
        return config.value_dim + config.key_dim
    if entry == "dim_vectors":
        return config.dim // config.vector
    if entry == "width_and_bias":
        return config.width + 1
    if entry == "chunk_state_size":
        return config.value_dim * config.key_dim
    if entry in ("state_rows", "state_cols"):  # chunk_scan's state_out: summaries [E^T ; M^T], or final states S
        summary = config.mode == "summary"
        if entry == "state_rows":
            return config.value_dim + config.key_dim if summary else config.key_dim
        return config.key_dim if summary else config.value_dim
    return getattr(config, entry)


def fake_arguments(config) -> tuple:
    """Compile-time arguments of ``config``'s kernel, derived from its launch specs (stream excluded)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from cp_linear.kernels._common import cutlass_dtype

    types = {"float32": cutlass.Float32, "int32": cutlass.Int32, "uint8": cutlass.Uint8}
    out = []
    for _, spec in LAUNCHES[type(config)].argument_specs():
        dtype = cutlass_dtype(config.dtype) if spec.dtype == "input" else types[spec.dtype]
        if isinstance(spec, ScalarSpec):
            out.append(dtype(0))
            continue
        extents = tuple(_extent(config, entry) for entry in spec.shape)
        extents = tuple(cute.sym_int() if e is None else e for e in extents)
        out.append(make_fake_compact_tensor(dtype, extents, stride_order=tuple(reversed(range(len(extents)))),
                                            assumed_align=spec.align))
    return tuple(out)


def kernel_class(config):
    import importlib

    launch = LAUNCHES[type(config)]
    # a kernel written separately for warpgroup MMAs (other kernels switch inside one class)
    path = getattr(launch, "KERNEL_WGMMA", launch.KERNEL) if getattr(config, "mma", "sync") == "wgmma" else launch.KERNEL
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------- work layout


def scan_row_block(key_dim: int, value_dim: int, num_householder: int) -> int:
    """State rows per scan CTA (``ChunkScanConfig.row_block``), as measured on an H200 at
    H = 16, K = V = 128 (benchmarks/NOTES.md): 64-row CTAs (two per SM) were faster for n_h >= 2
    (32k tokens: 1.85 vs 1.96 ms), 128-row CTAs for n_h = 1 (1.19 vs 1.24 ms)."""
    if key_dim == value_dim == 128 and num_householder >= 2:
        return 64
    return 0


def scan_mma(requested: str, dtype: str, key_dim: int, value_dim: int) -> str:
    """The scan's MMA kind (``ChunkScanConfig.mma``): ``requested`` unless it is "auto", which picks
    the warpgroup-MMA scan where it is compiled (bf16, K = V = 128), as measured on an H200 at
    H = 16, n_h = 2 (kernel time 8k: 0.543 vs 0.600 ms; 32k: 1.663 vs 1.881; 128k: 6.228 vs 7.044;
    32 x 1k: 1.221 vs 1.265), and warp ``mma.sync`` elsewhere."""
    if requested != "auto":
        return requested
    return "wgmma" if dtype == "bfloat16" and key_dim == value_dim == 128 else "sync"


def reverse_mma(requested: str, value_dim: int) -> str:
    """``ChunkReverseConfig.mma``: the two-warpgroup kernel where it is compiled (V = 128) unless
    "sync" is requested."""
    return "wgmma" if requested != "sync" and value_dim == 128 else "sync"


def gradient_rows_mma(requested: str) -> str:
    """``ChunkGammaConfig.mma`` and ``ChunkReverseScanConfig.mma``: warpgroup MMAs (compiled for every
    config) unless "sync" is requested."""
    return "sync" if requested == "sync" else "wgmma"


def fold_config(key_dim: int, sequences: int, heads: int, rows: int, sm_count: int) -> cfg.SegmentFoldConfig:
    """segment_fold (mode "fold") for ``rows`` state rows of ``sequences`` x ``heads`` chains: 16-row
    CTAs when twice as many still fit in one wave (one CTA per SM: the double-buffered M^T fills shared
    memory), so each step of a chain is spread over twice the SMs; else 32-row ones (fewer M^T copies).
    H200, 8 segments, H = 16: V rows 50 -> 36 us; V + K rows 61 us on 32-row CTAs, 75 on two waves of
    16-row ones. Same numbers either way."""
    wide, narrow = cfg.FOLD_ROWS
    narrow_ctas = sequences * heads * math.ceil(rows / narrow)
    return cfg.SegmentFoldConfig(key_dim, "fold", narrow if narrow_ctas <= sm_count else wide)


def segment_chunks_for(total_chunks_bound: int, heads: int, row_blocks: int, sm_count: int,
                       *, ctas_per_sm: float = 2, min_chunks: int = 8) -> int:
    """Chunks per segment so that the output pass has about ``ctas_per_sm`` CTAs per SM when one
    long sequence is all there is (host ints only: shapes, never data).

    The segment count is rounded down before the chunks are shared out, so that one long sequence's
    CTAs fit in whole waves: rounding the chunks per segment up instead left a short extra segment
    (32k tokens, H = 16: 8 segments of 125 chunks and one of 24), a second wave that the backward's
    one-CTA-per-SM reverse pass paid in full (ncu: 144 CTAs on 132 SMs, 1.09 waves)."""
    target = max(1, sm_count * ctas_per_sm)
    segments = max(1, int(target // (heads * row_blocks)))
    return max(min_chunks, math.ceil(total_chunks_bound / segments))


@dataclass
class ForwardLayout:
    """Device tables of one forward (arrays of the caller's namespace) and their host bounds."""

    num_householder: int
    tokens_per_chunk: int
    segment_chunks: int
    max_chunks: int
    max_segments: int
    num_sequences: int
    chunk_first_step: Any  # int32 [max_chunks]
    chunk_steps: Any  # int32 [max_chunks]
    num_chunks: Any  # int32 [1]
    seq_first_segment: Any  # int32 [N + 1]
    seq_segments: Any  # int32 [N]
    seg_first_chunk: Any  # int32 [max_segments]
    seg_chunks: Any  # int32 [max_segments]
    seg_flags: Any  # int32 [max_segments]
    num_segments: Any  # int32 [1]
    # int32 [max_segments]: backward summaries (segments after a sequence's first; bit 0), with
    # FORWARD_TRANSITION_FLAG where seg_flags has bit 0 too
    seg_grad_flags: Any = None
    # int32 [max_segments]: the segment each grid slot of a segment-parallel kernel runs, longest first
    # (whole segments in order, then each sequence's shorter last one by length, longest first; the unused
    # slots keep their index): CTAs start in slot order, so short segments fill the last wave's gaps
    seg_order: Any = None


def kernels_take(reason: str | None, *, fallback: bool, warned: set, fallback_name: str) -> bool:
    """A kernel backend's answer to ``unsupported_reason``: True when there is none; otherwise raise
    (``fallback=False``) or warn once per reason that ``fallback_name`` runs instead, and False."""
    if reason is None:
        return True
    if not fallback:
        raise ValueError(f"CuTeDSLGatedDeltaProductCPBackend: {reason}")
    if reason not in warned:
        warned.add(reason)
        warnings.warn(f"CuTeDSLGatedDeltaProductCPBackend runs {fallback_name}: {reason}", stacklevel=4)
    return False


def check_preceding_summaries(stacked_shape, summary_shape, *, rows: bool) -> None:
    """Raise unless the stacked preceding summaries [n, (B,) H, K, V + K] fit this shard's summary
    (``summary_shape`` [1 or B, H, K, V + K]). With an initial state they are folded from the leading
    sequence's S0 (``cp_linear.gdp.GDPInputs``)."""
    expected = (stacked_shape[0], *summary_shape) if rows else (stacked_shape[0], *summary_shape[1:])
    if tuple(stacked_shape) != expected:
        raise ValueError(f"preceding summaries must have shape {expected}; received {tuple(stacked_shape)}")


def check_initial_state_shape(inputs) -> None:
    """Raise unless ``inputs.initial_state`` (when given) is [N, H, K, V] (``GDPInputs.state_shape``)."""
    if inputs.initial_state is not None and tuple(inputs.initial_state.shape) != inputs.state_shape:
        raise ValueError(f"initial_state must be [N, H, K, V] = {inputs.state_shape}; received "
                         f"{tuple(inputs.initial_state.shape)}")


@dataclass
class KernelShard:
    """One shard flattened over its batch rows and its work layout: the base of the torch and JAX
    adapters' shards, which add the per-chunk prep results in their arrays."""

    inputs: Any  # cp_linear.gdp.GDPInputs
    rows: bool  # each batch row is one sequence (no cu_seqlens)
    q: Any  # [T_all, H, K]
    k: Any  # [S_all, H, K]
    v: Any  # [S_all, H, V]
    layout: ForwardLayout
    row_block: int  # ChunkScanConfig.row_block

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def key_dim(self) -> int:
        return self.q.shape[2]

    @property
    def value_dim(self) -> int:
        return self.v.shape[2]

    @property
    def query_tile(self) -> int:
        return cfg.query_tile(self.inputs.num_householder)

    @property
    def contained(self) -> bool:
        """The inputs are raw, with token flags (``GDPInputs.token_flags``): the chunk kernels' configs are
        contained (they zero the flagged rows as they load them)."""
        return self.inputs.token_flags is not None

    def token_flag_arguments(self, flags_placeholder, any_placeholder) -> dict:
        """``state_bad``, ``read_bad`` and ``any_flagged`` of a chunk kernel's launch: the token flags as [T_all, H]
        (uint8) and int32 [1], nonzero when any flag is set (a clean launch then reads none of them), or the
        placeholders (any uint8 [1, 1], any int32 [1]) when the configs are not contained (nothing reads them)."""
        if not self.contained:
            return dict(state_bad=flags_placeholder, read_bad=flags_placeholder, any_flagged=any_placeholder)
        import array_api_compat

        state_bad, read_bad = self.inputs.token_flags
        xp = array_api_compat.array_namespace(state_bad)
        any_flagged = xp.reshape(xp.astype(xp.any(state_bad != 0) | xp.any(read_bad != 0), xp.int32), (1,))
        return dict(state_bad=xp.reshape(state_bad, (-1, self.heads)), read_bad=xp.reshape(read_bad, (-1, self.heads)),
                    any_flagged=any_flagged)


@dataclass
class KernelForwardContext:
    """A kernel backend's context between ``cp_forward_prepare`` and ``cp_forward_apply`` (either
    frontend's arrays)."""

    shard: Any
    summary: Any  # [1 or B, H, K, V + K] float32
    initial: Any  # float32 [N, H, K, V] (inputs.initial_state), or None
    # [S_max, H, V + K, K] float32: each segment's prefix map [E_pre^T ; M_pre^T] from its sequence's
    # start (prepare's fold from [0 ; I]); apply turns it into the incoming states (segment_fold
    # mode "apply_affine") instead of folding a second time
    incoming_affine: Any = None


@dataclass
class KernelBackwardContext:
    """A kernel backend's context between ``cp_backward_prepare`` and ``cp_backward_apply``."""

    shard: Any
    do: Any  # [T_all, H, V] input dtype
    grad_summaries: Any  # [S_max, H, V + K, K] float32: rows [gamma ; M_b] per segment
    incoming: Any  # [S_max, H, V, K] float32: the forward's segment incoming states
    end_grads: Any  # [N, H, V, K] float32: dL/d final state of each sequence (zeros: none)
    # [S_max, H, V, K] float32: every segment's outgoing gradient from prepare's fold of ``end_grads``,
    # reused by apply unless following summaries change the trailing sequence's end gradient
    grad_out: Any = None
    chunk_states: Any = None  # [C_max, H, V, K] input dtype: the forward's chunk states, when it kept them
    # apply refolded the trailing sequence's rows of ``grad_out`` in place (packed shards, following
    # summaries): a later apply without them folds those rows again from ``end_grads``
    trailing_refolded: bool = False


# the tables of a ForwardLayout in the order the kernel backward's saved buffer (and the layout kernel's
# output buffer) keeps them
LAYOUT_TABLES = ("chunk_first_step", "chunk_steps", "num_chunks", "seq_first_segment", "seq_segments",
                 "seg_first_chunk", "seg_chunks", "seg_flags", "num_segments", "seg_grad_flags", "seg_order")


@dataclass(frozen=True)
class LayoutSizes:
    """The host bounds of a shard's layout (``forward_layout``): every table has a fixed size."""

    tokens_per_chunk: int
    segment_chunks: int
    max_chunks: int
    max_segments: int
    num_sequences: int

    def table_sizes(self) -> dict[str, int]:
        """Entries of each table, in ``LAYOUT_TABLES`` order."""
        chunks, segments, sequences = self.max_chunks, self.max_segments, self.num_sequences
        return dict(chunk_first_step=chunks, chunk_steps=chunks, num_chunks=1, seq_first_segment=sequences + 1,
                    seq_segments=sequences, seg_first_chunk=segments, seg_chunks=segments, seg_flags=segments,
                    num_segments=1, seg_grad_flags=segments, seg_order=segments)

    def layout(self, num_householder: int, tables: dict) -> ForwardLayout:
        """The ``ForwardLayout`` of these bounds over ``tables`` (arrays by ``LAYOUT_TABLES`` name)."""
        return ForwardLayout(num_householder=num_householder, tokens_per_chunk=self.tokens_per_chunk,
                             segment_chunks=self.segment_chunks, max_chunks=self.max_chunks,
                             max_segments=self.max_segments, num_sequences=self.num_sequences, **tables)


def layout_sizes(*, total_tokens: int, num_householder: int, num_sequences: int, heads: int, row_blocks: int,
                 sm_count: int, segment_chunks: int | None = None, ctas_per_sm: float = 2) -> LayoutSizes:
    """``forward_layout``'s bounds from host ints: at most T_all / tokens-per-chunk chunks plus one partial
    chunk per sequence, and as many segments of ``segment_chunks`` (sized by ``segment_chunks_for`` when
    None) plus one partial segment per sequence."""
    per_chunk = cfg.tokens_per_chunk(num_householder)
    max_chunks = max(1, total_tokens // per_chunk + num_sequences)
    if segment_chunks is None:
        segment_chunks = segment_chunks_for(max_chunks, heads, row_blocks, sm_count, ctas_per_sm=ctas_per_sm)
    max_segments = max(1, max_chunks // segment_chunks + num_sequences)
    return LayoutSizes(per_chunk, segment_chunks, max_chunks, max_segments, num_sequences)


@dataclass
class ForwardLayoutLaunch(_Launch):
    """``forward_layout``'s tables from ``cu_seqlens`` in one launch (``forward_layout`` kernel; N from 1 to
    ``LAYOUT_MAX_SEQUENCES``). Every table is written whole; ``trailing`` gets the last sequence with
    tokens (0 when none has any). ``summary_sequence``: -1 none, ``TRAILING_SEQUENCE``, or an index;
    ``grad_summary_sequence``: -1 none, or an index; the ``every_segment_*`` flags include
    ``forward_layout``'s single-sequence rules (``ForwardLayoutLaunch.of`` applies them)."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.forward_layout:ForwardLayoutKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = LAYOUT_TABLES + ("trailing",)
    config: cfg.ForwardLayoutConfig
    cu_seqlens: Any = _spec(None, dtype="int32")
    chunk_first_step: Any = _spec(None, dtype="int32")
    chunk_steps: Any = _spec(None, dtype="int32")
    num_chunks: Any = _spec(1, dtype="int32")
    seq_first_segment: Any = _spec(None, dtype="int32")
    seq_segments: Any = _spec(None, dtype="int32")
    seg_first_chunk: Any = _spec(None, dtype="int32")
    seg_chunks: Any = _spec(None, dtype="int32")
    seg_flags: Any = _spec(None, dtype="int32")
    num_segments: Any = _spec(1, dtype="int32")
    seg_grad_flags: Any = _spec(None, dtype="int32")
    seg_order: Any = _spec(None, dtype="int32")
    trailing: Any = _spec(1, dtype="int32")
    num_householder: Any = _scalar("int32")
    tokens_per_chunk: Any = _scalar("int32")
    segment_chunks: Any = _scalar("int32")
    summary_sequence: Any = _scalar("int32")
    grad_summary_sequence: Any = _scalar("int32")
    every_segment_summary: Any = _scalar("int32")
    every_segment_grad_summary: Any = _scalar("int32")
    values_only_from: Any = _scalar("int32")  # -1 none (``forward_layout``'s None)

    @staticmethod
    def takes(num_sequences: int) -> bool:
        return 1 <= num_sequences <= cfg.LAYOUT_MAX_SEQUENCES

    @classmethod
    def of(cls, cu_seqlens, tables: dict, trailing, *, num_householder: int, sizes: LayoutSizes,
           summary_sequence: int | None = None, grad_summary_sequence: int | None = None,
           every_segment_summary: bool = False, every_segment_grad_summary: bool = False,
           values_only_from: int | None = None) -> ForwardLayoutLaunch:
        """The launch writing ``tables`` (arrays by ``LAYOUT_TABLES`` name, of ``sizes.table_sizes()``) and
        ``trailing`` (int32 [1]); ``summary_sequence`` may be ``cfg.TRAILING_SEQUENCE`` (what a CP summary
        of a packed shard asks: its index is data)."""
        scalars = cls.scalars(num_householder=num_householder, sizes=sizes, summary_sequence=summary_sequence,
                              grad_summary_sequence=grad_summary_sequence,
                              every_segment_summary=every_segment_summary,
                              every_segment_grad_summary=every_segment_grad_summary, values_only_from=values_only_from)
        return cls(cfg.ForwardLayoutConfig(), cu_seqlens=cu_seqlens, **tables, trailing=trailing, **scalars)

    @staticmethod
    def scalars(*, num_householder: int, sizes: LayoutSizes, summary_sequence: int | None = None,
                grad_summary_sequence: int | None = None, every_segment_summary: bool = False,
                every_segment_grad_summary: bool = False, values_only_from: int | None = None) -> dict[str, int]:
        """The launch's scalars by name (``of``'s arguments; what a JAX custom call takes as attributes)."""
        single = sizes.num_sequences == 1  # forward_layout's rule: its summary sequence can only be sequence 0
        return dict(num_householder=num_householder, tokens_per_chunk=sizes.tokens_per_chunk,
                    segment_chunks=sizes.segment_chunks,
                    summary_sequence=-1 if summary_sequence is None else summary_sequence,
                    grad_summary_sequence=-1 if grad_summary_sequence is None else grad_summary_sequence,
                    every_segment_summary=int(every_segment_summary or (single and summary_sequence is not None)),
                    every_segment_grad_summary=int(every_segment_grad_summary
                                                   or (single and grad_summary_sequence is not None)),
                    values_only_from=-1 if values_only_from is None else values_only_from)


LAUNCHES[cfg.ForwardLayoutConfig] = ForwardLayoutLaunch


def values_only_from(*, rows: bool, cp_summary: bool, initial_states: bool) -> int | None:
    """``forward_layout``'s ``values_only_from`` for a packed forward: the first sequence that starts from
    zero rows and whose prefix maps nobody applies. With initial states every sequence's maps are applied
    to its S0 (None); the CP protocol (``cp_summary``) applies sequence 0's to the preceding ranks' state,
    so from 1; the lean one-device forward applies none (0). Rows are left alone (None)."""
    if rows or initial_states:
        return None
    return 1 if cp_summary else 0


def forward_layout(cu_seqlens, *, total_tokens: int, num_householder: int, heads: int, row_blocks: int,
                   sm_count: int, segment_chunks: int | None = None, summary_sequence: int | None = None,
                   ctas_per_sm: float = 2, grad_summary_sequence: int | None = None,
                   every_segment_summary: bool = False, every_segment_grad_summary: bool = False,
                   grad_flags: bool = True, values_only_from: int | None = None) -> ForwardLayout:
    """Chunk and segment tables from ``cu_seqlens`` (int [N + 1], on the device; any array namespace).

    ``total_tokens`` (T_all) and N = len(cu_seqlens) - 1 are host ints, so every table has a fixed
    size. ``summary_sequence``: also build summaries of every segment of that sequence (the CP
    trailing fragment), not only of segments that are followed by another one.
    ``seg_grad_flags`` marks the backward summaries: every segment after its sequence's first, and
    every segment of ``grad_summary_sequence`` (the CP leading fragment); of those, the ones the
    forward summarises (``seg_flags``) also carry ``FORWARD_TRANSITION_FLAG``.
    ``every_segment_summary`` / ``every_segment_grad_summary``: flag every real segment instead
    (rows under CP: every row continues on the next rank and leads on this one). A
    ``summary_sequence`` / ``grad_summary_sequence`` of a single sequence (N = 1; it can only be
    sequence 0) flags every segment without an array operation, and N = 1 runs no sequence search.
    ``grad_flags=False``: no ``seg_grad_flags`` (None; a forward without the kernel backward reads none).
    ``values_only_from``: the summarised first segment of every sequence n >= it also carries
    ``VALUES_ONLY_FLAG``: those sequences start from zero rows, so X M_0^T vanishes and nobody applies their
    prefix maps (the caller's promise: no initial states, and under CP not the leading sequence 0). The
    summary pass then skips the segment's transition rows (half its rows), and the fold reads them as zeros.

    Written for few array operations (each is a host dispatch, and on a GPU a launch): gathers by
    plain indexing (array_api_compat's torch ``take`` adds a negative-index ``where``), casts only
    where a dtype differs (its ``astype`` copies), no masking where a value is already zero, masks
    applied as products (``where`` with a scalar adds an operation), one clip per sequence search.
    """
    import array_api_compat

    xp = array_api_compat.array_namespace(cu_seqlens)
    n_h = num_householder
    num_sequences = int(cu_seqlens.shape[0]) - 1
    sizes = layout_sizes(total_tokens=total_tokens, num_householder=n_h, num_sequences=num_sequences, heads=heads,
                         row_blocks=row_blocks, sm_count=sm_count, segment_chunks=segment_chunks,
                         ctas_per_sm=ctas_per_sm)
    per_chunk, segment_chunks = sizes.tokens_per_chunk, sizes.segment_chunks
    max_chunks, max_segments = sizes.max_chunks, sizes.max_segments
    i32 = xp.int32
    device = array_api_compat.device(cu_seqlens)
    as32 = lambda x: x if x.dtype == i32 else xp.astype(x, i32)  # noqa: E731
    # one sequence (N = 1, a host int) owns every chunk and segment: one-element slices of its tables
    # (views) stand in for the sequence searches and the gathers, each a launch on a GPU
    single = num_sequences == 1
    cu = as32(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    seq_chunks = (lengths + (per_chunk - 1)) // per_chunk
    zero = xp.zeros(1, dtype=i32, device=device)
    if single:
        num_chunks = seq_chunks
    else:
        chunk_offsets = xp.concat([zero, xp.cumulative_sum(seq_chunks, dtype=i32)])
        num_chunks = chunk_offsets[-1:]

    # chunk c belongs to sequence chunk_seq[c] (int64 is fine for an index); chunks past the real
    # ones land on the last sequence, past its end
    chunk_ids = xp.arange(max_chunks, dtype=i32, device=device)
    if single:
        index_in_seq, seq_start, seq_length = chunk_ids, cu[:1], lengths
    else:
        chunk_seq = bounds_after_first(chunk_offsets, chunk_ids, last=num_sequences - 1)
        index_in_seq = chunk_ids - chunk_offsets[chunk_seq]
        seq_start, seq_length = cu[chunk_seq], lengths[chunk_seq]
    first_token_in_seq = index_in_seq * per_chunk
    real = chunk_ids < num_chunks
    chunk_first_step = (seq_start + first_token_in_seq) * n_h * real  # zero past the real chunks
    # zero past the real chunks without a mask: there first_token_in_seq >= the last sequence's length
    chunk_steps = xp.clip(seq_length - first_token_in_seq, 0, per_chunk) * n_h

    seq_segments = (seq_chunks + (segment_chunks - 1)) // segment_chunks
    seq_first_segment = xp.concat([zero, seq_segments if single else xp.cumulative_sum(seq_segments, dtype=i32)])
    num_segments = seq_first_segment[-1:]
    seg_ids = xp.arange(max_segments, dtype=i32, device=device)
    if single:
        seg_index, seg_seq_chunks = seg_ids, seq_chunks
    else:
        seg_seq = bounds_after_first(seq_first_segment, seg_ids, last=num_sequences - 1)
        seg_index = seg_ids - seq_first_segment[seg_seq]
        seg_seq_chunks = seq_chunks[seg_seq]
    first_chunk_in_seq = seg_index * segment_chunks
    seg_real = seg_ids < num_segments
    seg_first_chunk = (first_chunk_in_seq if single else chunk_offsets[seg_seq] + first_chunk_in_seq) * seg_real
    # chunks from the segment's first to its sequence's end: <= 0 past the real segments (they land on
    # the last sequence past its chunks), so seg_chunks is zero there without a mask, as chunk_steps
    chunks_left = seg_seq_chunks - first_chunk_in_seq
    seg_chunks = xp.clip(chunks_left, 0, segment_chunks)
    # a single-sequence shard's summary sequence can only be that sequence (0, a host int or data)
    every_segment_summary |= single and summary_sequence is not None
    every_segment_grad_summary |= single and grad_summary_sequence is not None
    if every_segment_summary:
        summarized = seg_real
    else:
        # followed by another segment of its sequence: more chunks left than one segment takes (never
        # past the real segments)
        summarized = chunks_left > segment_chunks
        if summary_sequence is not None:
            summarized = seg_real & (summarized | (seg_seq == summary_sequence))
    # a flag word with bit 0 set is the bool cast to int32 (SUMMARY_FLAG == 1)
    seg_flags = xp.astype(summarized, i32)
    values_only = None
    if values_only_from is not None:
        first_segment = seg_index == 0
        values_only = first_segment if single and values_only_from == 0 else (
            None if single else first_segment & (seg_seq >= values_only_from))
    if values_only is not None:
        seg_flags = seg_flags + xp.astype(summarized & values_only, i32) * VALUES_ONLY_FLAG
    seg_grad_flags = None
    if grad_flags:
        if every_segment_grad_summary:
            grad_summarized = seg_real
        else:
            preceded = seg_index >= 1
            if grad_summary_sequence is not None:
                preceded = preceded | (seg_seq == grad_summary_sequence)
            grad_summarized = seg_real & preceded
        # bit 0: a backward summary; FORWARD_TRANSITION_FLAG where the forward summarised it too
        seg_grad_flags = xp.astype(grad_summarized, i32) * (1 + FORWARD_TRANSITION_FLAG * xp.astype(summarized, i32))
    if single:  # whole segments, then the one shorter last segment: already longest first
        seg_order = seg_ids
    else:
        # sort key: 0 whole segments, then the shorter last ones by length (longest first), then unused slots;
        # a stable sort keeps sequence order within a key
        partial = xp.astype(seg_chunks < segment_chunks, i32)
        if num_sequences <= cfg.LAYOUT_SORT_SEQUENCES:
            key = partial * (segment_chunks - seg_chunks) + (1 - xp.astype(seg_real, i32)) * segment_chunks
        else:
            key = partial + (1 - xp.astype(seg_real, i32))
        seg_order = as32(xp.argsort(key, stable=True))
    return sizes.layout(n_h, dict(
        chunk_first_step=as32(chunk_first_step), chunk_steps=as32(chunk_steps), num_chunks=num_chunks,
        seq_first_segment=seq_first_segment, seq_segments=as32(seq_segments), seg_first_chunk=as32(seg_first_chunk),
        seg_chunks=as32(seg_chunks), seg_flags=seg_flags, num_segments=num_segments, seg_grad_flags=seg_grad_flags,
        seg_order=seg_order))



# ---------------------------------------------------------------------------------------------- value checks

VALUE_CHECKS_THREADS, VALUE_CHECKS_UNROLL = cfg.VALUE_CHECKS_THREADS, cfg.VALUE_CHECKS_UNROLL
# CTAs per SM for the largest tensor: q, k and v (about as large) each get that many, ~6 CTAs of 256
# threads per SM in all, one wave with 4 x 16 bytes in flight per thread
VALUE_CHECKS_CTAS_PER_SM = 2


@dataclass
class ValueChecksLaunch(_Launch):
    """The GDP value checks (``value_checks``) on 1-D views of the contiguous inputs: ORs 1 into the
    entries of ``flags`` (int32 [7], zero-filled by the caller; ``cp_linear.validation.GDP_VALUE_CHECKS``
    order) whose check fails. ``blocks``: CTAs per tensor (``ValueChecksLaunch.of`` picks it)."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.value_checks:ValueChecksKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("flags",)
    config: cfg.ValueChecksConfig
    q: Any = _spec(None, align=16)  # every input is read by 16-byte vectors
    k: Any = _spec(None, align=16)
    v: Any = _spec(None, align=16)
    g: Any = _spec(None, dtype="float32", align=16)
    beta: Any = _spec(None, dtype="float32", align=16)
    flags: Any = _spec(7, dtype="int32")
    blocks: Any = _scalar("int32")

    @classmethod
    def of(cls, config, q, k, v, g, beta, flags, *, sm_count: int) -> ValueChecksLaunch:
        """The launch with ``blocks`` from the sizes (host ints): enough CTAs that each thread of the
        largest tensor's CTAs takes at least one step, at most ``VALUE_CHECKS_CTAS_PER_SM`` per SM."""
        largest = max(math.prod(x.shape) * x.dtype.itemsize for x in (q, k, v, g, beta))
        step_bytes = VALUE_CHECKS_THREADS * VALUE_CHECKS_UNROLL * 16
        blocks = max(1, min(VALUE_CHECKS_CTAS_PER_SM * sm_count, -(-largest // step_bytes)))
        return cls(config, q, k, v, g, beta, flags, blocks)


LAUNCHES[cfg.ValueChecksConfig] = ValueChecksLaunch


# ---------------------------------------------------------------------------------------------- token checks


@dataclass
class TokenChecksLaunch(_Launch):
    """The containment of non-finite GDP inputs in one pass (``token_checks``), on row views of the
    contiguous [B, T, H, K] / [B, T·n_h, H, K] inputs: R = B·T·H (token, head) pairs, row r = b·T·H + t·H + h
    of q; step j of that token is row (b·T·n_h + t·n_h + j)·H + h of k and v. Writes
    ``state_bad`` / ``read_bad`` (bool as uint8 [B·T, H]; ``cp_linear.validation.gdp_bad_tokens``) and the
    inputs with NaN / ±Inf replaced by 0 (``torch.nan_to_num(x, 0.0, 0.0, 0.0)``, bit for bit) into the
    ``*_out`` tensors, shaped as their inputs."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.token_checks:TokenChecksKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("state_bad", "read_bad", "q_out", "k_out", "v_out", "g_out", "beta_out")
    config: cfg.TokenChecksConfig
    q: Any = _spec(None, "key_vectors", "vector", align=16)  # [B·T·H, K/8, 8]: read and written by 16-byte vectors
    k: Any = _spec(None, "key_vectors", "vector", align=16)  # [B·T·n_h·H, K/8, 8]
    v: Any = _spec(None, "value_vectors", "vector", align=16)  # [B·T·n_h·H, V/8, 8]
    g: Any = _spec(None, None, dtype="float32")  # [B·T, H]: gives H
    beta: Any = _spec(None, None, dtype="float32")  # [B·T·n_h, H]
    state_bad: Any = _spec(None, None, dtype="uint8")  # [B·T, H]
    read_bad: Any = _spec(None, None, dtype="uint8")
    q_out: Any = _spec(None, "key_vectors", "vector", align=16)
    k_out: Any = _spec(None, "key_vectors", "vector", align=16)
    v_out: Any = _spec(None, "value_vectors", "vector", align=16)
    g_out: Any = _spec(None, None, dtype="float32")
    beta_out: Any = _spec(None, None, dtype="float32")


LAUNCHES[cfg.TokenChecksConfig] = TokenChecksLaunch

_INT32_ELEMENTS = 2**31  # the token-checks kernel indexes its row views with int32


def token_checks_config(dtypes: tuple[str, ...], key_dim: int, value_dim: int, num_householder: int,
                        sizes: tuple[int, ...]) -> cfg.TokenChecksConfig | None:
    """The token-checks config for inputs q, k, v, g, beta of ``dtypes`` (names) and element counts
    ``sizes``, or None where the kernel does not take them: q, k, v of one tensor-core dtype with K, V in
    ``HEAD_DIMS``, float32 g and beta, n_h in ``TOKEN_CHECKS_HOUSEHOLDERS``, every input non-empty and
    indexable with int32. Host values only (both frontends, also while tracing)."""
    dtype, k_dtype, v_dtype, g_dtype, beta_dtype = dtypes
    if not dtype == k_dtype == v_dtype or dtype not in cfg.TENSOR_CORE_DTYPES:
        return None
    if (g_dtype, beta_dtype) != ("float32", "float32"):
        return None
    if key_dim not in cfg.HEAD_DIMS or value_dim not in cfg.HEAD_DIMS:
        return None
    if num_householder not in cfg.TOKEN_CHECKS_HOUSEHOLDERS or not all(0 < n < _INT32_ELEMENTS for n in sizes):
        return None
    return cfg.TokenChecksConfig(dtype, key_dim, value_dim, num_householder)


# ---------------------------------------------------------------------------------------------- short conv


@dataclass
class ShortConvLaunch(_Launch):
    """The short causal conv + SiLU of ``pieces`` equal pieces of each batch row (``short_conv``).

    Channels are viewed as [C / 8, 8] (16-byte vectors; C % 8 == 0). x, y [B·L, C/8, 8]: batch row b's
    token t at row b·L + t; piece p of a row covers tokens [p·L/P, (p + 1)·L/P) and reads the W − 1
    tokens before it from ``halo`` [B·P·(W − 1), C/8, 8] (rows (b·P + p)·(W − 1) + j, oldest first):
    zeros on one device, the previous rank's or chunk's last tokens under CP. ``positions`` int32 [L]:
    each token's index in its sequence; tap s (token t − s) is used only when s <= positions[t], so a
    sequence never reads its predecessor. weight float32 [W, C/8, 8] (tap W − 1 multiplies the current
    token), bias float32 [C/8, 8] (zeros for a conv without one)."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.short_conv:ShortConvKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("y",)
    config: cfg.ShortConvConfig
    x: Any = _spec(None, None, "vector", align=16)
    halo: Any = _spec(None, None, "vector", align=16)
    weight: Any = _spec("width", None, "vector", dtype="float32", align=16)
    bias: Any = _spec(None, "vector", dtype="float32", align=16)
    positions: Any = _spec(None, dtype="int32")
    y: Any = _spec(None, None, "vector", align=16)
    pieces: Any = _scalar("int32")


def short_conv_partial_rows(batch: int, length: int, pieces: int) -> int:
    """Rows of the backward's weight-gradient partial sums: one per run of ``SHORT_CONV_BACKWARD_TOKENS``
    tokens of a piece (runs never cross a piece)."""
    piece = length // pieces
    return batch * pieces * -(-piece // cfg.SHORT_CONV_BACKWARD_TOKENS)


@dataclass
class ShortConvBackwardLaunch(_Launch):
    """The short conv's backward, from ``dy`` (the gradient of y) and the forward's inputs (the
    pre-activation is recomputed): dx like x, ``dhalo`` like halo (every row written), and
    ``partials`` float32 [R, W + 1, C/8, 8] (R = ``short_conv_partial_rows``): row r holds run r's
    sums of the weight gradient (taps 0 .. W − 1) and of the bias gradient (row W); their column sums
    (``ColumnSumLaunch``, in row order) are the gradients."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.short_conv:ShortConvBackwardKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("dx", "dhalo", "partials")
    config: cfg.ShortConvBackwardConfig
    x: Any = _spec(None, None, "vector", align=16)
    halo: Any = _spec(None, None, "vector", align=16)
    weight: Any = _spec("width", None, "vector", dtype="float32", align=16)
    bias: Any = _spec(None, "vector", dtype="float32", align=16)
    positions: Any = _spec(None, dtype="int32")
    dy: Any = _spec(None, None, "vector", align=16)
    dx: Any = _spec(None, None, "vector", align=16)
    dhalo: Any = _spec(None, None, "vector", align=16)
    partials: Any = _spec(None, "width_and_bias", None, "vector", dtype="float32", align=16)
    pieces: Any = _scalar("int32")


@dataclass
class ColumnSumLaunch(_Launch):
    """``sums[n] = sum over r (in order) of rows[r, n]``, float32, with the N columns viewed as [N/4, 4]."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.column_sum:ColumnSumKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("sums",)
    config: cfg.ColumnSumConfig
    rows: Any = _spec(None, None, cfg.COLUMN_SUM_VECTOR, dtype="float32", align=16)
    sums: Any = _spec(None, cfg.COLUMN_SUM_VECTOR, dtype="float32", align=16)


LAUNCHES[cfg.ShortConvConfig] = ShortConvLaunch
LAUNCHES[cfg.ShortConvBackwardConfig] = ShortConvBackwardLaunch
LAUNCHES[cfg.ColumnSumConfig] = ColumnSumLaunch


# ---------------------------------------------------------------------------------------------- gated norm


def gated_rms_norm_partial_rows(rows: int) -> int:
    """Rows of the gated norm backward's weight-gradient partial sums: one per CTA of ``GATED_NORM_ROWS`` rows."""
    return -(-rows // cfg.GATED_NORM_ROWS)


@dataclass
class GatedRMSNormLaunch(_Launch):
    """``out = x · rsqrt(mean(x²) + eps) · weight · silu(gate)`` per row (``gated_rms_norm``): x, gate, out
    [R, D/8, 8] (R rows of D values), weight float32 [D/8, 8]."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.gated_rms_norm:GatedRMSNormKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("out",)
    config: cfg.GatedRMSNormConfig
    x: Any = _spec(None, "dim_vectors", "vector", align=16)
    gate: Any = _spec(None, "dim_vectors", "vector", align=16)
    weight: Any = _spec("dim_vectors", "vector", dtype="float32", align=16)
    out: Any = _spec(None, "dim_vectors", "vector", align=16)
    eps: Any = _scalar("float32")


@dataclass
class GatedRMSNormBackwardLaunch(_Launch):
    """The gated norm's backward from ``dout``: dx and dgate like x, and ``partials`` float32
    [``gated_rms_norm_partial_rows(R)``, D/8, 8] whose column sums (``ColumnSumLaunch``, in row order) are
    the weight gradient."""

    KERNEL: ClassVar[str] = "cp_linear.kernels.gated_rms_norm:GatedRMSNormBackwardKernel"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("dx", "dgate", "partials")
    config: cfg.GatedRMSNormBackwardConfig
    x: Any = _spec(None, "dim_vectors", "vector", align=16)
    gate: Any = _spec(None, "dim_vectors", "vector", align=16)
    weight: Any = _spec("dim_vectors", "vector", dtype="float32", align=16)
    dout: Any = _spec(None, "dim_vectors", "vector", align=16)
    dx: Any = _spec(None, "dim_vectors", "vector", align=16)
    dgate: Any = _spec(None, "dim_vectors", "vector", align=16)
    partials: Any = _spec(None, "dim_vectors", "vector", dtype="float32", align=16)
    eps: Any = _scalar("float32")


LAUNCHES[cfg.GatedRMSNormConfig] = GatedRMSNormLaunch
LAUNCHES[cfg.GatedRMSNormBackwardConfig] = GatedRMSNormBackwardLaunch
