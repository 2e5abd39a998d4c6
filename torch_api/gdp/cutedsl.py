"""``CuTeDSLGatedDeltaProductCPBackend``: the GDP forward on the tensor-core kernels of ``cp_linear.kernels``.

A thin adapter: it flattens the shard, builds the framework-neutral work layout
(``cp_linear.kernels.launch.forward_layout``) with torch arrays, allocates outputs and runs the
typed launches on the current stream (TVM-FFI, no host synchronisation). The backward runs the
backward kernels from the segments' saved incoming states (the default, ``backward="kernels"``) or
``TorchGDPBackend``'s recomputation (``backward="torch"``: the saved context has the layout it reads).

Launch plan of one shard (N sequences, each cut into segments of ``segment_chunks`` chunks so
that one long sequence fills the GPU):

    prepare   chunk_prep           every chunk (parallel): T, P, scalars
              chunk_scan summary   every segment that is followed by another one, plus (CP) every
                                   segment of the trailing sequence: [E^T ; M^T] from [0 ; I]
              segment_fold         every sequence's segment summaries from [0 ; I] -> each
                                   segment's prefix map [E_pre | M_pre] (kept in the context) and
                                   the trailing sequence's [E | M]
    apply     segment_fold         (mode apply_affine, parallel over segments) every segment's
                                   incoming state E_pre + M_pre S: S = S_in (the fold of the
                                   preceding summaries) for sequence 0, the initial state, or zero
              chunk_scan output    every segment from its incoming state: outputs, end states (and,
                                   mode "output_states" for the kernel backward, every chunk's start state)

A sequence that spans ranks therefore costs one summary pass (run before the all-gather) and
one output pass — no second state pass, and one sequential fold per forward. A one-device forward
that no backward follows (``one_device_forward`` with ``save_for_backward`` False) needs neither the
CP summary nor the prefix maps, and runs four launches:

    chunk_prep, chunk_scan summary (only segments followed by another one), segment_fold (V rows from
    each sequence's initial state or zero -> every segment's incoming state), chunk_scan output

The kernel backward mirrors the protocol's plan:

    prepare   chunk_prep, chunk_gamma   per-segment backward summaries [gamma ; M_b] of the leading
                                   sequence and of every segment preceded by another one (M_b = M^T:
                                   taken from the forward's summary where it made one)
              segment_fold (descending)  the leading sequence's gamma (from dL/d final state) and every
                                   segment's outgoing state gradient
    apply     segment_fold (descending)  again only when following summaries change the trailing
                                   sequence's end gradient (CP); else prepare's outgoing gradients
              the reverse scan, chunk_reverse, chunk_prep_backward from the chunk states the forward's
                                   output pass stored (mode "output_states"; chunk_scan mode "states"
                                   recomputes them with save_chunk_states=False): input gradients,
                                   dL/d initial state
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

import torch

from cp_linear.kernel_support import capability_reason, config_reason
from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    as_packed_array,
)
from cp_linear.validation import poison_read_bad, without_token_flags, zero_flagged_inputs, zero_read_bad_grad
from torch_api.gdp.chunk import TorchGDPBackend, make_cp_saved_context, read_cp_saved_context
from torch_api.gdp.types import GDPInputGradients, GDPInputs
from torch_api.gdp.validation import check_gdp_inputs

KERNEL_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SM_COUNT: dict[int, int] = {}
_KERNEL_BACKWARD = "kernel_backward"  # saved-context flag: the kernel backward's buffer follows the 9 tensors
_TOKEN_FLAGS = "token_flags"  # saved-context flag: the inputs are raw, and their (state_bad, read_bad) ride last
# the work layout's device tables, saved by the forward for the backward (ForwardLayout's fields)
_TABLES = kl.LAYOUT_TABLES
_PREP = ("ta", "tb", "p", "scalars")


def unsupported_reason(inputs: GDPInputs) -> str | None:
    """Why the tensor-core kernels cannot run ``inputs`` (None when they can)."""
    if inputs.q.device.type != "cuda":
        return f"the kernels need CUDA tensors; received {inputs.q.device}"
    if inputs.q.dtype not in KERNEL_DTYPE_NAMES:
        return f"the kernels take bfloat16 or float16 q/k/v; received {inputs.q.dtype}"
    key_dim, value_dim = inputs.q.shape[-1], inputs.v.shape[-1]
    if key_dim not in kcfg.HEAD_DIMS or value_dim not in kcfg.HEAD_DIMS:
        return f"the kernels support K, V in {kcfg.HEAD_DIMS}; received K = {key_dim}, V = {value_dim}"
    if inputs.k.dtype != inputs.q.dtype or inputs.v.dtype != inputs.q.dtype:
        return "q, k and v must share one dtype"
    return None


# --------------------------------------------------------------------------- the automatic choice


_PLATFORM_REASONS: dict[tuple[str, int | None], str | None] = {}
_AUTO_WARNED: set[str] = set()


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; one function so that tests can fake a GPU."""
    return torch.cuda.get_device_capability(device)


def dsl_reason() -> str | None:
    """Why the DSL cannot compile the kernels here (None when nvidia-cutlass-dsl is installed)."""
    if importlib.util.find_spec("cutlass") is None:
        return "the kernels need the nvidia-cutlass-dsl package (pip install 'cp_linear[cuda]')"
    return None


def kernel_platform_reason(device) -> str | None:
    """Why the kernels cannot run on ``device`` (None when they can): a Hopper (sm_90) CUDA GPU with
    nvidia-cutlass-dsl installed (the ``cuda`` extra). Cached per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the kernels need a CUDA device; received {device.type}"
    key = (device.type, device.index)
    if key not in _PLATFORM_REASONS:
        _PLATFORM_REASONS[key] = capability_reason(*device_capability(device)) or dsl_reason()
    return _PLATFORM_REASONS[key]


def choose_backend_name(device, dtypes, key_dim: int, value_dim: int, num_householder: int
                        ) -> tuple[str, str | None]:
    """("cutedsl", None) where the kernels run these inputs, else ("reference", the one-line reason):
    the platform (``kernel_platform_reason``) and the configuration (``cp_linear.kernel_support``:
    bf16/fp16, K and V in {64, 128}, n_h in {1, 2, 3}). On a device that could run the kernels, an
    unsupported configuration warns once per reason; elsewhere (a CPU, another GPU) nothing is said."""
    platform = kernel_platform_reason(device)
    if platform is not None:
        return "reference", platform
    names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
    reason = config_reason(names, key_dim, value_dim, num_householder)
    if reason is None:
        return "cutedsl", None
    if reason not in _AUTO_WARNED and not _compiling():
        _AUTO_WARNED.add(reason)
        warnings.warn(f"backend=None runs TorchGDPBackend: {reason}", stacklevel=4)
    return "reference", reason


def auto_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_householder: int):
    """The backend the torch ops and layers use when none is given: ``CuTeDSLGatedDeltaProductCPBackend``
    on a Hopper GPU for a configuration the kernels take, else ``TorchGDPBackend``
    (``choose_backend_name``)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in (q, k, v)):
        return _auto_instance("reference")  # the op reports the bad input
    name, _ = choose_backend_name(q.device, (q.dtype, k.dtype, v.dtype), q.shape[-1], v.shape[-1], num_householder)
    return _auto_instance(name)


_AUTO_INSTANCES: dict[str, object] = {}


def _auto_instance(name: str):
    """One shared instance per automatic choice (the CuTeDSL backend keeps its compile caches)."""
    if name not in _AUTO_INSTANCES:
        from torch_api.gdp.library import register_backend

        _AUTO_INSTANCES[name] = CuTeDSLGatedDeltaProductCPBackend() if name == "cutedsl" else TorchGDPBackend()
        register_backend(_AUTO_INSTANCES[name])  # named outside any trace (backend_name)
    return _AUTO_INSTANCES[name]


def _name_auto_instances() -> None:
    """Build and name both automatic instances at import: one first made inside a ``torch.compile``
    trace would be registered only after it, when the fake kernels have already looked its name up."""
    for name in ("reference", "cutedsl"):
        _auto_instance(name)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@dataclass
class _Shard(kl.KernelShard):
    """``kl.KernelShard`` with the per-chunk prep results."""

    ta: torch.Tensor  # [C_max, H, 64, 64]
    tb: torch.Tensor
    p: torch.Tensor  # [C_max, H, NQ, 64]
    scalars: torch.Tensor  # [C_max, H, 4, 64] float32
    summaries: torch.Tensor | None  # [S_max, H, V + K, K] float32 ([E^T ; M^T] per segment); None in the backward
    # int64 []: the last nonempty sequence (packed forward shards; the backward finds it where it needs it),
    # or the host int 0 of a single-sequence shard (``_trailing_sequence``)
    trailing: torch.Tensor | int | None = None
    saved: dict | None = None  # views of the kernel backward's saved buffer (``_saved_regions``), when kept

    @property
    def dtype(self) -> str:
        return KERNEL_DTYPE_NAMES[self.q.dtype]


@dataclass(frozen=True)
class _LayoutSizes(kl.LayoutSizes):
    """Host sizes of a shard's work layout (``CuTeDSLGatedDeltaProductCPBackend._sizes``): the layout's
    bounds (max_chunks C_max: rows of the chunk tables and of the prep results; max_segments S_max: rows of
    the segment tables and of the saved segment states) and the scan's row blocks."""

    row_block: int = 0  # state rows per scan CTA (0: the config's default)
    row_blocks: int = 1  # scan CTAs per head along V


CuTeDSLForwardContext = kl.KernelForwardContext
CuTeDSLBackwardContext = kl.KernelBackwardContext


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...]; copied only when not contiguous or not 16-byte aligned
    (the kernels read q, k and v with 16-byte vectors)."""
    x = _contiguous(x).flatten(0, 1)
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _flat_float32(x: torch.Tensor) -> torch.Tensor:
    """``_flat`` as float32 (g and beta: the kernels read them as float32)."""
    return _cast(_flat(x), torch.float32)


# Tensor.contiguous() and Tensor.to() return the tensor itself when there is nothing to do, but still
# as one dispatched op each: a step calls them dozens of times on tensors that need neither.
def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _cast(x: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    device = x.device if device is None else device
    return x if x.dtype == dtype and x.device == device else x.to(device=device, dtype=dtype)


class CuTeDSLGatedDeltaProductCPBackend:
    """GDP chunkwise-CP backend whose forward runs on the tensor-core CuTeDSL kernels (sm_90a).

    Supports bf16 / fp16 q, k, v with K, V in {64, 128}, any n_h, packed batches
    (``cu_seqlens``) and rows, qk l2norm in the kernel, on a CUDA device. Other inputs run on
    ``TorchGDPBackend`` after a one-line warning with the reason (``unsupported_reason``), or raise
    ``ValueError`` with it when ``fallback=False``. Summaries are packed float32 ``[E | M]`` either
    way, so ranks that take different paths still compose.

    segment_chunks: chunks per segment (None: sized from the shard's shape so that one long
    sequence gives about ``ctas_per_sm`` output CTAs per SM). row_block: state rows per scan CTA
    (0: the measured choice of ``launch.scan_row_block``; 64 runs two 4-warp CTAs per SM where 128
    runs one 8-warp CTA). mma: "auto" (``launch.scan_mma``: the warpgroup-MMA scan for bf16 at
    K = V = 128, measured faster on an H200 in every case; warp mma.sync elsewhere), "sync" or
    "wgmma". backward: "kernels" (the default: one device and CP on ``chunk_gamma`` /
    ``chunk_reverse`` / ``chunk_prep_backward``; every gradient checked against float64 and bitwise
    repeatable on an H200, 5-6x faster than the recomputation at 8k tokens) or "torch"
    (``TorchGDPBackend``'s recomputation from the saved inputs). The kernel backward saves one
    float32 state per segment (9.4 MB at 32k tokens, H = 16, K = V = 128) and each segment's forward
    summary (S_max x H x (V + K) x K x 4 bytes: twice the states' at K = V; the summary pass writes it
    there itself, and ``chunk_gamma`` copies its transition rows, computing only the gamma rows). With
    ``save_chunk_states=True`` (the default) the forward's output pass also writes every chunk's start
    state into the saved buffer (input dtype: C_max x H x V x K x 2 bytes, 0.27 GB at that shape) and
    the backward reads them;
    ``False`` recomputes them in the backward (``chunk_scan`` mode "states"; bitwise the same
    values) and saves that memory. It also saves the
    forward's work layout (no second layout build) and, with ``save_prep=True`` (the default), the
    per-chunk prep results Ta, Tb, P and the scalars (+0.35 GB at that shape, where FLA's step peaks
    1.8 GB higher than ours) instead of rerunning chunk_prep (0.5 ms at 32k on an H200): the one
    store-or-recompute choice that pays (the earlier ``recompute_chunk_num`` is gone). Sequence states
    (``initial_state``, ``output_final_state`` of ``cp_linear.gdp.GDPInputs``) run on the kernels in
    both directions, so the one-device op ``torch_api.gated_delta_product`` takes this backend
    through the four functions.

    Token flags (``GDPInputs.token_flags``, ``zeroes_flagged_rows``): the containment passes raw inputs and
    their flags; the chunk kernels run contained (they zero the flagged rows as they load them, the output
    scan stores NaN at read_bad tokens, the backward kernels take those tokens' output gradient as zero), and
    the saved context keeps the flags for the backward kernels. ``TorchGDPBackend`` (the fallback, and the
    backward of ``backward="torch"``) keeps the same contract in torch ops: ``without_token_flags`` in the forward,
    ``_flagged_fallback_backward`` in the backward.
    """

    supports_sequence_states = True
    zeroes_flagged_rows = True  # takes GDPInputs.token_flags: contained chunk kernels, no sanitised copies

    def __init__(self, segment_chunks: int | None = None, *, row_block: int = 0,
                 ctas_per_sm: float = 2, fallback: bool = True, mma: str = "auto", backward: str = "kernels",
                 save_prep: bool = True, save_chunk_states: bool = True):
        if segment_chunks is not None and (not isinstance(segment_chunks, int) or segment_chunks < 1):
            raise ValueError(f"segment_chunks must be a positive int or None; received {segment_chunks!r}")
        if row_block not in (0, 64, 128):
            raise ValueError(f"row_block must be 0 (automatic), 64 or 128; received {row_block!r}")
        if not ctas_per_sm > 0:
            raise ValueError(f"ctas_per_sm must be positive; received {ctas_per_sm!r}")
        if mma != "auto" and mma not in kcfg.MMA_KINDS:
            raise ValueError(f"mma must be 'auto' or one of {kcfg.MMA_KINDS}; received {mma!r}")
        if backward not in ("torch", "kernels"):
            raise ValueError(f"backward must be 'torch' or 'kernels'; received {backward!r}")
        self.mma = mma
        self.backward = backward
        self.save_prep = bool(save_prep)
        self.save_chunk_states = bool(save_chunk_states)
        self.row_block = row_block
        self.ctas_per_sm = ctas_per_sm
        self.fallback = fallback
        self._warned: set[str] = set()
        self.segment_chunks = segment_chunks
        self._fallback = TorchGDPBackend()

    # ------------------------------------------------------------------ prepare: per-chunk work and summaries

    def _keeps_saved(self, inputs: GDPInputs) -> bool:
        """The forward keeps the kernel backward's saved buffer: ``backward="kernels"``, unless the
        caller says no backward will run (``inputs.save_for_backward``: inference skips the buffer and
        the chunk states' stores)."""
        return self.backward == "kernels" and inputs.save_for_backward

    def _use_kernels(self, inputs: GDPInputs) -> bool:
        """True when the kernels take ``inputs``; else warn once per reason (or raise without fallback)."""
        check_gdp_inputs(inputs)
        return kl.kernels_take(unsupported_reason(inputs), fallback=self.fallback, warned=self._warned,
                               fallback_name="TorchGDPBackend")

    def _shard(self, inputs: GDPInputs, *, cp_summary: bool) -> _Shard:
        """The forward's shard: work layout, chunk prep and the summary pass. With the kernel backward
        the layout tables (and with ``save_prep`` the prep results) live in the saved buffer."""
        batch, tokens, heads, key_dim = inputs.q.shape
        device, value_dim, total_tokens = inputs.q.device, inputs.v.shape[-1], batch * tokens
        rows = inputs.cu_seqlens is None
        sizes = self._sizes(inputs)
        kernel_backward = self._keeps_saved(inputs)
        layout_args = dict(total_tokens=total_tokens, num_householder=inputs.num_householder, heads=heads,
                           row_blocks=sizes.row_blocks, sm_count=_sm_count(device), segment_chunks=sizes.segment_chunks,
                           ctas_per_sm=self.ctas_per_sm)
        if rows:
            # every row continues on the next rank (CP): every segment needs a summary; every row leads:
            # the kernel backward summarises all its segments
            trailing = None
            layout, tables = rows_layout(device, batch, every_segment_summary=cp_summary,
                                         every_segment_grad_summary=kernel_backward, **layout_args)
        saved = None
        if kernel_backward:
            regions = self._saved_regions(inputs, sizes)
            saved = _carve(torch.empty(_region_offsets(regions)[1] // 4, dtype=torch.float32, device=device), regions)
        tables_in_saved = False  # the layout kernel writes the saved buffer's table region itself
        if not rows:
            cu = self._cu(inputs, device)
            # the summary pass skips the transition rows of first segments that start from zero rows
            values_only = kl.values_only_from(rows=False, cp_summary=cp_summary,
                                              initial_states=inputs.initial_state is not None)
            # the trailing sequence: the last nonempty one, found on the device (a graph-ready layout pads
            # cu_seqlens with empty sequences at its end, torch_api.layers.layout), so no host read; a
            # single sequence is the trailing one (a host int: no device search, no masks). Only the CP
            # summary reads it
            if kl.ForwardLayoutLaunch.takes(sizes.num_sequences):  # the tables in one launch
                layout, trailing = self._layout_kernel(inputs, cu, sizes, saved, cp_summary=cp_summary,
                                                       kernel_backward=kernel_backward, values_only_from=values_only)
                tables_in_saved = saved is not None
            else:
                trailing = _trailing_sequence(cu) if cp_summary else None
                layout = kl.forward_layout(cu, summary_sequence=trailing,
                                           grad_summary_sequence=0 if kernel_backward else None,
                                           values_only_from=values_only,
                                           grad_flags=kernel_backward, **layout_args)
        if layout.max_segments != sizes.max_segments:  # the custom ops' fake kernels read sizes.max_segments
            raise RuntimeError(f"forward_layout made {layout.max_segments} segments where _sizes predicted "
                               f"{sizes.max_segments}; keep CuTeDSLGatedDeltaProductCPBackend._sizes in step with it")
        if saved is not None and not tables_in_saved:
            if rows:  # the cached layout's tables: already one tensor in _TABLES order
                saved["tables"].copy_(tables)
            else:
                torch.cat([getattr(layout, name) for name in _TABLES], out=saved["tables"])
        if saved is not None:
            # a custom op's outputs must be deterministic: zero what no kernel writes, the padding and the
            # prep rows of chunk slots past the last real chunk (only slots from T_all // tokens per chunk on
            # can be spare: every sequence's chunks cover its tokens)
            unwritten = [saved["padding"]]  # (the summary pass writes every row of "summaries", zero where none)
            first_spare = total_tokens // sizes.tokens_per_chunk
            if self.save_prep:
                unwritten += [saved[name][first_spare:] for name in _PREP]
            if "chunk_states" in saved:
                unwritten.append(saved["chunk_states"][first_spare:])
            torch._foreach_zero_(unwritten)  # one op (and one launch) for all of them
        shard = self._new_shard(inputs, layout, saved, trailing, sizes.row_block, summaries=True)
        self._prep(shard)
        # mode "summary" reads no state_in and writes no o nor chunk states: tiny placeholders of the right type
        # the saved buffer keeps the summaries (the backward's transition rows M_b are their M^T rows transposed:
        # ChunkGamma copies them, kl.FORWARD_TRANSITION_FLAG); the segments without one get zero rows there
        self._scan(shard, "summary", state_in=_placeholder(shard.q.device, torch.float32, (1, 1, value_dim, key_dim)),
                   state_out=shard.summaries, o=_placeholder(shard.q.device, shard.q.dtype, (1, 1, value_dim)),
                   clear_unsummarised=saved is not None)
        return shard

    def _saved_shard(self, inputs: GDPInputs, saved: dict, sizes: _LayoutSizes) -> _Shard:
        """The backward's shard from the forward's saved buffer: its layout tables, and its prep results
        (``save_prep``) or chunk_prep rerun. No layout build, no host work beyond shapes."""
        n_h = inputs.num_householder
        layout = sizes.layout(n_h, {name: saved[name] for name in _TABLES})
        shard = self._new_shard(inputs, layout, saved, None, sizes.row_block, summaries=False)
        if not self.save_prep:
            self._prep(shard)
        return shard

    def _layout_kernel(self, inputs: GDPInputs, cu: torch.Tensor, sizes: _LayoutSizes, saved: dict | None, *,
                       cp_summary: bool, kernel_backward: bool, values_only_from: int | None = None
                       ) -> tuple[kl.ForwardLayout, torch.Tensor | int | None]:
        """``kl.forward_layout``'s tables from one ``ForwardLayoutLaunch`` (straight into the saved buffer's
        table region when the kernel backward keeps one) -> (layout, the trailing sequence: int32 [] on the
        device, the host int 0 of a single sequence, or None without a CP summary)."""
        table_sizes = sizes.table_sizes()
        out = saved["tables"] if saved is not None else torch.empty(sum(table_sizes.values()), dtype=torch.int32,
                                                                      device=cu.device)
        tables = dict(zip(_TABLES, out.split_with_sizes([table_sizes[name] for name in _TABLES])))
        trailing = torch.empty(1, dtype=torch.int32, device=cu.device)
        single = sizes.num_sequences == 1
        kl.ForwardLayoutLaunch.of(
            cu, tables, trailing, num_householder=inputs.num_householder, sizes=sizes,
            summary_sequence=kcfg.TRAILING_SEQUENCE if cp_summary and not single else 0 if cp_summary else None,
            grad_summary_sequence=0 if kernel_backward else None, values_only_from=values_only_from).run()
        if not kernel_backward:
            tables["seg_grad_flags"] = None  # forward_layout(grad_flags=False): no backward reads them
        layout = sizes.layout(inputs.num_householder, tables)
        if not cp_summary:
            return layout, None
        return layout, 0 if single else trailing.view(())

    def _new_shard(self, inputs: GDPInputs, layout, saved: dict | None, trailing, row_block: int, *,
                   summaries: bool) -> _Shard:
        """A shard over ``layout``: prep results in the saved buffer (``save_prep``) or fresh tensors."""
        q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
        device, heads, key_dim, value_dim = q.device, q.shape[1], q.shape[2], v.shape[2]
        chunks, tile = layout.max_chunks, kcfg.query_tile(inputs.num_householder)
        if saved is not None and self.save_prep:
            prep = {name: saved[name] for name in _PREP}
        else:
            prep = dict(ta=torch.empty(chunks, heads, 64, 64, dtype=q.dtype, device=device),
                        tb=torch.empty(chunks, heads, 64, 64, dtype=q.dtype, device=device),
                        p=torch.empty(chunks, heads, tile, 64, dtype=q.dtype, device=device),
                        scalars=torch.empty(chunks, heads, 4, 64, dtype=torch.float32, device=device))
        if not summaries:
            summary_rows = None
        elif saved is not None:  # written by the summary pass straight into the saved buffer
            summary_rows = saved["summaries"]
        else:
            summary_rows = torch.empty(layout.max_segments, heads, value_dim + key_dim, key_dim, dtype=torch.float32,
                                       device=device)
        return _Shard(inputs=inputs, rows=inputs.cu_seqlens is None, q=q, k=k, v=v, layout=layout,
                      row_block=row_block, summaries=summary_rows, trailing=trailing, saved=saved,
                      **prep)

    def _prep(self, shard: _Shard) -> None:
        """chunk_prep: Ta, Tb, P and the scalars of every chunk."""
        inputs, layout, q, k = shard.inputs, shard.layout, shard.q, shard.k
        tile = kcfg.query_tile(inputs.num_householder)
        kl.ChunkPrepLaunch(
            kcfg.ChunkPrepConfig(shard.dtype, shard.key_dim, tile, shard.contained),
            q=q, k=k, g=_flat_float32(inputs.g), beta=_flat_float32(inputs.beta),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps, num_chunks=layout.num_chunks,
            **_token_flags(shard),
            ta=shard.ta, tb=shard.tb, p=shard.p, scalars=shard.scalars, scale=float(inputs.scale),
            use_l2=int(bool(inputs.use_qk_l2norm_in_kernel)), num_householder=inputs.num_householder).run()

    @staticmethod
    def _cu(inputs: GDPInputs, device) -> torch.Tensor:
        """int32 cu_seqlens of a packed shard on the device (rows take ``rows_layout``)."""
        return _cast(inputs.cu_seqlens, torch.int32, device)

    def _saved_regions(self, inputs: GDPInputs, sizes: _LayoutSizes | None = None
                       ) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        """The kernel backward's saved buffer region by region (name, dtype, shape), from shapes only:
        the segments' incoming states, the forward's segment summaries [E^T ; M^T] (the backward's
        transition rows M_b = M^T are read from them), the prep results (``save_prep``), the chunk states
        (``save_chunk_states``), then the layout tables (``_regions_of``, cached: the same tuple each call)."""
        return _regions_of(sizes or self._sizes(inputs), int(inputs.q.shape[2]), int(inputs.q.shape[3]),
                           int(inputs.v.shape[-1]), inputs.q.dtype, inputs.num_householder, self.save_prep,
                           self.save_chunk_states)

    def _sizes(self, inputs: GDPInputs) -> _LayoutSizes:
        """The work layout's host sizes for ``inputs``, from shapes only (``_layout_sizes_of``, cached on
        the host ints it reads: forward and backward each ask once per step)."""
        batch, tokens, heads, key_dim = (int(size) for size in inputs.q.shape)
        num_seqs = batch if inputs.cu_seqlens is None else int(inputs.cu_seqlens.shape[0]) - 1
        return _layout_sizes_of(batch, tokens, heads, key_dim, int(inputs.v.shape[-1]), inputs.num_householder,
                                num_seqs, _sm_count(inputs.q.device), self.row_block, self.segment_chunks,
                                self.ctas_per_sm)

    def saved_buffer_shape(self, inputs: GDPInputs) -> tuple[int] | None:
        """Shape of the extra tensor the forward saves for the kernel backward: one float32 buffer
        holding the segments' incoming states, the prep results (``save_prep``) and the layout tables
        (``_saved_regions``); None when it saves none (``backward="torch"``, ``inputs.save_for_backward``
        False, or inputs the kernels do not take, which run on the fallback). Shapes only: the
        ``cp_linear`` custom ops' fake kernels call it (``torch_api.gdp.library``)."""
        if not self._keeps_saved(inputs) or unsupported_reason(inputs) is not None:
            return None
        return (_region_offsets(self._saved_regions(inputs))[1] // 4,)

    def saved_segment_states(self, saved: CPSavedContext) -> torch.Tensor | None:
        """The segments' incoming states [S_max, H, V, K] float32 a kernel-backward forward saved
        (a view of its buffer), None when the context has none."""
        buffer = kernel_saved_of(saved)
        if buffer is None:
            return None
        inputs, _, _ = read_cp_saved_context(CPSavedContext(saved.tensors[:9], saved.metadata))
        return _carve(buffer, self._saved_regions(inputs))["states"]

    def _scan(self, shard: _Shard, mode: str, *, state_in, state_out, o, chunk_states=None,
              clear_unsummarised: bool = False) -> None:
        """chunk_scan in ``mode``; ``chunk_states`` [C_max, H, V, K] (modes "states", "output_states");
        ``clear_unsummarised`` (mode "summary"): zero rows for the segments without a summary."""
        layout = shard.layout
        tile = shard.query_tile if mode in kcfg.OUTPUT_MODES else 0
        if chunk_states is None:  # not written in this mode: an empty placeholder of the right type
            chunk_states = _placeholder(shard.q.device, shard.q.dtype, (1, 1, shard.value_dim * shard.key_dim))
        else:
            chunk_states = chunk_states.view(chunk_states.shape[0], shard.heads, -1)
        kl.ChunkScanLaunch(
            kcfg.ChunkScanConfig(shard.dtype, shard.key_dim, shard.value_dim, mode, tile, shard.row_block,
                                  kl.scan_mma(self.mma, shard.dtype, shard.key_dim, shard.value_dim),
                                  shard.contained),
            k=shard.k, v=shard.v, q=shard.q, ta=shard.ta, tb=shard.tb, p=shard.p, scalars=shard.scalars,
            **_token_flags(shard),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps,
            seg_first_chunk=layout.seg_first_chunk, seg_chunks=layout.seg_chunks, seg_order=layout.seg_order,
            seg_flags=layout.seg_flags, num_segments=layout.num_segments,
            seq_first_segment=layout.seq_first_segment, state_in=state_in,
            state_out=state_out, o=o, chunk_states=chunk_states,
            num_householder=shard.inputs.num_householder, clear_unsummarised=int(clear_unsummarised)).run()

    @staticmethod
    def _fold_config(shard: _Shard, rows: int, chains: int | None = None) -> kcfg.SegmentFoldConfig:
        """``kl.fold_config`` for ``chains`` sequences that run (every sequence of the shard by default)."""
        chains = shard.layout.num_sequences if chains is None else chains
        return kl.fold_config(shard.key_dim, chains, shard.heads, rows, _sm_count(shard.q.device))

    def _prefix_fold(self, shard: _Shard, final: torch.Tensor) -> torch.Tensor:
        """segment_fold of every sequence from [0 ; I] with V + K rows -> each segment's prefix map
        [S_max, H, V + K, K] (rows [E_pre^T ; M_pre^T]; M_pre^T only where apply reads it) and ``final``
        [N, H, V + K, K]: the [E | M] rows of the trailing sequences (every row in rows mode; the others'
        rows are not written: their last segment has no summary, and skipping its map saves a step per
        sequence)."""
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        incoming_affine = torch.empty(shard.layout.max_segments, heads, value_dim + key_dim, key_dim,
                                      dtype=torch.float32, device=shard.q.device)
        # apply reads the transition rows (M_pre) of the sequences a state enters: the leading one (from the
        # preceding rank), every row, or every sequence with an initial state; the others fold V rows only
        every = shard.rows or shard.inputs.initial_state is not None
        transitions = shard.layout.num_sequences if every else 1
        # placeholders (not views, which would cost an op each): init is not read (init_count = 0)
        kl.SegmentFoldLaunch(
            self._fold_config(shard, value_dim + key_dim), summaries=shard.summaries,
            seq_first_segment=shard.layout.seq_first_segment, init=incoming_affine, addend=_no_addend(shard),
            incoming=incoming_affine, final=final, init_count=0, value_rows=value_dim, identity_row=value_dim,
            transition_count=transitions, add_mode=kl.ADD_NONE,
            write_final=kl.FINAL_EVERY if shard.rows else kl.FINAL_TRAILING, descending=0).run()
        return incoming_affine

    def _incoming_fold(self, shard: _Shard, initial: torch.Tensor | None) -> torch.Tensor:
        """segment_fold mode "fold" with V rows from each sequence's start state (``initial`` [N, H, K, V],
        or zero) -> every real segment's incoming state [S_max, H, V, K] (rows of unused segments are not
        written). A sequence's last segment has no summary and its map is not applied (FINAL_NONE): the
        output pass computes the end states."""
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        incoming = torch.empty(shard.layout.max_segments, heads, value_dim, key_dim, dtype=torch.float32,
                               device=shard.q.device)
        # the kernel's row form [N, H, V, K]; without initial states every sequence starts from zero rows
        # (init_count = 0, identity_row = V: no identity rows) and init / final are placeholders, never read
        init = incoming if initial is None else initial.transpose(-1, -2).contiguous()
        kl.SegmentFoldLaunch(
            self._fold_config(shard, value_dim), summaries=shard.summaries,
            seq_first_segment=shard.layout.seq_first_segment, init=init, addend=_no_addend(shard), incoming=incoming,
            final=incoming, init_count=0 if initial is None else initial.shape[0], value_rows=value_dim,
            identity_row=value_dim, transition_count=0, add_mode=kl.ADD_NONE, write_final=kl.FINAL_NONE,
            descending=0).run()
        return incoming

    def _apply_affine(self, shard: _Shard, incoming_affine: torch.Tensor, init: torch.Tensor | None,
                      init_count: int) -> torch.Tensor:
        """segment_fold mode "apply_affine" -> every segment's incoming state [S_max, H, V, K]: the
        prefix maps applied to ``init`` [init_count, H, V, K] (the start rows of the first
        ``init_count`` sequences; the others start from zero). Rows of unused segments are zero, so
        the saved states (an output of the custom ops) are deterministic."""
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        if shard.saved is not None:  # straight into the kernel backward's saved buffer
            incoming = shard.saved["states"]
        else:
            incoming = torch.empty(shard.layout.max_segments, heads, value_dim, key_dim, dtype=torch.float32,
                                   device=shard.q.device)
        # placeholders: init is not read without one (init_count = 0), final never written (FINAL_NONE)
        kl.SegmentFoldLaunch(
            kcfg.SegmentFoldConfig(key_dim, "apply_affine"), summaries=incoming_affine,
            seq_first_segment=shard.layout.seq_first_segment, init=incoming if init is None else init,
            addend=_no_addend(shard), incoming=incoming, final=incoming, init_count=init_count,
            value_rows=value_dim, identity_row=value_dim, transition_count=0, add_mode=kl.ADD_NONE,
            write_final=kl.FINAL_NONE, descending=0).run()
        return incoming

    def _output(self, shard: _Shard, incoming: torch.Tensor, initial: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """chunk_scan output -> (o [B, T, H, V], final state of every sequence [N, H, K, V] float32); mode
        "output_states" when the saved buffer keeps the chunk states (``save_chunk_states``). The kernel
        writes the final states from the sequences' last segments; an empty sequence (packed shards only)
        keeps its ``initial`` state (zero without one), filled in beforehand."""
        o = torch.empty(shard.q.shape[0], shard.heads, shard.value_dim, dtype=shard.q.dtype, device=shard.q.device)
        state_shape, device = shard.inputs.state_shape, shard.q.device
        if shard.rows:  # every row has tokens: every final state is written
            final_state = torch.empty(state_shape, dtype=torch.float32, device=device)
        elif initial is None:
            final_state = torch.zeros(state_shape, dtype=torch.float32, device=device)
        else:
            final_state = initial.clone()  # never write into the caller's tensor (_cast may return it)
        chunk_states = None if shard.saved is None else shard.saved.get("chunk_states")
        self._scan(shard, "output" if chunk_states is None else "output_states", state_in=incoming,
                   state_out=final_state, o=o, chunk_states=chunk_states)
        batch, tokens = shard.inputs.q.shape[:2]
        return o.view(batch, tokens, shard.heads, shard.value_dim), final_state

    # ------------------------------------------------------------------ forward protocol

    def cp_forward_prepare(self, inputs: GDPInputs) -> tuple[CPForwardPackedSummary, CuTeDSLForwardContext]:
        """Chunk prep, the summary pass and the fold of every sequence's segments (each segment's
        prefix map, kept for apply) -> the trailing sequence's packed ``[E | M]``. A trailing sequence
        that starts inside the shard has M = 0 and carries its ``inputs.initial_state`` row S0 in E
        (E + M S0)."""
        if not self._use_kernels(inputs):
            summary, context = self._fallback.cp_forward_prepare(without_token_flags(inputs))
            return summary, context if inputs.token_flags is None else _FlaggedFallback(context, inputs)
        initial = _initial_states(inputs)
        shard = self._shard(inputs, cp_summary=True)
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        num_seqs = shard.layout.num_sequences
        stacked_rows = torch.empty(num_seqs, heads, value_dim + key_dim, key_dim, dtype=torch.float32,
                                   device=shard.q.device)
        incoming_affine = self._prefix_fold(shard, final=stacked_rows)
        # the trailing sequence's index is data (the last nonempty one): its row is written
        # (FINAL_TRAILING writes every sequence whose segments end at the last one)
        single = isinstance(shard.trailing, int)  # one sequence: index 0, which starts the shard
        picked = None if shard.rows or single else shard.trailing.view(1)
        rows = stacked_rows if shard.rows or single else stacked_rows[picked]
        summary = rows.transpose(-1, -2).contiguous()  # [E | M]
        if not shard.rows and not single:  # rows: every row is a leading sequence, whose S0 the next ranks fold from
            starts_inside = shard.trailing > 0
            if initial is not None:
                # the trailing sequence starts here from its S0: E + M S0. A leading sequence's S0 stays out of
                # the summary: under CP the ranks it continues on fold the summaries from it (GDPInputs)
                with_start = summary[..., :value_dim] + summary[..., value_dim:] @ initial[picked]
                summary[..., :value_dim] = torch.where(starts_inside, with_start, summary[..., :value_dim])
            summary[..., value_dim:] = torch.where(starts_inside, 0.0, summary[..., value_dim:])
        packed = summary if shard.rows else summary[0]
        return CPForwardPackedSummary(packed), CuTeDSLForwardContext(shard, summary, initial, incoming_affine)

    def cp_forward_apply(self, local_context: CuTeDSLForwardContext, preceding) -> CPForwardResult:
        """Every segment's incoming state from prepare's prefix maps (applied to the fold of the
        preceding summaries for the leading sequence, to ``initial_state``, or to zero), then the
        output pass; returns ``(o, final_state)`` when the inputs ask for final states."""
        if isinstance(local_context, _FlaggedFallback):  # the fallback's, on inputs with token flags
            output, saved = self._fallback.cp_forward_apply(local_context.context, preceding)
            inputs = local_context.inputs
            return CPForwardResult(poison_read_bad(output, inputs.token_flags[1]), _raw_saved(saved, inputs))
        if not isinstance(local_context, CuTeDSLForwardContext):  # prepared by the fallback
            return self._fallback.cp_forward_apply(local_context, preceding)
        shard, summary, initial = local_context.shard, local_context.summary, local_context.initial
        inputs, value_dim = shard.inputs, shard.value_dim
        stacked = _packed_stack(preceding)
        leading_count = summary.shape[0] if shard.rows else 1
        state_shape = (leading_count, shard.heads, shard.key_dim, value_dim)
        if stacked is not None and stacked.shape[0]:
            kl.check_preceding_summaries(stacked.shape, summary.shape, rows=shard.rows)
            start = None if initial is None else initial[:leading_count].transpose(-1, -2)  # the leading S0, rows
            leading_rows = _fold_preceding(stacked.reshape(stacked.shape[0], *summary.shape), start)  # [n, H, V, K]
            leading_state = leading_rows.transpose(-1, -2)  # the saved context's [n, H, K, V]: a view
            if initial is None:
                init, init_count = leading_rows, leading_count
            else:  # the other local sequences start from their own initial states
                init = _contiguous(torch.cat([leading_rows, initial[leading_count:].transpose(-1, -2)]))
                init_count = initial.shape[0]
        elif initial is not None:
            leading_state = initial[:leading_count]
            init, init_count = initial.transpose(-1, -2).contiguous(), initial.shape[0]
        else:
            leading_state = torch.zeros(state_shape, dtype=torch.float32, device=shard.q.device)
            init, init_count = None, 0
        # saved for the kernel backward and then an output of the custom ops: deterministic (unused rows zero)
        incoming = self._apply_affine(shard, local_context.incoming_affine, init, init_count)
        output, final_state = self._output(shard, incoming, initial)
        if inputs.output_final_state:
            output = (output, final_state)
        transition = summary[..., value_dim:]
        saved = make_cp_saved_context(inputs, leading_state if shard.rows else leading_state[0],
                                      transition if shard.rows else transition[0])
        if shard.saved is not None:  # segment states, layout, prep results: the kernel backward starts from them
            saved = with_kernel_saved(saved, shard.saved["buffer"])
        # the contained backward kernels (or the fallback's backward, backward="torch") read the token flags
        return CPForwardResult(output, with_token_flags(saved, inputs.token_flags))

    # ------------------------------------------------------------------ backward protocol

    def cp_backward_prepare(self, output_grad, saved_context: CPSavedContext):
        """The leading fragment's packed ``[gamma | M^T]`` from a zero outgoing gradient (gamma: the
        backward summaries of its segments folded last to first, from dL/d final state when the
        forward returned one). Runs on the backward kernels when the forward saved the segment
        states (``backward="kernels"``), else ``TorchGDPBackend.cp_backward_prepare``."""
        return self._backward_prepare(output_grad, saved_context, summary=True)

    def _backward_prepare(self, output_grad, saved_context: CPSavedContext, *, summary: bool):
        """``cp_backward_prepare``; without ``summary`` (one device: no rank to send it to) the packed
        summary is not built and None stands in its place (kernel backward only)."""
        token_flags = token_flags_of(saved_context)
        if not saved_context.metadata.get(_KERNEL_BACKWARD, False):
            if token_flags is not None:
                output_grad, saved_context = _flagged_fallback_backward(output_grad, saved_context, token_flags)
            return self._fallback.cp_backward_prepare(output_grad, saved_context)
        inputs, _, transition = read_cp_saved_context(CPSavedContext(saved_context.tensors[:9],
                                                                     saved_context.metadata))
        if token_flags is not None:  # the contained backward kernels: flagged rows and their dO rows zero
            inputs = replace(inputs, token_flags=token_flags)
        sizes = self._sizes(inputs)
        saved = _carve(kernel_saved_of(saved_context), self._saved_regions(inputs, sizes))
        incoming = saved["states"]
        output_grad, final_grad = output_grad if inputs.output_final_state else (output_grad, None)
        shard = self._saved_shard(inputs, saved, sizes)
        layout, heads, key_dim, value_dim = shard.layout, shard.heads, shard.key_dim, shard.value_dim
        device = shard.q.device
        if output_grad is None:
            do = shard.q.new_zeros(shard.q.shape[0], heads, value_dim)
        else:
            expected = (*inputs.q.shape[:3], value_dim)
            if tuple(output_grad.shape) != expected:
                raise ValueError(f"output_grad must have shape {expected}; received {tuple(output_grad.shape)}")
            do = _flat(_cast(output_grad, shard.q.dtype))
        end_grads = torch.empty(layout.num_sequences, heads, value_dim, key_dim, dtype=torch.float32, device=device)
        if final_grad is None:
            end_grads.zero_()
        else:  # x + 0 (what zeros += x computed, -0 to +0 included) in one op, into the contiguous rows
            torch.add(_cast(final_grad, torch.float32, device).transpose(-1, -2), 0.0, out=end_grads)
        grad_summaries = torch.empty(layout.max_segments, heads, value_dim + key_dim, key_dim, dtype=torch.float32,
                                     device=device)
        # ChunkGamma writes the gamma rows, the transition rows of the segments the forward did not summarise
        # (each sequence's last), and copies the forward's transitions (transposed) for the others
        self._gamma(shard, do, grad_summaries, saved["summaries"])
        # the summary's gamma: every row's start (rows) or the leading sequence's (packed); none on one
        # device, so that no chain applies its first segment's map
        gamma_rows = torch.empty_like(end_grads if shard.rows else end_grads[:1]) if summary else None
        grad_out = self._descending_fold(shard, grad_summaries, end_grads, final=gamma_rows)
        context = CuTeDSLBackwardContext(shard, do, grad_summaries, incoming, end_grads, grad_out,
                                         saved.get("chunk_states"))
        if not summary:
            return None, context
        gamma = gamma_rows.transpose(-1, -2) if shard.rows else gamma_rows[0].transpose(-1, -2)
        packed = torch.cat([gamma, transition.transpose(-1, -2)], dim=-1)  # a new contiguous tensor
        return CPBackwardPackedSummary(packed), context

    def cp_backward_apply(self, backward_context, following):
        """Input gradients: the outgoing gradient of the trailing sequence (every row) is the fold of
        the following summaries; each segment's outgoing gradient comes from the descending fold, then
        the reverse pass and the prep backward (or ``TorchGDPBackend.cp_backward_apply``)."""
        if not isinstance(backward_context, CuTeDSLBackwardContext):
            return self._fallback.cp_backward_apply(backward_context, following)
        ctx = backward_context
        shard = ctx.shard
        end_grads, grad_out = ctx.end_grads, ctx.grad_out
        stacked = None if following is None else _packed_backward_stack(following)
        if stacked is not None and stacked.shape[0]:
            # the outgoing gradient, [H, K, V] (packed) or [B, H, K, V] (rows), enters the fold as an addend of
            # the trailing sequences' end gradients (end + outgoing, in the kernel: no copy of end_grads)
            outgoing = _fold_following(stacked)
            if shard.rows:  # every row continues on the next rank: every chain changes
                grad_out = self._descending_fold(shard, ctx.grad_summaries, end_grads, final=None,
                                                 outgoing=outgoing)
            else:
                # only the trailing sequence (the last with tokens: cu_seqlens covers T >= 1) continues there:
                # its rows of prepare's fold are redone in place from end_grads, so applies repeat exactly
                self._descending_fold(shard, ctx.grad_summaries, end_grads, final=None,
                                      outgoing=outgoing[None], into=grad_out)
                ctx.trailing_refolded = True
        elif ctx.trailing_refolded:  # an earlier apply changed the trailing rows: back to prepare's fold
            no_outgoing = ctx.incoming.new_zeros(1, shard.heads, shard.key_dim, shard.value_dim)
            self._descending_fold(shard, ctx.grad_summaries, end_grads, final=None, outgoing=no_outgoing, into=grad_out)
            ctx.trailing_refolded = False
        grads, grad_in = self._reverse(shard, ctx.do, ctx.incoming, grad_out, ctx.chunk_states)
        if shard.inputs.initial_state is None:
            return grads
        # d initial state: the gradient entering each sequence's first segment (an empty one passes its end's)
        layout = shard.layout
        first_segment = layout.seq_first_segment[:-1].long().clamp(max=layout.max_segments - 1)
        d_initial = grad_in.index_select(0, first_segment)
        empty = (layout.seq_segments == 0).view(-1, 1, 1, 1)
        d_initial = torch.where(empty, end_grads, d_initial).transpose(-1, -2).contiguous()
        return grads._replace(dinitial_state=d_initial)

    # ------------------------------------------------------------------ one device (through the four functions)

    def one_device_forward(self, inputs: GDPInputs, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, CPSavedContext | None]:
        """-> (o [B, T, H, V], final_state float32 [N, H, K, V], saved context): the four functions
        with no neighbours (what ``torch_api.gated_delta_product`` runs). When ``inputs.save_for_backward``
        is False (inference: no backward will run) and the kernels take the inputs, a leaner plan
        (``_inference_forward``) runs instead and the saved context is None."""
        inputs = replace(inputs, initial_state=initial_state, output_final_state=True)
        if not inputs.save_for_backward and self._use_kernels(inputs):
            output, final_state = self._inference_forward(inputs)
            return output, final_state, None
        _, local = self.cp_forward_prepare(inputs)
        (output, final_state), saved = self.cp_forward_apply(local, None)
        return output, final_state, saved

    def _inference_forward(self, inputs: GDPInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-device forward when no backward follows -> (o [B, T, H, V], final_state [N, H, K, V]):
        chunk_prep, the summary pass of the segments followed by another one (no CP summary of the
        trailing sequence), one fold of V rows from each sequence's start state writing every segment's
        incoming state, the output pass: four launches where the protocol runs five, a fold of V rows
        where it folds V + K (the prefix maps [E_pre | M_pre], then apply_affine), and no summary of a
        sequence's last segment. The protocol's extra work serves CP (the trailing sequence's summary)
        and the kernel backward (its layout flags, summaries and saved states), neither of which follows.
        Without initial states the incoming states are bitwise the protocol's (apply_affine then adds
        nothing to E_pre); with them they differ by float32 rounding (S0 folded segment by segment
        instead of through the composed map)."""
        initial = _initial_states(inputs)
        shard = self._shard(inputs, cp_summary=False)
        return self._output(shard, self._incoming_fold(shard, initial), initial)

    def one_device_backward(self, output_grad, final_state_grad, saved_context: CPSavedContext):
        """-> (GDPInputGradients, dL/d initial state [N, H, K, V] float32 or None) for a
        ``one_device_forward`` context (no neighbour: the backward summary is not built)."""
        _, context = self._backward_prepare((output_grad, final_state_grad), saved_context, summary=False)
        grads = self.cp_backward_apply(context, None)
        return grads._replace(dinitial_state=None), grads.dinitial_state

    def _descending_fold(self, shard: _Shard, grad_summaries: torch.Tensor, end_grads: torch.Tensor, *,
                         final: torch.Tensor | None, outgoing: torch.Tensor | None = None,
                         into: torch.Tensor | None = None) -> torch.Tensor:
        """segment_fold, last segment first, from each sequence's end gradient [N, H, V, K] -> the
        outgoing gradient of every segment [S_max, H, V, K] (and ``final``: each row's start, or the
        leading sequence's of a packed shard, [1, H, V, K]).
        ``outgoing`` [A, H, K, V] is added to the end gradients: every row's (A = B, rows shards), or
        only the trailing sequence's (A = 1, packed), which alone is then folded, into ``into``."""
        layout, heads, key_dim, value_dim = shard.layout, shard.heads, shard.key_dim, shard.value_dim
        grad_out = into if into is not None else torch.empty(
            layout.max_segments, heads, value_dim, key_dim, dtype=torch.float32, device=shard.q.device)
        if outgoing is None:
            add_mode, addend, chains = kl.ADD_NONE, _no_addend(shard), layout.num_sequences
        elif shard.rows:
            add_mode, addend, chains = kl.ADD_EVERY, outgoing, layout.num_sequences
        else:
            add_mode, addend, chains = kl.ADD_TRAILING, outgoing, 1
        kl.SegmentFoldLaunch(
            self._fold_config(shard, value_dim, chains), summaries=grad_summaries,
            seq_first_segment=layout.seq_first_segment, init=end_grads, addend=addend, incoming=grad_out,
            final=grad_out if final is None else final,  # None: FINAL_NONE
            init_count=end_grads.shape[0], value_rows=value_dim, identity_row=value_dim, transition_count=0,
            add_mode=add_mode,
            write_final=kl.FINAL_NONE if final is None else kl.FINAL_EVERY if shard.rows else kl.FINAL_LEADING,
            descending=1).run()
        return grad_out

    def _gamma(self, shard: _Shard, do: torch.Tensor, summaries: torch.Tensor, forward_summaries: torch.Tensor
               ) -> None:
        layout = shard.layout
        kl.ChunkGammaLaunch(
            kcfg.ChunkGammaConfig(shard.dtype, shard.key_dim, shard.value_dim, shard.query_tile,
                                  kl.gradient_rows_mma(self.mma), shard.contained),
            k=shard.k, q=shard.q, do=do, ta=shard.ta, p=shard.p, scalars=shard.scalars, **_token_flags(shard),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps,
            seg_first_chunk=layout.seg_first_chunk, seg_chunks=layout.seg_chunks, seg_order=layout.seg_order,
            seg_flags=layout.seg_grad_flags, num_segments=layout.num_segments, forward_summaries=forward_summaries,
            summaries=summaries, num_householder=shard.inputs.num_householder).run()

    def _reverse(self, shard: _Shard, do: torch.Tensor, incoming: torch.Tensor, grad_out: torch.Tensor,
                 chunk_states: torch.Tensor | None):
        """The chunk states (the forward's, or chunk_scan mode "states" when it kept none), the
        state-gradient pass, chunk_reverse, then chunk_prep_backward -> (GDPInputGradients, dX at every
        segment start)."""
        layout, inputs = shard.layout, shard.inputs
        heads, key_dim, value_dim, tile = shard.heads, shard.key_dim, shard.value_dim, shard.query_tile
        device, chunks = shard.q.device, layout.max_chunks
        f32 = dict(dtype=torch.float32, device=device)
        tokens_all, steps_all = shard.q.shape[0], shard.k.shape[0]
        if chunk_states is None:
            chunk_states = torch.empty(chunks, heads, value_dim, key_dim, dtype=shard.q.dtype, device=device)
            # state_out and o are not written
            self._scan(shard, "states", state_in=incoming,
                       state_out=_placeholder(device, torch.float32, (1, 1, key_dim, value_dim)),
                       o=_placeholder(device, shard.q.dtype, (1, 1, value_dim)),
                       chunk_states=chunk_states)
        chunk_grads = torch.empty_like(chunk_states)
        grad_in = torch.empty_like(grad_out)
        kl.ChunkReverseScanLaunch(
            kcfg.ChunkReverseScanConfig(shard.dtype, key_dim, value_dim, tile, 0, kl.gradient_rows_mma(self.mma),
                                        shard.contained),
            k=shard.k, q=shard.q, do=do, ta=shard.ta, p=shard.p, scalars=shard.scalars, **_token_flags(shard),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps,
            seg_first_chunk=layout.seg_first_chunk, seg_chunks=layout.seg_chunks, seg_order=layout.seg_order,
            num_segments=layout.num_segments, grad_out=grad_out, chunk_grads=chunk_grads, grad_in=grad_in,
            num_householder=inputs.num_householder).run()
        dv = torch.empty(steps_all, heads, value_dim, dtype=shard.q.dtype, device=device)  # final: input dtype
        dq_scan = torch.empty(tokens_all, heads, key_dim, **f32)
        dk_scan = torch.empty(steps_all, heads, key_dim, **f32)
        d_ta = torch.empty(chunks, heads, 64, 64, **f32)
        d_tb = torch.empty_like(d_ta)
        d_p = torch.empty(chunks, heads, tile, 64, **f32)
        d_scalars = torch.empty(chunks, heads, 4, 64, **f32)
        kl.ChunkReverseLaunch(
            kcfg.ChunkReverseConfig(shard.dtype, key_dim, value_dim, tile, kl.reverse_mma(self.mma, value_dim),
                                    shard.contained),
            k=shard.k, v=shard.v, q=shard.q, do=do, ta=shard.ta, tb=shard.tb, p=shard.p, scalars=shard.scalars,
            **_token_flags(shard),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps, num_chunks=layout.num_chunks,
            chunk_states=chunk_states, chunk_grads=chunk_grads, dv=dv, dq_scan=dq_scan, dk_scan=dk_scan, d_ta=d_ta,
            d_tb=d_tb, d_p=d_p, d_scalars=d_scalars, num_householder=inputs.num_householder).run()
        del chunk_states, chunk_grads  # 2 x [C, H, V, K]: free before chunk_prep_backward allocates
        dq, dk = torch.empty_like(dq_scan, dtype=shard.q.dtype), torch.empty_like(dk_scan, dtype=shard.q.dtype)
        dg = torch.empty(tokens_all, heads, **f32)
        dbeta = torch.empty(steps_all, heads, **f32)
        kl.ChunkPrepBackwardLaunch(
            kcfg.ChunkPrepBackwardConfig(shard.dtype, key_dim, tile, shard.contained),
            q=shard.q, k=shard.k, g=_flat_float32(inputs.g), beta=_flat_float32(inputs.beta), **_token_flags(shard),
            chunk_first_step=layout.chunk_first_step, chunk_steps=layout.chunk_steps, num_chunks=layout.num_chunks,
            d_ta=d_ta, d_tb=d_tb, d_p=d_p, d_scalars=d_scalars, dq_scan=dq_scan, dk_scan=dk_scan, dq=dq, dk=dk,
            dg=dg, dbeta=dbeta, scale=float(inputs.scale), use_l2=int(bool(inputs.use_qk_l2norm_in_kernel)),
            num_householder=inputs.num_householder).run()
        shaped = lambda x, like: _cast(x.view(like.shape), like.dtype)  # noqa: E731
        grads = GDPInputGradients(shaped(dq, inputs.q), shaped(dk, inputs.k), shaped(dv, inputs.v),
                                  shaped(dg, inputs.g), shaped(dbeta, inputs.beta))
        return grads, grad_in


@functools.lru_cache(maxsize=64)
def _layout_sizes_of(batch: int, tokens: int, heads: int, key_dim: int, value_dim: int, n_h: int, num_seqs: int,
                     sm_count: int, row_block: int, segment_chunks: int | None, ctas_per_sm: float) -> _LayoutSizes:
    """``CuTeDSLGatedDeltaProductCPBackend._sizes`` from host ints (``kl.forward_layout`` builds the tables;
    its segment count is ``max(1, max_chunks // segment_chunks + N)``, repeated here so that the saved
    segment states have a shape known before the forward runs). Cached: frozen, shapes and config only."""
    row_block = row_block or kl.scan_row_block(key_dim, value_dim, n_h)
    row_block = row_block if row_block <= min(key_dim, value_dim) else 0
    scan_rows = kcfg.ChunkScanConfig("bfloat16", key_dim, value_dim, "output", 32, row_block).rows_per_cta
    row_blocks = value_dim // scan_rows
    sizes = kl.layout_sizes(total_tokens=batch * tokens, num_householder=n_h, num_sequences=num_seqs, heads=heads,
                            row_blocks=row_blocks, sm_count=sm_count, segment_chunks=segment_chunks,
                            ctas_per_sm=ctas_per_sm)
    return _LayoutSizes(**asdict(sizes), row_block=row_block, row_blocks=row_blocks)


@functools.lru_cache(maxsize=64)
def _regions_of(sizes: _LayoutSizes, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, n_h: int,
                save_prep: bool, save_chunk_states: bool) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    """``CuTeDSLGatedDeltaProductCPBackend._saved_regions`` from host values (cached: one tuple per key)."""
    chunks, segments = sizes.max_chunks, sizes.max_segments
    regions = [("states", torch.float32, (segments, heads, value_dim, key_dim)),
               ("summaries", torch.float32, (segments, heads, value_dim + key_dim, key_dim))]
    if save_prep:
        tile = kcfg.query_tile(n_h)
        regions += [("ta", dtype, (chunks, heads, 64, 64)), ("tb", dtype, (chunks, heads, 64, 64)),
                    ("p", dtype, (chunks, heads, tile, 64)), ("scalars", torch.float32, (chunks, heads, 4, 64))]
    if save_chunk_states:
        regions.append(("chunk_states", dtype, (chunks, heads, value_dim, key_dim)))
    table_sizes = sizes.table_sizes()
    return tuple(regions) + tuple((name, torch.int32, (table_sizes[name],)) for name in _TABLES)


def kernel_saved_of(saved: CPSavedContext) -> torch.Tensor | None:
    """The buffer a kernel-backward forward saved after ``make_cp_saved_context``'s nine tensors
    (float32 [words]: ``CuTeDSLGatedDeltaProductCPBackend._saved_regions``), None when it has none."""
    return saved.tensors[9] if saved.metadata.get(_KERNEL_BACKWARD, False) else None


def with_token_flags(saved: CPSavedContext, token_flags) -> CPSavedContext:
    """``saved`` (with the kernel buffer, when kept) with the shard's token flags (``GDPInputs.token_flags``)
    appended and flagged: its inputs are the raw ones. Unchanged for None. The forward and the custom ops'
    backward build it here."""
    if token_flags is None:
        return saved
    return CPSavedContext(saved.tensors + tuple(token_flags), {**saved.metadata, _TOKEN_FLAGS: True})


def token_flags_of(saved: CPSavedContext) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The token flags (state_bad, read_bad) a saved context keeps (``with_token_flags``), or None."""
    return tuple(saved.tensors[-2:]) if saved.metadata.get(_TOKEN_FLAGS, False) else None


def with_kernel_saved(saved: CPSavedContext, buffer: torch.Tensor | None) -> CPSavedContext:
    """``saved`` (``make_cp_saved_context``'s nine tensors) with the kernel backward's buffer appended
    and flagged; unchanged for None. The forward and the custom ops' backward build it here."""
    if buffer is None:
        return saved
    return CPSavedContext(saved.tensors + (buffer,), {**saved.metadata, _KERNEL_BACKWARD: True})


@functools.lru_cache(maxsize=64)
def _region_offsets(regions) -> tuple[dict[str, int], int]:
    """Byte offset of each region and the total, 16-byte aligned: the kernels read Ta, Tb and P with
    16-byte vectors. The int32 tables follow each other unpadded, so one ``torch.cat`` fills them.
    Cached (a step asks three times for the same regions; callers must not modify the dict)."""
    offsets, offset = {}, 0
    for name, dtype, shape in regions:
        if name not in _TABLES or name == _TABLES[0]:
            offset = -(-offset // 16) * 16
        offsets[name] = offset
        offset += math.prod(shape) * dtype.itemsize
    return offsets, -(-offset // 16) * 16


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=64)
def _carve_plan(regions) -> tuple[int, tuple, tuple[str, ...], tuple[int, ...], int, int]:
    """What ``_carve`` needs of ``regions``, from shapes only (cached: forward and backward carve the same
    regions each step) -> (total bytes, (name, dtype, shape, strides, byte offset) of each region before the
    tables, the table names, their sizes, the tables' first int32 word, their words)."""
    offsets, total = _region_offsets(regions)
    views = tuple((name, dtype, shape, _contiguous_strides(shape), offsets[name])
                  for name, dtype, shape in regions if name not in _TABLES)
    tables = tuple((name, math.prod(shape)) for name, _, shape in regions if name in _TABLES)
    sizes = tuple(size for _, size in tables)
    return total, views, tuple(name for name, _ in tables), sizes, offsets[_TABLES[0]] // 4, sum(sizes)


def _carve(buffer: torch.Tensor, regions) -> dict:
    """Typed views of the saved buffer by region name, plus "tables" (every table, one int32 span) and
    "buffer" itself. Few view ops (the forward and the backward each carve once per step): one view
    of the buffer per dtype, one ``as_strided`` per region, one split for the tables."""
    total, regions_before, table_names, table_sizes, first, words = _carve_plan(regions)
    if buffer.numel() * 4 != total:
        raise ValueError(f"the saved kernel buffer holds {buffer.numel() * 4} bytes; its regions need {total}")
    as_dtype = {torch.float32: buffer}
    views = {"buffer": buffer}
    base = buffer.storage_offset() * 4  # as_strided offsets count from the storage's start
    for name, dtype, shape, strides, offset in regions_before:
        if dtype not in as_dtype:
            as_dtype[dtype] = buffer.view(dtype)
        # one as_strided per region (regions start 16-byte aligned) instead of a slice and a view
        views[name] = as_dtype[dtype].as_strided(shape, strides, (base + offset) // dtype.itemsize)
    # one int32 view split into what precedes the tables, the tables and the padding after them (up to
    # three words: the total is 16-byte aligned): one op where a slice per span and a uint8 view took five
    spans = [first, words, buffer.numel() - first - words]
    # (split_with_sizes: the op Tensor.split dispatches to, without its Python wrapper)
    _, views["tables"], views["padding"] = buffer.view(torch.int32).split_with_sizes(spans)
    views.update(zip(table_names, views["tables"].split_with_sizes(table_sizes)))
    return views


_ROWS_LAYOUTS: OrderedDict[tuple, tuple[kl.ForwardLayout, torch.Tensor]] = OrderedDict()
ROWS_LAYOUTS_KEPT = 32  # shapes x devices x flags whose layouts stay cached (least recently used dropped)


def rows_layout(device: torch.device, batch: int, **layout_args) -> tuple[kl.ForwardLayout, torch.Tensor]:
    """``kl.forward_layout`` of ``batch`` rows of equal length (cu_seqlens 0, T, 2T, ...; the other
    arguments as ``forward_layout``'s) -> (layout, its tables as one int32 tensor in ``_TABLES`` order,
    of which the layout's tables are views).

    The tables depend on host ints only, so they are built once per key on the CPU, copied to the
    device without blocking, and kept (the last ``ROWS_LAYOUTS_KEPT``): a training step on rows then
    issues no layout op. Callers must not write into the tables. Under CUDA-graph capture the cache is
    not used: the tables are built on the device into the graph's own memory, so that a replay never
    reads a cached tensor that was dropped since. (A dropped tensor is freed to the stream it was
    copied on; a step on another stream that still reads it would race with its reuse.)"""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (str(device), batch, tuple(sorted(layout_args.items())))
    if key in _ROWS_LAYOUTS and not capturing:
        _ROWS_LAYOUTS.move_to_end(key)
        layout, tables = _ROWS_LAYOUTS[key]
        return replace(layout), tables  # a fresh object: a caller setting a field leaves the cache alone
    build_on = device if capturing else torch.device("cpu")
    tokens = layout_args["total_tokens"] // batch
    cu = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=build_on)
    layout = kl.forward_layout(cu, **layout_args)
    tables = torch.cat([getattr(layout, name) for name in _TABLES])
    if tables.device != device:  # pinned, so that the copy does not wait for the device
        tables = tables.pin_memory().to(device, non_blocking=True)
    layout = replace(layout, **dict(zip(_TABLES, tables.split([getattr(layout, name).numel() for name in _TABLES]))))
    if not capturing:
        _ROWS_LAYOUTS[key] = (layout, tables)
        if len(_ROWS_LAYOUTS) > ROWS_LAYOUTS_KEPT:
            _ROWS_LAYOUTS.popitem(last=False)
    return replace(layout), tables


_KEPT: dict[tuple, torch.Tensor] = {}


def _kept(key: tuple, device: torch.device, make) -> torch.Tensor:
    """``make()`` once per ``key`` and kept (an allocation less per call). Not kept while a CUDA graph is
    captured on ``device``: a fresh one then lives in the graph's memory."""
    tensor = _KEPT.get(key)
    if tensor is None:
        tensor = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _KEPT[key] = tensor
    return tensor


def _token_flags(shard: _Shard) -> dict[str, torch.Tensor]:
    """The chunk launches' ``state_bad`` / ``read_bad`` / ``any_flagged``: the shard's token flags
    (``GDPInputs.token_flags``), or placeholders."""
    return shard.token_flag_arguments(_placeholder(shard.q.device, torch.uint8, (1, 1)),
                                      _placeholder(shard.q.device, torch.int32, (1,)))


@dataclass(frozen=True)
class _FlaggedFallback:
    """The fallback's forward context for inputs with token flags (the kernels did not take them), and those
    inputs (raw, with their flags): apply stores the outputs of read_bad tokens as NaN, as the contained
    output scan does, and keeps the raw inputs and the flags in the saved context."""

    context: object
    inputs: GDPInputs


def _raw_saved(saved: CPSavedContext, inputs: GDPInputs) -> CPSavedContext:
    """The fallback's saved context (``make_cp_saved_context`` of the zeroed inputs) with the raw inputs in
    their place and the flags appended (``with_token_flags``): the form of the kernels' own, which the
    custom ops rebuild from their inputs; the backward zeroes them again (``_flagged_fallback_backward``)."""
    raw = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, *saved.tensors[5:])
    return with_token_flags(CPSavedContext(raw, saved.metadata), inputs.token_flags)


def _flagged_fallback_backward(output_grad, saved: CPSavedContext, token_flags) -> tuple[object, CPSavedContext]:
    """-> (output_grad, saved context) for the fallback's backward of a shard with token flags: its inputs as
    the contained kernels see them (``zero_flagged_inputs``), the output gradient of read_bad tokens zero (a
    poisoned output passes none; the backward kernels zero those dO rows as they load them), the flags off."""
    state_bad, read_bad = token_flags
    metadata = {name: value for name, value in saved.metadata.items() if name != _TOKEN_FLAGS}
    zeroed = zero_flagged_inputs(*saved.tensors[:5], state_bad, read_bad, metadata["num_householder"])
    output_grad = zero_read_bad_grad(output_grad, read_bad)
    return output_grad, CPSavedContext((*zeroed, *saved.tensors[5:9]), metadata)


def _placeholder(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A one-row tensor for a launch argument its mode neither reads nor writes, kept per (device, dtype,
    shape) (``_kept``; the kernels never touch it)."""
    return _kept(("placeholder", device, dtype, shape), device,
                 lambda: torch.empty(shape, dtype=dtype, device=device))


def _kept_zeros(device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 zeros on ``device``, kept per shape (``_kept``); only ever read: the zero start of a fold."""
    return _kept(("zeros", device, shape), device, lambda: torch.zeros(shape, dtype=torch.float32, device=device))


def _no_addend(shard: _Shard) -> torch.Tensor:
    """segment_fold's ``addend`` when add_mode is ADD_NONE (not read): a cached placeholder of its type."""
    return _placeholder(shard.q.device, torch.float32, (1, 1, shard.key_dim, 1))


def _trailing_sequence(cu: torch.Tensor) -> torch.Tensor | int:
    """The trailing sequence of a packed shard: 0 (a host int) for a single sequence, else
    ``_last_nonempty`` on the device."""
    return 0 if cu.shape[0] == 2 else _last_nonempty(cu)


def _last_nonempty(cu: torch.Tensor) -> torch.Tensor:
    """int64 []: index of the last sequence with tokens (0 when none has any), on the device."""
    index = torch.arange(cu.shape[0] - 1, device=cu.device)
    return torch.where(cu[1:] > cu[:-1], index, 0).max()


def _initial_states(inputs: GDPInputs) -> torch.Tensor | None:
    """float32 [N, H, K, V] of ``inputs.initial_state`` (shape checked), or None."""
    kl.check_initial_state_shape(inputs)
    if inputs.initial_state is None:
        return None
    return _cast(inputs.initial_state.detach(), torch.float32, inputs.q.device)


def _packed_backward_stack(following) -> torch.Tensor | None:
    """Stacked backward summaries [n, ..., K, V + K] float32 from any summary form (None when absent)."""
    following = as_packed_array(following)
    if not isinstance(following, torch.Tensor):
        raise ValueError(f"following must be a tensor or a backward summary; received {type(following).__name__}")
    return _contiguous(_cast(following, torch.float32))


def _fold_preceding(stacked: torch.Tensor, start_rows: torch.Tensor | None) -> torch.Tensor:
    """``compose_forward`` in the kernels' row form: the stacked preceding summaries [n >= 1, B', H, K, V + K]
    folded ascending from ``start_rows`` [B', H, V, K] (zero when None) -> [B', H, V, K] contiguous.
    One baddbmm per summary, rows <- E^T + rows M^T: the products of E + M S transposed (M times a zero
    state still gives NaN where M holds NaN or inf), without the fill, dtype copy, add and transposed
    copy the array-API fold costs (small launches the host paced on rank > 0's forward apply)."""
    count, *lead, heads, key_dim, width = stacked.shape
    value_dim = width - key_dim
    batch = math.prod(lead) * heads
    rows_shape = (batch, value_dim, key_dim)
    if start_rows is None:
        rows = _kept_zeros(stacked.device, rows_shape)
    else:
        rows = start_rows.reshape(rows_shape)
    for index in range(count):
        summary = stacked[index].reshape(batch, key_dim, width)
        rows = torch.baddbmm(summary[..., :value_dim].transpose(1, 2), rows, summary[..., value_dim:].transpose(1, 2))
    return rows.view(*lead, heads, value_dim, key_dim)


def _fold_following(stacked: torch.Tensor) -> torch.Tensor:
    """``compose_backward`` in one baddbmm per summary: the stacked following summaries
    [n >= 1, B', H, K, V + K] folded descending from a zero gradient, acc <- gamma + M_b acc
    -> [B', H, K, V] contiguous."""
    count, *lead, heads, key_dim, width = stacked.shape
    value_dim = width - key_dim
    batch = math.prod(lead) * heads
    acc = _kept_zeros(stacked.device, (batch, key_dim, value_dim))
    for index in range(count - 1, -1, -1):
        summary = stacked[index].reshape(batch, key_dim, width)
        acc = torch.baddbmm(summary[..., :value_dim], summary[..., value_dim:], acc)
    return acc.view(*lead, heads, key_dim, value_dim)


def _packed_stack(preceding) -> torch.Tensor | None:
    """Stacked summaries [n, ..., K, V + K] float32 from any summary form (None when absent)."""
    if preceding is None:
        return None
    preceding = as_packed_array(preceding)
    if not isinstance(preceding, torch.Tensor):
        raise ValueError(f"preceding must be a tensor or a forward summary; received {type(preceding).__name__}")
    if preceding.dtype != torch.float32:
        raise ValueError(f"preceding summaries must be float32; received {preceding.dtype}")
    return _contiguous(preceding)

_name_auto_instances()
