"""Compile-time configuration of every GDP forward kernel (no cutlass import here).

Each kernel is compiled once per config; the frozen dataclass *is* the in-process cache key
(``cp_linear.kernels.cache``), so a field cannot be forgotten in the key. Everything else —
sequence length T, the number of sequences N, the number of heads H, the Householder count
n_h, the qk l2norm switch and the scale — is a run-time argument and never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from cp_linear.chunking import CHUNK_SIZE  # steps per chunk at most (whole tokens: 64 // n_h of them); chunks start at sequence starts
HEAD_DIMS = (64, 128)  # supported K and V


def _check_head_dim(name: str, value: int) -> None:
    if value not in HEAD_DIMS:
        raise ValueError(f"{name} must be one of {HEAD_DIMS}; received {value}")


# Constants that both the kernels and the host code use live here: this module is part of the prebuilt
# library's source hash (cache._source_hash) and launch.py is not, so a changed value rebuilds the kernels.
SUMMARY_FLAG = 1  # seg_flags / seg_grad_flags bit 0: build this segment's (backward) summary
# seg_grad_flags bit 1: the forward summarised this segment too; its backward transition rows M_b are
# the forward's transition rows transposed (kept by the forward), so ChunkGamma skips them
FORWARD_TRANSITION_FLAG = 2
# seg_flags bit 1: the summary's transition rows M are not needed (the first segment of a sequence that starts
# from zero rows, whose prefix maps nobody applies): the summary pass writes them as zeros without a scan
VALUES_ONLY_FLAG = 2
VALUE_CHECKS_THREADS = 256  # threads per value-checks CTA
VALUE_CHECKS_UNROLL = 4  # 16-byte vectors a thread loads per grid-stride step, all in flight before any is tested
TOKEN_CHECKS_THREADS = 256  # threads per token-checks CTA
TOKEN_CHECKS_LANES = 8  # lanes per (token, head): they own its q row and its steps' k and v rows and beta entries
TOKEN_CHECKS_VECTOR = 8  # 16-bit values per 16-byte vector
TOKEN_CHECKS_HOUSEHOLDERS = (1, 2, 3)  # n_h of the token-checks configs (kernel_support.AUTO_HOUSEHOLDERS)

TENSOR_CORE_DTYPES = ("bfloat16", "float16")
QUERY_TILES = (32, 64)
SCAN_MODES = ("summary", "output", "states", "output_states")
OUTPUT_MODES = ("output", "output_states")  # the scan modes that read queries and write outputs
FOLD_MODES = ("fold", "apply_affine")
FOLD_ROWS = (32, 16)  # segment_fold rows per CTA: the default first
MMA_KINDS = ("sync", "wgmma")


def tokens_per_chunk(num_householder: int) -> int:
    """Whole tokens per chunk of at most 64 steps: 64, 32, 21, 16, ... for n_h = 1, 2, 3, 4, ..."""
    if not 1 <= num_householder <= CHUNK_SIZE:
        raise ValueError(f"num_householder must be in [1, {CHUNK_SIZE}]; received {num_householder}")
    return CHUNK_SIZE // num_householder


def query_tile(num_householder: int) -> int:
    """Query rows of a chunk's MMA tile (a multiple of 16 holding every token): 64 for n_h = 1, else 32."""
    return 64 if tokens_per_chunk(num_householder) > 32 else 32


def _check_tensor_core_dtype(dtype: str) -> None:
    if dtype not in TENSOR_CORE_DTYPES:
        raise ValueError(f"dtype must be one of {TENSOR_CORE_DTYPES}; received {dtype!r}")


def _check_mma(value: str) -> None:
    if value not in MMA_KINDS:
        raise ValueError(f"mma must be one of {MMA_KINDS}; received {value!r}")


def _check_query_tile(value: int) -> None:
    if value not in QUERY_TILES:
        raise ValueError(f"query_tile must be one of {QUERY_TILES}; received {value}")


@dataclass(frozen=True)
class ChunkPrepConfig:
    """Per-chunk T = (I + A)^-1 (scaled twice), P and scalars on tensor cores (``chunk_prep``).

    n_h is a run-time argument; ``query_tile`` (64 for n_h = 1, else 32) sizes P.
    """

    dtype: str
    key_dim: int
    query_tile: int
    contained: bool = False  # read raw inputs with token flags: zero flagged rows as they load (token_checks)

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_query_tile(self.query_tile)


@dataclass(frozen=True)
class ChunkScanConfig:
    """The chunk-to-chunk scan of one segment on tensor cores (``chunk_scan``).

    mode "summary": rows of [E^T ; M^T] from [0 ; I] (segment summaries; ``query_tile`` must be
    0); mode "output": the state rows from a folded incoming state, writing outputs and the
    segment's end state (``query_tile`` as for ``ChunkPrepConfig``); mode "states": the state rows
    from the incoming state, writing every chunk's start state in the input dtype and nothing else
    (the backward's recompute; reads no queries: ``query_tile`` must be 0); mode "output_states":
    "output" that also writes every chunk's start state (a forward that keeps them for the backward).
    """

    dtype: str
    key_dim: int
    value_dim: int
    mode: str
    query_tile: int = 0
    row_block: int = 0  # state rows per CTA (16 per warp); 0: 128 when K = V = 128, else 64
    mma: str = "sync"  # "sync": warp mma.sync; "wgmma": Hopper warpgroup MMA (not yet measured on a GPU)
    contained: bool = False  # read raw inputs with token flags: zero flagged rows as they load (token_checks)

    @property
    def rows_per_cta(self) -> int:
        if self.row_block:
            return self.row_block
        return 128 if self.key_dim == 128 and self.value_dim == 128 else 64

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)
        if self.mode not in SCAN_MODES:
            raise ValueError(f"mode must be one of {SCAN_MODES}; received {self.mode!r}")
        if self.mode not in OUTPUT_MODES and self.query_tile != 0:
            raise ValueError(f"mode {self.mode!r} reads no queries: query_tile must be 0; received {self.query_tile}")
        if self.mode in OUTPUT_MODES:
            _check_query_tile(self.query_tile)
        _check_mma(self.mma)
        if self.row_block not in (0, 64, 128) or self.row_block > min(self.key_dim, self.value_dim):
            raise ValueError(f"row_block must be 0 (auto), 64 or 128 and at most min(K, V); received {self.row_block}")


@dataclass(frozen=True)
class SegmentFoldConfig:
    """Float32 prefix fold of segment summaries into every segment's incoming state (``segment_fold``;
    mode "fold"), or the incoming states from the fold's per-segment prefix maps and the sequences'
    start states in one parallel step (mode "apply_affine")."""

    key_dim: int
    mode: str = "fold"
    rows: int = 32  # fold: state rows per CTA (FOLD_ROWS); apply_affine has its own tiling

    def validate(self) -> None:
        _check_head_dim("key_dim", self.key_dim)
        if self.mode not in FOLD_MODES:
            raise ValueError(f"mode must be one of {FOLD_MODES}; received {self.mode!r}")
        if self.rows not in FOLD_ROWS or (self.mode != "fold" and self.rows != FOLD_ROWS[0]):
            raise ValueError(f"rows must be one of {FOLD_ROWS} (mode 'fold' only); received {self.rows!r}")


@dataclass(frozen=True)
class ChunkGammaConfig:
    """Backward segment summaries (``chunk_reverse.ChunkGammaKernel``): the rows [gamma^T ; M_b^T] of
    dX_in = dX_out M_b + gamma from [0 ; I], chunks in reverse; gamma rows read dO, transition rows zero."""

    dtype: str
    key_dim: int
    value_dim: int
    query_tile: int
    mma: str = "sync"  # "sync": warp mma.sync; "wgmma": Hopper warpgroup MMAs (``gamma_step_wgmma``)
    contained: bool = False  # read raw inputs with token flags: zero flagged rows as they load (token_checks)

    @property
    def rows_per_cta(self) -> int:
        return 128 if self.key_dim == 128 and self.value_dim == 128 else 64

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)
        _check_query_tile(self.query_tile)
        _check_mma(self.mma)


@dataclass(frozen=True)
class ChunkReverseScanConfig:
    """The state-gradient pass of every segment (``chunk_reverse.ChunkReverseScanKernel``): the
    chunks in reverse from the segment's outgoing gradient, the gradient rows in registers, storing
    the gradient at every chunk's end (input dtype) and the segment's incoming gradient."""

    dtype: str
    key_dim: int
    value_dim: int
    query_tile: int
    row_block: int = 0  # gradient rows per CTA (16 per warp); 0: 64
    mma: str = "sync"  # as ChunkGammaConfig.mma
    contained: bool = False  # read raw inputs with token flags: zero flagged rows as they load (token_checks)

    @property
    def rows_per_cta(self) -> int:
        return self.row_block or 64

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)
        _check_query_tile(self.query_tile)
        _check_mma(self.mma)
        if self.row_block not in (0, 64, 128) or self.row_block > self.value_dim:
            raise ValueError(f"row_block must be 0 (auto), 64 or 128 and at most V; received {self.row_block}")


@dataclass(frozen=True)
class ChunkReverseConfig:
    """The chunk-parallel rest of the backward scan (``chunk_reverse.ChunkReverseKernel``): one CTA per
    (chunk, head) from the chunk's start state and end gradient (both stored by the sequential
    passes), writing dv, the scan's parts of dq and dk, and the gradients of the per-chunk prep outputs."""

    dtype: str
    key_dim: int
    value_dim: int
    query_tile: int
    mma: str = "sync"  # "sync": warp mma.sync (8 warps); "wgmma": two warpgroups (chunk_reverse_wgmma, V = 128)
    contained: bool = False  # read raw inputs with token flags: zero flagged rows as they load (token_checks)

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)
        _check_query_tile(self.query_tile)
        _check_mma(self.mma)
        if self.mma == "wgmma" and self.value_dim != 128:
            raise ValueError(f"the warpgroup-MMA ChunkReverseKernel needs value_dim 128; received {self.value_dim}")


@dataclass(frozen=True)
class ChunkPrepBackwardConfig(ChunkPrepConfig):
    """The backward of ``chunk_prep`` per chunk (``chunk_prep_backward``): dq, dk, dg, dbeta from the
    gradients of Ta, Tb, P and the scalars, plus the scan's parts of dq and dk. Fields and checks as
    ``ChunkPrepConfig``."""


@dataclass(frozen=True)
class ValueChecksConfig:
    """The GDP input value checks in one launch (``value_checks``): NaN/Inf in q, k, v (``dtype``), g
    and beta (float32), g > 0 and beta outside [0, BETA_MAX]."""

    dtype: str

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)


@dataclass(frozen=True)
class TokenChecksConfig:
    """The containment of non-finite GDP inputs in one pass (``token_checks``): per (token, head) whether a
    state input (a k or v row or beta entry of one of its n_h steps, or its g) or its q row is non-finite,
    and copies of q, k, v (``dtype``), g and beta (float32) with NaN / ±Inf replaced by 0. n_h is
    static: every row a (token, head) owns is loaded before any is tested."""

    dtype: str
    key_dim: int
    value_dim: int
    num_householder: int
    copies: bool = True  # False: the flags only (the contained GDP kernels zero the flagged rows themselves)

    @property
    def vector(self) -> int:
        return TOKEN_CHECKS_VECTOR

    @property
    def key_vectors(self) -> int:
        return self.key_dim // TOKEN_CHECKS_VECTOR

    @property
    def value_vectors(self) -> int:
        return self.value_dim // TOKEN_CHECKS_VECTOR

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)
        if self.num_householder not in TOKEN_CHECKS_HOUSEHOLDERS:
            raise ValueError(f"num_householder must be one of {TOKEN_CHECKS_HOUSEHOLDERS}; received "
                             f"{self.num_householder}")


SHORT_CONV_WIDTHS = (2, 3, 4)  # conv_size values the short-conv kernels take (FLA's default is 4)
SHORT_CONV_VECTOR = 8  # channels per thread: one 16-byte vector of 16-bit values (so C % 8 == 0)
SHORT_CONV_THREADS = 128  # threads per short-conv CTA, along the channels
SHORT_CONV_TOKENS = 64  # tokens per forward thread (a run that reuses its window in registers)
SHORT_CONV_BACKWARD_TOKENS = 128  # tokens per backward thread: one row of weight-gradient partial sums
COLUMN_SUM_THREADS = 256
COLUMN_SUM_VECTOR = 4  # float32 columns per thread (16 bytes)
COLUMN_SUM_ROW_GROUPS = 8  # threads of a column-sum CTA that split one column's rows (fixed order)


def _check_short_conv_width(width: int) -> None:
    if width not in SHORT_CONV_WIDTHS:
        raise ValueError(f"width must be one of {SHORT_CONV_WIDTHS}; received {width}")


@dataclass(frozen=True)
class ShortConvConfig:
    """Short causal depthwise convolution + SiLU over packed documents (``short_conv``, forward):
    y[t] = silu(bias + sum over taps s with s <= position[t] of w[W - 1 - s] x[t - s])."""

    dtype: str
    width: int

    @property
    def vector(self) -> int:
        return SHORT_CONV_VECTOR

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        _check_short_conv_width(self.width)


@dataclass(frozen=True)
class ShortConvBackwardConfig(ShortConvConfig):
    """The short conv's backward (``short_conv``): dx, the halo's gradient and per-block partial sums of
    the weight and bias gradients (summed by ``ColumnSumConfig``'s kernel, in a fixed order)."""


@dataclass(frozen=True)
class ColumnSumConfig:
    """Column sums of a float32 [R, N] array, each column summed over its rows in order (``short_conv``:
    the weight gradient's partial sums, deterministically)."""

    def validate(self) -> None:
        pass


GATED_NORM_DIMS = (64, 128)  # row lengths (head_v_dim) of the gated-norm kernels
GATED_NORM_THREADS = 128
# rows per CTA (multiples of the row groups times the load batch). The backward's CTAs write one row of
# weight-gradient sums each, so they take more rows (fewer sums to add); at 8k tokens x 16 heads the
# forward still gets 512 CTAs and the backward 256 (1024-row CTAs, one per SM, ran the forward 2.5x slower)
GATED_NORM_FORWARD_ROWS = 256
GATED_NORM_ROWS = 512


@dataclass(frozen=True)
class GatedRMSNormConfig:
    """The GDP output's gated RMSNorm (``gated_rms_norm``, forward): rows of ``dim`` values."""

    dtype: str
    dim: int

    @property
    def vector(self) -> int:
        return SHORT_CONV_VECTOR

    def validate(self) -> None:
        _check_tensor_core_dtype(self.dtype)
        if self.dim not in GATED_NORM_DIMS:
            raise ValueError(f"dim must be one of {GATED_NORM_DIMS}; received {self.dim}")


@dataclass(frozen=True)
class GatedRMSNormBackwardConfig(GatedRMSNormConfig):
    """The gated RMSNorm's backward: dx, dgate and one row of weight-gradient sums per CTA."""


LAYOUT_THREADS = 256
LAYOUT_MAX_SEQUENCES = 2048  # sequences per shard the layout kernel takes (its bounds live in shared memory)
LAYOUT_ENTRIES_PER_THREAD = 4  # chunk or segment table entries per thread
# seg_order sorts the sequences' shorter last segments by length up to this many sequences (each one's slot
# is a count over all of them); beyond, they keep sequence order after the whole segments
LAYOUT_SORT_SEQUENCES = 256
TRAILING_SEQUENCE = -2  # ForwardLayoutLaunch.summary_sequence: the last sequence with tokens (found in the kernel)


@dataclass(frozen=True)
class ForwardLayoutConfig:
    """The chunk and segment tables of a packed shard (``forward_layout``) from ``cu_seqlens`` in one
    launch (int32 only: no variants)."""

    def validate(self) -> None:
        pass


KERNEL_CONFIGS = (ChunkPrepConfig, ChunkScanConfig, SegmentFoldConfig, ChunkGammaConfig, ChunkReverseScanConfig,
                  ChunkReverseConfig, ChunkPrepBackwardConfig, ValueChecksConfig, TokenChecksConfig, ShortConvConfig,
                  ShortConvBackwardConfig, ColumnSumConfig, GatedRMSNormConfig, GatedRMSNormBackwardConfig,
                  ForwardLayoutConfig)


def tensor_core_configs() -> list:
    """Every config of the tensor-core forward (chunk_prep, chunk_scan, segment_fold)."""
    configs: list = []
    for key_dim in HEAD_DIMS:
        for mode in FOLD_MODES:
            configs.append(SegmentFoldConfig(key_dim, mode))
        configs.append(SegmentFoldConfig(key_dim, "fold", FOLD_ROWS[1]))
        for dtype in TENSOR_CORE_DTYPES:
            for tile in QUERY_TILES:
                configs.append(ChunkPrepConfig(dtype, key_dim, tile))
            for value_dim in HEAD_DIMS:
                for mode in ("summary", "states"):  # the modes that read no queries
                    configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode))
                    if key_dim == value_dim == 128:  # the 4-warp variant (two CTAs per SM)
                        configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode, 0, 64))
                for mode in OUTPUT_MODES:
                    for tile in QUERY_TILES:
                        configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode, tile))
                        if key_dim == value_dim == 128:
                            configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode, tile, 64))
                if key_dim == value_dim == 128 and dtype == "bfloat16":  # the warpgroup-MMA variant
                    for row_block in (0, 64):
                        for mode in ("summary", "states"):
                            configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode, 0, row_block, "wgmma"))
                        for mode in OUTPUT_MODES:
                            for tile in QUERY_TILES:
                                configs.append(ChunkScanConfig(dtype, key_dim, value_dim, mode, tile, row_block,
                                                               "wgmma"))
    return configs


def backward_configs() -> list:
    """Every config of the backward kernels (chunk_gamma, the reverse scan, chunk_reverse, chunk_prep_backward);
    the backward's chunk-state recompute is ``chunk_scan`` in mode "states" (``tensor_core_configs``)."""
    configs: list = []
    for dtype in TENSOR_CORE_DTYPES:
        for key_dim in HEAD_DIMS:
            for tile in QUERY_TILES:
                configs.append(ChunkPrepBackwardConfig(dtype, key_dim, tile))
                for value_dim in HEAD_DIMS:
                    for mma in MMA_KINDS:
                        configs.append(ChunkGammaConfig(dtype, key_dim, value_dim, tile, mma))
                        configs.append(ChunkReverseScanConfig(dtype, key_dim, value_dim, tile, 0, mma))
                    configs.append(ChunkReverseConfig(dtype, key_dim, value_dim, tile))
                    if value_dim == 128:
                        configs.append(ChunkReverseConfig(dtype, key_dim, value_dim, tile, "wgmma"))
    return configs


def all_configs() -> list:
    """Every kernel config (forward and backward, each also contained, the value checks and the containment
    checks), for ahead-of-time compilation (the CLI and CI)."""
    gdp = tensor_core_configs() + backward_configs()
    contained = [replace(config, contained=True) for config in gdp if hasattr(config, "contained")]
    return (gdp + contained + [ValueChecksConfig(dtype) for dtype in TENSOR_CORE_DTYPES]
            + token_checks_configs() + short_conv_configs() + [ForwardLayoutConfig()])


def token_checks_configs() -> list:
    """The containment checks per dtype, K, V and n_h, with copies and flags only."""
    return [TokenChecksConfig(dtype, key_dim, value_dim, n_h, copies) for dtype in TENSOR_CORE_DTYPES
            for key_dim in HEAD_DIMS for value_dim in HEAD_DIMS for n_h in TOKEN_CHECKS_HOUSEHOLDERS
            for copies in (True, False)]


def short_conv_configs() -> list:
    """The GDP layer's elementwise kernels: the short convolution per dtype and width and the gated norm per
    dtype and row length (forward and backward each), and the column sum of their weight gradients."""
    configs: list = [kind(dtype, width) for dtype in TENSOR_CORE_DTYPES for width in SHORT_CONV_WIDTHS
                     for kind in (ShortConvConfig, ShortConvBackwardConfig)]
    configs += [kind(dtype, dim) for dtype in TENSOR_CORE_DTYPES for dim in GATED_NORM_DIMS
                for kind in (GatedRMSNormConfig, GatedRMSNormBackwardConfig)]
    return configs + [ColumnSumConfig()]


def ci_configs() -> list:
    """The configs CI compiles (about a third of the library, to keep a 2-core CI run short): every
    bfloat16 variant (kernel, mma, mode, row block, query tile) at K = V = 128, and each kernel once at
    K = 64. The float16 and mixed-size configs differ only in types and extents; the GPU session
    compiles the whole library."""
    chosen, variants_seen, small_seen, contained_seen = [], set(), set(), set()
    for config in all_configs():
        if getattr(config, "dtype", "bfloat16") != "bfloat16":
            continue
        if getattr(config, "contained", False):  # contained: the flag loads, once per kernel and MMA kind
            kind = (type(config), getattr(config, "mma", None))
            if getattr(config, "key_dim", 0) == getattr(config, "value_dim", 128) == 128 and kind not in contained_seen:
                contained_seen.add(kind)
                chosen.append(config)
            continue
        key_dim = getattr(config, "key_dim", 128)  # a kernel without head sizes (the value checks): K = V = 128
        value_dim = getattr(config, "value_dim", key_dim)
        variant = tuple((f.name, getattr(config, f.name)) for f in fields(config)
                        if f.name not in ("dtype", "key_dim", "value_dim"))
        if key_dim == value_dim == 128 and (type(config), variant) not in variants_seen:
            variants_seen.add((type(config), variant))
            chosen.append(config)
        elif key_dim == value_dim == 64 and type(config) not in small_seen:
            small_seen.add(type(config))
            chosen.append(config)
    return chosen


def describe(config) -> str:
    """Short human-readable form, e.g. ``ChunkScanConfig(bfloat16, K=128, V=64, output, NQ=32, R=0)``."""
    labels = {"dtype": "", "key_dim": "K=", "value_dim": "V=", "threads": "threads=", "query_tile": "NQ=", "row_block": "R=", "mma": "",
              "mode": "", "num_householder": "n_h="}
    # the containment flags appear only where set: the other configs keep their names
    parts = [f"{labels.get(f.name, f.name + '=')}{getattr(config, f.name)}" for f in fields(config)
             if not (f.name == "contained" and not config.contained) and not (f.name == "copies" and config.copies)]
    return f"{type(config).__name__}({', '.join(parts)})"
