"""``CuTeDSLGatedDeltaProductCPBackend`` for JAX: the GDP protocol on the tensor-core kernels of
``cp_linear.kernels``, the same kernels and the same launch plan as the torch backend
(``torch_api/gdp/cutedsl.py``), so both frameworks compute bit for bit the same thing.

A thin adapter, like its torch twin: it flattens the shard, builds the framework-neutral work
layout (``cp_linear.kernels.launch.forward_layout``: one layout-kernel launch for several sequences,
jax.numpy slices for one), and runs each typed launch as
one XLA custom call (``jax_api.gdp.kernel_calls``): the launch's output buffers are the custom
call's results, allocated by XLA; the kernel runs on XLA's stream. Everything is traced, so it
works under ``jax.jit``, inside ``jax.shard_map`` and under ``jax.grad`` (through the custom_vjp
of the frontends), and a new packing is new data, never a new program.

Launch plan of one shard (the torch backend's, launch for launch)::

    prepare   chunk_prep           every chunk: T, P, scalars
              chunk_scan summary   every segment followed by another one, plus (CP) every segment
                                   of the trailing sequence: [E^T ; M^T] from [0 ; I]
              segment_fold         (CP) the trailing sequence's segment summaries -> its [E | M]
    apply     segment_fold         every segment's incoming state (sequence 0 from S_in, the fold of
                                   the preceding summaries; the others from their initial state)
              chunk_scan output    outputs and every segment's end state

A one-device forward that no backward follows (``one_device_forward`` with ``save_for_backward``
False) runs torch's leaner plan: chunk_prep, the summary pass of the segments followed by another
one, segment_fold of V rows from each sequence's initial state (or zero), the output pass.

The backward runs the backward kernels (the default, ``backward="kernels"``, as in torch), or
``JaxGDPBackend``'s float32 recomputation from the saved inputs with ``backward="jax"``. The kernel
backward reads what the forward kept (as torch's saved buffer): the work layout, chunk_prep's results,
the segment summaries and incoming states, the chunk states::

    prepare   chunk_gamma                backward summaries [gamma ; M_b] per segment (M_b = M^T taken
                                         from the forward's summary where it made one)
              segment_fold (descending)  the leading sequence's gamma, every segment's outgoing gradient
    apply     segment_fold (descending)  again only when following summaries change the trailing
                                         sequence's end gradient (CP); else prepare's
              chunk_scan (mode "states"), the reverse scan, chunk_reverse, chunk_prep_backward:
                                         input gradients, dL/d initial state

Inputs the kernels do not take (not a Hopper GPU, float32, K or V outside {64, 128}) run on
``JaxGDPBackend`` after one warning per reason (``fallback=False`` raises instead); summaries are
packed float32 ``[E | M]`` either way.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from cp_linear.gdp import GDPInputGradients, GDPInputs
from cp_linear.kernel_support import AUTO_HOUSEHOLDERS
from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import (
    CPBackwardPackedSummary,
    CPForwardPackedSummary,
    as_packed_array,
    compose_backward,
    compose_forward,
)
from cp_linear.validation import poison_read_bad, without_token_flags, zero_read_bad_grad
from jax_api.gdp import kernel_calls
from jax_api.gdp.chunk import JaxGDPBackend, check_gdp_inputs

KERNEL_DTYPE_NAMES = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}
_KERNEL_BACKWARD = "kernel_backward"  # saved-context flag: the kernels' backward reads the segment states
_SEGMENT_CHUNKS = "segment_chunks"  # saved-context metadata of the kernel backward: the kept layout's segment size
_READ_BAD = "read_bad"  # saved-context flag of a JaxGDPBackend backward on flagged inputs: read_bad rides last
_F32 = jnp.float32
DEFAULT_SM_COUNT = 132  # an H100 / H200, where a device does not report its SM count


# --------------------------------------------------------------------------- where the kernels run


@functools.lru_cache(maxsize=None)
def kernel_platform_reason() -> str | None:
    """Why this process cannot run the kernels (None when it can): they need a Hopper (sm_90) GPU
    as JAX's default backend, nvidia-cutlass-dsl and jax-tvm-ffi (the ``cuda`` extra)."""
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda"):
        return f"the kernels need a CUDA GPU; JAX's default backend is {backend}"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9."):
        return f"the kernels are built for sm_90a (Hopper); the GPU reports compute capability {capability or '?'}"
    for module in ("cutlass", "jax_tvm_ffi"):
        if importlib.util.find_spec(module) is None:
            return f"the kernels need the {module} package (pip install 'cp_linear[cuda]')"
    return None


def unsupported_reason(q, k, v, num_householder: int) -> str | None:
    """Why the kernels cannot run these inputs here (None when they can)."""
    reason = kernel_platform_reason()
    if reason is not None:
        return reason
    if jnp.dtype(q.dtype) not in KERNEL_DTYPE_NAMES:
        return f"the kernels take bfloat16 or float16 q/k/v; received {jnp.dtype(q.dtype).name}"
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    if key_dim not in kcfg.HEAD_DIMS or value_dim not in kcfg.HEAD_DIMS:
        return f"the kernels support K, V in {kcfg.HEAD_DIMS}; received K = {key_dim}, V = {value_dim}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k and v must share one dtype"
    if not 1 <= num_householder <= kcfg.CHUNK_SIZE:
        return f"the kernels take num_householder in [1, {kcfg.CHUNK_SIZE}]; received {num_householder}"
    return None


def auto_backend(q, k, v, num_householder: int):
    """The backend the JAX ops use when none is given: the kernels where they can run these inputs
    (a Hopper GPU, bf16/fp16, K and V in {64, 128}, n_h in ``cp_linear.kernel_support.AUTO_HOUSEHOLDERS``
    as in torch), else ``JaxGDPBackend``."""
    if unsupported_reason(q, k, v, num_householder) is None and num_householder in AUTO_HOUSEHOLDERS:
        return CuTeDSLGatedDeltaProductCPBackend()
    return JaxGDPBackend()


def _sm_count() -> int:
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if count else DEFAULT_SM_COUNT


# --------------------------------------------------------------------------- shards and contexts


def _flat(x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B*T, ...]"""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@dataclass
class _Shard(kl.KernelShard):
    """``kl.KernelShard`` with the per-chunk prep results."""

    trailing: jax.Array | None  # int32 []: the last nonempty sequence (packed shards)
    ta: jax.Array = None  # [C_max, H, 64, 64]
    tb: jax.Array = None
    p: jax.Array = None  # [C_max, H, NQ, 64]
    scalars: jax.Array = None  # [C_max, H, 4, 64] float32
    summaries: jax.Array = None  # [S_max, H, V + K, K] float32 ([E^T ; M^T] per segment)

    @property
    def dtype(self) -> str:
        return KERNEL_DTYPE_NAMES[jnp.dtype(self.q.dtype)]

    def tables(self, *names: str) -> dict[str, jax.Array]:
        return {name: getattr(self.layout, name) for name in names}


CuTeDSLForwardContext = kl.KernelForwardContext
CuTeDSLBackwardContext = kl.KernelBackwardContext


# --------------------------------------------------------------------------- the backend


@dataclass(frozen=True)
class CuTeDSLGatedDeltaProductCPBackend:
    """GDP chunkwise-CP backend on the tensor-core CuTeDSL kernels (sm_90a), for JAX.

    Options as the torch backend's: ``segment_chunks`` (chunks per segment; None sizes segments so
    that one long sequence gives about ``ctas_per_sm`` output CTAs per SM), ``row_block`` (state rows
    per scan CTA, 0: ``launch.scan_row_block``'s measured choice), ``mma`` ("auto", "sync" or "wgmma"),
    ``fallback`` (False: raise on inputs the kernels do not take). ``backward``: "kernels" (default:
    the backward kernels from the segments' saved incoming states, checked on an H200 as the torch
    backend's) or "jax" (``JaxGDPBackend``'s recomputation from the saved inputs). ``sm_count``: SMs
    to size segments for (None: the device's). ``cuda_graph``: let XLA capture the custom calls in
    its command buffers. ``save_chunk_states`` (kernel backward): the forward's output pass keeps every
    chunk's start state as a residual (C_max x H x V x K in the input dtype) and the backward reads it,
    as the torch backend's default; False recomputes them in the backward (bitwise the same values).
    A forward that no gradient follows (the custom_vjp's primal; ``GDPInputs.save_for_backward``)
    keeps none.
    Frozen and hashable: an argument of ``jax.jit`` / ``custom_vjp`` like ``JaxGDPBackend``.
    """

    segment_chunks: int | None = None
    row_block: int = 0
    ctas_per_sm: float = 2
    fallback: bool = True
    mma: str = "auto"
    backward: str = "kernels"
    sm_count: int | None = None
    cuda_graph: bool = False
    save_chunk_states: bool = True
    _warned: set = field(default_factory=set, compare=False, hash=False, repr=False)

    supports_sequence_states = True
    zeroes_flagged_rows = True  # takes GDPInputs.token_flags: contained chunk kernels, no sanitised copies

    def __post_init__(self):
        if self.segment_chunks is not None and (not isinstance(self.segment_chunks, int) or self.segment_chunks < 1):
            raise ValueError(f"segment_chunks must be a positive int or None; received {self.segment_chunks!r}")
        if self.row_block not in (0, 64, 128):
            raise ValueError(f"row_block must be 0 (automatic), 64 or 128; received {self.row_block!r}")
        if not self.ctas_per_sm > 0:
            raise ValueError(f"ctas_per_sm must be positive; received {self.ctas_per_sm!r}")
        if self.mma != "auto" and self.mma not in kcfg.MMA_KINDS:
            raise ValueError(f"mma must be 'auto' or one of {kcfg.MMA_KINDS}; received {self.mma!r}")
        if self.backward not in ("jax", "kernels"):
            raise ValueError(f"backward must be 'jax' or 'kernels'; received {self.backward!r}")
        if self.sm_count is not None and (not isinstance(self.sm_count, int) or self.sm_count < 1):
            raise ValueError(f"sm_count must be a positive int or None; received {self.sm_count!r}")

    @property
    def _fallback(self) -> JaxGDPBackend:
        return JaxGDPBackend()

    def _use_kernels(self, inputs: GDPInputs) -> bool:
        """True when the kernels take ``inputs``; else warn once per reason (or raise without fallback)."""
        check_gdp_inputs(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.num_householder,
                         inputs.cu_seqlens)
        return kl.kernels_take(unsupported_reason(inputs.q, inputs.k, inputs.v, inputs.num_householder),
                               fallback=self.fallback, warned=self._warned, fallback_name="JaxGDPBackend")

    # ------------------------------------------------------------------ launches

    def _launch(self, launch_cls, config, inputs, results, scalars) -> dict[str, jax.Array]:
        return kernel_calls.launch(launch_cls, config, inputs=inputs, results=results, scalars=scalars,
                                   cuda_graph=self.cuda_graph)

    def _shard(self, inputs: GDPInputs, *, cp_summary: bool, summaries: bool = True,
               grad_summary_sequence: int | None = None) -> _Shard:
        """The shard's work layout, chunk_prep, and (``summaries``) the summary pass."""
        q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
        batch, tokens = inputs.q.shape[:2]
        heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
        rows = inputs.cu_seqlens is None
        if rows:
            cu = jnp.arange(0, (batch + 1) * tokens, tokens, dtype=jnp.int32)
        else:
            cu = jnp.asarray(inputs.cu_seqlens, jnp.int32)
        n_h = inputs.num_householder
        dtype = KERNEL_DTYPE_NAMES[jnp.dtype(q.dtype)]
        row_block, row_blocks = _scan_rows(dtype, key_dim, value_dim, n_h, self.row_block)
        layout, trailing = self._layout(cu, rows=rows, total_tokens=q.shape[0], num_householder=n_h, heads=heads,
                                        row_blocks=row_blocks, cp_summary=cp_summary,
                                        grad_summary_sequence=grad_summary_sequence,
                                        values_only_from=kl.values_only_from(
                                            rows=rows, cp_summary=cp_summary,
                                            initial_states=inputs.initial_state is not None))
        shard = _Shard(inputs=inputs, rows=rows, q=q, k=k, v=v, layout=layout, row_block=row_block, trailing=trailing)
        chunks, tile = layout.max_chunks, shard.query_tile
        prep = self._launch(
            kl.ChunkPrepLaunch, kcfg.ChunkPrepConfig(dtype, key_dim, tile, shard.contained),
            dict(q=q, k=k, g=_flat(inputs.g).astype(_F32), beta=_flat(inputs.beta).astype(_F32),
                 **shard.tables("chunk_first_step", "chunk_steps", "num_chunks"), **_token_flags(shard)),
            dict(ta=(chunks, heads, 64, 64), tb=(chunks, heads, 64, 64), p=(chunks, heads, tile, 64),
                 scalars=(chunks, heads, 4, 64)),
            dict(scale=float(inputs.scale), use_l2=int(bool(inputs.use_qk_l2norm_in_kernel)), num_householder=n_h))
        shard.ta, shard.tb, shard.p, shard.scalars = prep["ta"], prep["tb"], prep["p"], prep["scalars"]
        if summaries:  # mode "summary" reads neither state_in nor o: tiny placeholders of the right type
            # a kernel backward that follows saves the summaries: every row defined (zero where no summary)
            shard.summaries = self._scan(shard, "summary", state_in=jnp.zeros((1, 1, value_dim, key_dim), _F32),
                                         o_shape=(1, 1, value_dim),
                                         clear_unsummarised=self._saves(inputs))["state_out"]
        return shard

    def _saves(self, inputs: GDPInputs) -> bool:
        """A kernel backward follows this forward: it keeps the layout, prep results and summaries."""
        return self.backward == "kernels" and inputs.save_for_backward

    def _layout(self, cu: jax.Array, *, rows: bool, total_tokens: int, num_householder: int, heads: int,
                row_blocks: int, cp_summary: bool, grad_summary_sequence: int | None,
                values_only_from: int | None) -> tuple[kl.ForwardLayout, jax.Array | None]:
        """-> (``kl.forward_layout``'s tables, the trailing sequence: the last nonempty one, int32 [], for a
        packed shard's CP summary, else None). A packing of several sequences: one ``ForwardLayoutLaunch``,
        as torch's (in jax.numpy the tables take ~20 small ops, sequence searches and a sort among them);
        one sequence (slices, no search) or rows (``cu_seqlens`` a constant, so XLA folds the tables into
        constants): jax.numpy."""
        sizes_args = dict(total_tokens=total_tokens, num_householder=num_householder, heads=heads,
                          row_blocks=row_blocks, sm_count=self.sm_count or _sm_count(),
                          segment_chunks=self.segment_chunks, ctas_per_sm=self.ctas_per_sm)
        # rows: every row continues on the next rank (CP summaries of every segment) and every row leads
        # (backward summaries of every segment)
        flags = dict(grad_summary_sequence=grad_summary_sequence, every_segment_summary=cp_summary and rows,
                     every_segment_grad_summary=grad_summary_sequence is not None and rows,
                     values_only_from=values_only_from)
        num_sequences = cu.shape[0] - 1
        summarises_trailing = cp_summary and not rows
        if not rows and num_sequences > 1 and kl.ForwardLayoutLaunch.takes(num_sequences):
            sizes = kl.layout_sizes(num_sequences=num_sequences, **sizes_args)
            results = {name: (size,) for name, size in sizes.table_sizes().items()}
            scalars = kl.ForwardLayoutLaunch.scalars(
                num_householder=num_householder, sizes=sizes,
                summary_sequence=kcfg.TRAILING_SEQUENCE if summarises_trailing else None, **flags)
            out = self._launch(kl.ForwardLayoutLaunch, kcfg.ForwardLayoutConfig(), dict(cu_seqlens=cu),
                               dict(results, trailing=(1,)), scalars)
            layout = sizes.layout(num_householder, {name: out[name] for name in kl.LAYOUT_TABLES})
            return layout, out["trailing"].reshape(()) if summarises_trailing else None
        trailing = _last_nonempty(cu) if summarises_trailing else None
        return kl.forward_layout(cu, summary_sequence=trailing, **flags, **sizes_args), trailing

    def _saved_shard(self, inputs: GDPInputs, trailing, prep: tuple, tables: tuple, segment_chunks: int) -> _Shard:
        """The backward's shard from what the forward kept: its layout tables (built with the backward's
        flags) and its prep results. No layout build, no chunk_prep (torch's ``_saved_shard``)."""
        q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
        n_h = inputs.num_householder
        row_block, _ = _scan_rows(KERNEL_DTYPE_NAMES[jnp.dtype(q.dtype)], q.shape[2], v.shape[2], n_h, self.row_block)
        named = dict(zip(kl.LAYOUT_TABLES, tables))
        sizes = kl.LayoutSizes(kcfg.tokens_per_chunk(n_h), segment_chunks, max_chunks=prep[0].shape[0],
                               max_segments=named["seg_flags"].shape[0], num_sequences=named["seq_segments"].shape[0])
        layout = sizes.layout(n_h, named)
        ta, tb, p, scalars = prep
        return _Shard(inputs=inputs, rows=inputs.cu_seqlens is None, q=q, k=k, v=v, layout=layout,
                      row_block=row_block, trailing=trailing, ta=ta, tb=tb, p=p, scalars=scalars)

    def _scan(self, shard: _Shard, mode: str, *, state_in, o_shape: tuple, clear_unsummarised: bool = False) -> dict:
        """chunk_scan -> {"state_out": the segment summaries [S_max, H, V + K, K] (mode "summary"), or the
        sequences' final states [N, H, K, V] (the output modes: an empty sequence's row is not written), or
        a one-row placeholder (mode "states"); all float32; "o": ``o_shape``; "chunk_states": [C_max, H, V K]
        (modes "states" and "output_states"; a one-row placeholder otherwise)}."""
        layout, heads, key_dim, value_dim = shard.layout, shard.heads, shard.key_dim, shard.value_dim
        state_out_shape = {"summary": (layout.max_segments, heads, value_dim + key_dim, key_dim),
                           "states": (1, 1, key_dim, value_dim)}.get(mode, (layout.num_sequences, heads, key_dim,
                                                                           value_dim))
        tile = shard.query_tile if mode in kcfg.OUTPUT_MODES else 0
        state_size = shard.value_dim * shard.key_dim
        chunk_states_shape = (layout.max_chunks, heads, state_size) if mode in ("states", "output_states") else (
            1, 1, state_size)
        out = self._launch(
            kl.ChunkScanLaunch,
            kcfg.ChunkScanConfig(shard.dtype, shard.key_dim, shard.value_dim, mode, tile, shard.row_block,
                                  kl.scan_mma(self.mma, shard.dtype, shard.key_dim, shard.value_dim),
                                  shard.contained),
            dict(k=shard.k, v=shard.v, q=shard.q, ta=shard.ta, tb=shard.tb, p=shard.p, scalars=shard.scalars,
                 **shard.tables("chunk_first_step", "chunk_steps", "seg_first_chunk", "seg_chunks", "seg_order",
                                "seg_flags", "num_segments", "seq_first_segment"), state_in=state_in,
                 **_token_flags(shard)),
            dict(state_out=state_out_shape, o=o_shape, chunk_states=chunk_states_shape),
            dict(num_householder=shard.inputs.num_householder, clear_unsummarised=int(clear_unsummarised)))
        return out

    def _fold(self, shard: _Shard, summaries: jax.Array, *, init: jax.Array | None, init_count: int, rows: int,
              write_final: int, descending: bool, transition_count: int = 0) -> tuple[jax.Array, jax.Array | None]:
        """segment_fold -> (incoming [S_max, H, rows, K], final [N, H, rows, K] or None); ``write_final``:
        ``kl.FINAL_NONE``, ``FINAL_EVERY``, ``FINAL_TRAILING`` (only the trailing sequences' rows) or
        ``FINAL_LEADING`` (only sequence 0's, into final [1, ...]); rows from V on are folded only for
        sequences below ``transition_count`` and those writing final rows (the others' are not written)."""
        heads, key_dim, layout = shard.heads, shard.key_dim, shard.layout
        if init is None:  # read only for sequences below init_count (none)
            init = jnp.zeros((1, heads, rows, key_dim), _F32)
        out = self._launch(
            kl.SegmentFoldLaunch,
            kl.fold_config(key_dim, layout.num_sequences, heads, rows, self.sm_count or _sm_count()),
            dict(summaries=summaries, seq_first_segment=layout.seq_first_segment, init=init,
                 addend=_no_addend(key_dim)),
            dict(incoming=(layout.max_segments, heads, rows, key_dim),
                 final=(layout.num_sequences if write_final in (kl.FINAL_EVERY, kl.FINAL_TRAILING) else 1, heads,
                        rows, key_dim)),
            dict(init_count=init_count, value_rows=shard.value_dim, identity_row=shard.value_dim,
                 transition_count=transition_count, add_mode=kl.ADD_NONE, write_final=write_final,
                 descending=int(descending)))
        return out["incoming"], out["final"] if write_final else None

    def _apply_affine(self, shard: _Shard, incoming_affine: jax.Array, init: jax.Array | None,
                      init_count: int) -> jax.Array:
        """segment_fold mode "apply_affine" -> every segment's incoming state [S_max, H, V, K]: the
        prefix maps [S_max, H, V + K, K] applied to ``init`` (the start rows of the first ``init_count``
        sequences; the others start from zero); unused segments' rows are zero."""
        heads, key_dim, value_dim, layout = shard.heads, shard.key_dim, shard.value_dim, shard.layout
        if init is None:  # read only for sequences below init_count (none)
            init = jnp.zeros((1, heads, value_dim, key_dim), _F32)
        out = self._launch(
            kl.SegmentFoldLaunch, kcfg.SegmentFoldConfig(key_dim, "apply_affine"),
            dict(summaries=incoming_affine, seq_first_segment=layout.seq_first_segment, init=init,
                 addend=_no_addend(key_dim)),
            dict(incoming=(layout.max_segments, heads, value_dim, key_dim), final=(1, heads, value_dim, key_dim)),
            dict(init_count=init_count, value_rows=value_dim, identity_row=value_dim, transition_count=0,
            add_mode=kl.ADD_NONE,
                 write_final=kl.FINAL_NONE, descending=0))
        return out["incoming"]

    def _output(self, shard: _Shard, incoming: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """chunk_scan output -> (o [B, T, H, V], final state of every sequence [N, H, K, V] float32 (an empty
        sequence's row unwritten: ``_final_states`` fills it), the chunk states [C_max, H, V, K] in the input
        dtype when the kernel backward keeps them, else None)."""
        keep = self.backward == "kernels" and self.save_chunk_states and shard.inputs.save_for_backward
        out = self._scan(shard, "output_states" if keep else "output", state_in=incoming,
                         o_shape=(shard.q.shape[0], shard.heads, shard.value_dim))
        batch, tokens = shard.inputs.q.shape[:2]
        chunk_states = None
        if keep:
            chunk_states = out["chunk_states"].reshape(shard.layout.max_chunks, shard.heads, shard.value_dim,
                                                       shard.key_dim)
        return out["o"].reshape(batch, tokens, shard.heads, shard.value_dim), out["state_out"], chunk_states

    # ------------------------------------------------------------------ forward protocol

    def cp_forward_prepare(self, inputs: GDPInputs):
        """Chunk prep, the summary pass and the fold of every sequence's segments (each segment's prefix
        map, kept for apply) -> the trailing sequence's packed ``[E | M]`` (M = 0 and E + M S0 for its
        ``inputs.initial_state`` row S0 when the trailing sequence starts inside the shard)."""
        if not self._use_kernels(inputs):
            summary, context = self._fallback.cp_forward_prepare(without_token_flags(inputs))
            return summary, context if inputs.token_flags is None else _FlaggedFallback(context, inputs.token_flags[1])
        initial = _initial_states(inputs)
        # a kernel backward keeps this layout: build it with the backward's flags (the leading sequence's
        # backward summaries, grad_summary_sequence 0), which the forward's kernels do not read
        shard = self._shard(inputs, cp_summary=True, grad_summary_sequence=0 if self._saves(inputs) else None)
        value_dim = shard.value_dim
        # every sequence's fold from [0 ; I] (as torch's): the per-segment prefix maps serve apply (its
        # transition rows only where a state enters: the leading sequence, every row, every initial state),
        # the trailing sequence's final rows (its index is data here) are its summary
        every = shard.rows or initial is not None
        incoming_affine, stacked_rows = self._fold(shard, shard.summaries, init=None, init_count=0,
                                                   rows=value_dim + shard.key_dim,
                                                   write_final=kl.FINAL_EVERY if shard.rows else kl.FINAL_TRAILING,
                                                   descending=False,
                                                   transition_count=shard.layout.num_sequences if every else 1)
        trailing = slice(None) if shard.rows else shard.trailing[None]
        summary = jnp.swapaxes(stacked_rows[trailing], -1, -2)  # [n, H, K, V + K] = [E | M]
        if initial is not None and not shard.rows:
            # a trailing sequence starting here carries its S0 in E (E + M S0); a leading one's S0 stays
            # out: under CP the ranks it continues on fold the summaries from it (GDPInputs)
            carried = _matmul(summary[..., value_dim:], initial[trailing])
            summary = summary.at[..., :value_dim].add(jnp.where(shard.trailing > 0, carried, 0.0))
        if not shard.rows:  # M = 0 when the trailing sequence starts inside the shard
            summary = summary.at[..., value_dim:].set(jnp.where(shard.trailing > 0, 0.0, summary[..., value_dim:]))
        packed = summary if shard.rows else summary[0]
        return CPForwardPackedSummary(packed), CuTeDSLForwardContext(shard, summary, initial, incoming_affine)

    def cp_forward_apply(self, local_context, preceding) -> CPForwardResult:
        """Every segment's incoming state from prepare's prefix maps (applied to the fold of
        ``preceding`` for the leading sequence, to ``initial_state``, or to zero), then the output pass;
        ``(o, final_state)`` when the inputs ask for final states."""
        if isinstance(local_context, _FlaggedFallback):  # the fallback's, on inputs with token flags
            output, saved = self._fallback.cp_forward_apply(local_context.context, preceding)
            return CPForwardResult(poison_read_bad(output, local_context.read_bad),
                                   _with_read_bad(saved, local_context.read_bad))
        if not isinstance(local_context, CuTeDSLForwardContext):  # prepared by the fallback
            return self._fallback.cp_forward_apply(local_context, preceding)
        shard, summary, initial = local_context.shard, local_context.summary, local_context.initial
        inputs, value_dim = shard.inputs, shard.value_dim
        stacked = _packed_stack(preceding)
        leading_count = summary.shape[0] if shard.rows else 1
        if stacked is not None and stacked.shape[0]:
            kl.check_preceding_summaries(stacked.shape, summary.shape, rows=shard.rows)
            start = None if initial is None else initial[:leading_count]  # the leading sequence's S0
            with jax.default_matmul_precision("highest"):
                leading_state = compose_forward(stacked.reshape(stacked.shape[0], *summary.shape), start)
            if initial is None:
                init, init_count = jnp.swapaxes(leading_state, -1, -2), leading_count
            else:  # the other local sequences start from their own initial states
                init = jnp.swapaxes(jnp.concatenate([leading_state, initial[leading_count:]]), -1, -2)
                init_count = initial.shape[0]
        elif initial is not None:
            init, init_count = jnp.swapaxes(initial, -1, -2), initial.shape[0]
        else:
            init, init_count = None, 0
        incoming = self._apply_affine(shard, local_context.incoming_affine, init, init_count)
        output, final_state, chunk_states = self._output(shard, incoming)
        if inputs.output_final_state:
            start = initial if initial is not None else jnp.zeros(inputs.state_shape, _F32)
            output = (output, _final_states(shard, final_state, start))
        if self.backward == "kernels":  # the segments' incoming states: the reverse pass restarts from them
            transition = summary[..., value_dim:]
            # the segment summaries [S_max, H, V + K, K] (zero rows where none): chunk_gamma copies their
            # transition rows, transposed (M_b = M^T), for the segments flagged kl.FORWARD_TRANSITION_FLAG
            saved = CPSavedContext(
                tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens,
                         transition if shard.rows else transition[0], inputs.initial_state, incoming,
                         shard.summaries, chunk_states, shard.trailing, shard.ta, shard.tb, shard.p, shard.scalars,
                         *(inputs.token_flags or (None, None)),
                         *(getattr(shard.layout, name) for name in kl.LAYOUT_TABLES)),
                metadata={"scale": inputs.scale, "num_householder": inputs.num_householder,
                          "use_qk_l2norm_in_kernel": inputs.use_qk_l2norm_in_kernel,
                          "output_final_state": inputs.output_final_state, _KERNEL_BACKWARD: True,
                          _SEGMENT_CHUNKS: shard.layout.segment_chunks})
        else:  # JaxGDPBackend's backward recomputes from the inputs and the incoming state
            saved = self._fallback.saved_context(without_token_flags(inputs), preceding)
            if inputs.token_flags is not None:
                saved = _with_read_bad(saved, inputs.token_flags[1])
        return CPForwardResult(output, saved)

    # ------------------------------------------------------------------ one device

    def one_device_forward(self, inputs: GDPInputs, initial_state: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array, CPSavedContext | None]:
        """-> (o [B, T, H, V], final_state float32 [N, H, K, V], saved context): the four functions with
        no neighbours, as the torch backend's. When ``inputs.save_for_backward`` is False and the kernels
        take the inputs, the leaner plan of ``_inference_forward`` runs and the saved context is None."""
        inputs = replace(inputs, initial_state=initial_state, output_final_state=True)
        if not inputs.save_for_backward and self._use_kernels(inputs):
            output, final_state = self._inference_forward(inputs)
            return output, final_state, None
        summary, local = self.cp_forward_prepare(inputs)
        # an empty neighbour stack, not None: the fallback's apply (JaxGDPBackend) folds it
        preceding = jnp.zeros((0, *as_packed_array(summary).shape), as_packed_array(summary).dtype)
        (output, final_state), saved = self.cp_forward_apply(local, preceding)
        return output, final_state, saved

    def _inference_forward(self, inputs: GDPInputs) -> tuple[jax.Array, jax.Array]:
        """The one-device forward when no backward follows (torch's ``_inference_forward``, launch for
        launch): chunk_prep, the summary pass of the segments followed by another one, segment_fold of V
        rows from each sequence's start state (its initial state, or zero) writing every segment's
        incoming state (FINAL_NONE: a sequence's last segment has no summary), the output pass."""
        initial = _initial_states(inputs)
        shard = self._shard(inputs, cp_summary=False)
        value_dim = shard.value_dim
        init = None if initial is None else jnp.swapaxes(initial, -1, -2)  # the kernel's rows [N, H, V, K]
        incoming, _ = self._fold(shard, shard.summaries, init=init, init_count=0 if initial is None else
                                 initial.shape[0], rows=value_dim, write_final=kl.FINAL_NONE,
                                 descending=False)
        output, final_state, _ = self._output(shard, incoming)
        start = initial if initial is not None else jnp.zeros(inputs.state_shape, _F32)
        return output, _final_states(shard, final_state, start)

    # ------------------------------------------------------------------ backward protocol

    def cp_backward_prepare(self, output_grad, saved_context: CPSavedContext):
        """The leading fragment's packed ``[gamma | M^T]`` from a zero outgoing gradient: on the backward
        kernels when the forward saved the segment states (``backward="kernels"``), else
        ``JaxGDPBackend.cp_backward_prepare``."""
        metadata = dict(saved_context.metadata)
        if not metadata.pop(_KERNEL_BACKWARD, False):
            return self._fallback.cp_backward_prepare(*_without_read_bad(output_grad, saved_context))
        segment_chunks = metadata.pop(_SEGMENT_CHUNKS)
        (q, k, v, g, beta, cu_seqlens, transition, initial_state, incoming, segment_summaries, chunk_states,
         trailing, ta, tb, p, scalars, state_bad, read_bad, *tables) = saved_context.tensors
        token_flags = None if state_bad is None else (state_bad, read_bad)
        inputs = GDPInputs(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                           token_flags=token_flags, **metadata)
        output_grad, final_grad = output_grad if inputs.output_final_state else (output_grad, None)
        # the forward's layout (its seg_flags say which transitions it kept) and prep results
        shard = self._saved_shard(inputs, trailing, (ta, tb, p, scalars), tuple(tables), segment_chunks)
        layout, heads, key_dim, value_dim = shard.layout, shard.heads, shard.key_dim, shard.value_dim
        if output_grad is None:
            do = jnp.zeros((shard.q.shape[0], heads, value_dim), shard.q.dtype)
        else:
            expected = (*inputs.q.shape[:3], value_dim)
            if tuple(output_grad.shape) != expected:
                raise ValueError(f"output_grad must have shape {expected}; received {tuple(output_grad.shape)}")
            do = _flat(output_grad.astype(shard.q.dtype))
        end_grads = jnp.zeros((layout.num_sequences, heads, value_dim, key_dim), _F32)
        if final_grad is not None:
            end_grads = end_grads + jnp.swapaxes(final_grad.astype(_F32), -1, -2)
        grad_summaries = self._gamma(shard, do, segment_summaries)
        # the summary's gamma: every row's start, or the leading sequence's (packed: the others skip a map)
        grad_out, gamma_rows = self._fold(shard, grad_summaries, init=end_grads, init_count=layout.num_sequences,
                                          rows=value_dim, descending=True,
                                          write_final=kl.FINAL_EVERY if shard.rows else kl.FINAL_LEADING)
        gamma = jnp.swapaxes(gamma_rows if shard.rows else gamma_rows[0], -1, -2)
        summary = jnp.concatenate([gamma, jnp.swapaxes(transition, -1, -2)], axis=-1)
        context = CuTeDSLBackwardContext(shard, do, grad_summaries, incoming, end_grads, grad_out, chunk_states)
        return CPBackwardPackedSummary(summary), context

    def cp_backward_apply(self, backward_context, following) -> GDPInputGradients:
        """Input gradients: the trailing sequence's outgoing gradient (every row's) is the fold of the
        following summaries; each segment's comes from the descending fold, then the reverse pass and
        the prep backward (or ``JaxGDPBackend.cp_backward_apply``)."""
        if not isinstance(backward_context, CuTeDSLBackwardContext):
            return self._fallback.cp_backward_apply(backward_context, following)
        ctx = backward_context
        shard, end_grads, grad_out = ctx.shard, ctx.end_grads, ctx.grad_out
        layout, inputs = shard.layout, shard.inputs
        stacked = _packed_backward_stack(following)
        if stacked is not None and stacked.shape[0]:
            with jax.default_matmul_precision("highest"):
                outgoing = jnp.swapaxes(compose_backward(stacked), -1, -2)  # [H, V, K] or [B, H, V, K] (rows)
            end_grads = end_grads + outgoing if shard.rows else end_grads.at[shard.trailing].add(outgoing)
            grad_out, _ = self._fold(shard, ctx.grad_summaries, init=end_grads, init_count=layout.num_sequences,
                                     rows=shard.value_dim, write_final=kl.FINAL_NONE,
                                     descending=True)
        grads, grad_in = self._reverse(shard, ctx.do, ctx.incoming, grad_out, ctx.chunk_states)
        if inputs.initial_state is None:
            return grads
        # d initial state: the gradient entering each sequence's first segment (an empty one passes its end's)
        first_segment = jnp.minimum(layout.seq_first_segment[:-1], layout.max_segments - 1)
        d_initial = jnp.take(grad_in, first_segment, axis=0)
        empty = (layout.seq_segments == 0)[:, None, None, None]
        d_initial = jnp.swapaxes(jnp.where(empty, end_grads, d_initial), -1, -2)
        return grads._replace(dinitial_state=d_initial.astype(inputs.initial_state.dtype))

    def _gamma(self, shard: _Shard, do: jax.Array, segment_summaries: jax.Array) -> jax.Array:
        """chunk_gamma -> backward summaries [S_max, H, V + K, K] of the segments in ``seg_grad_flags``; the
        transition rows of those the forward summarised are from ``segment_summaries`` [S_max, H, V + K, K]
        (the forward's, transposed)."""
        layout = shard.layout
        out = self._launch(
            kl.ChunkGammaLaunch, kcfg.ChunkGammaConfig(shard.dtype, shard.key_dim, shard.value_dim, shard.query_tile,
                                                       kl.gradient_rows_mma(self.mma), shard.contained),
            dict(k=shard.k, q=shard.q, do=do, ta=shard.ta, p=shard.p, scalars=shard.scalars,
                 **shard.tables("chunk_first_step", "chunk_steps", "seg_first_chunk", "seg_chunks", "seg_order"),
                 seg_flags=layout.seg_grad_flags, num_segments=layout.num_segments,
                 forward_summaries=segment_summaries, **_token_flags(shard)),
            dict(summaries=(layout.max_segments, shard.heads, shard.value_dim + shard.key_dim, shard.key_dim)),
            dict(num_householder=shard.inputs.num_householder))
        return out["summaries"]

    def _reverse(self, shard: _Shard, do: jax.Array, incoming: jax.Array, grad_out: jax.Array,
                 chunk_states: jax.Array | None):
        """The chunk states (the forward's, or chunk_scan mode "states" when it kept none), the
        state-gradient pass, chunk_reverse, then chunk_prep_backward -> (GDPInputGradients, dX at every
        segment start)."""
        layout, inputs = shard.layout, shard.inputs
        heads, key_dim, value_dim, tile = shard.heads, shard.key_dim, shard.value_dim, shard.query_tile
        chunks, tokens_all, steps_all = layout.max_chunks, shard.q.shape[0], shard.k.shape[0]
        if chunk_states is None:
            chunk_states = self._scan(shard, "states", state_in=incoming,
                                      o_shape=(1, 1, value_dim))["chunk_states"].reshape(chunks, heads, value_dim,
                                                                                         key_dim)
        scan = self._launch(
            kl.ChunkReverseScanLaunch,
            kcfg.ChunkReverseScanConfig(shard.dtype, key_dim, value_dim, tile, 0, kl.gradient_rows_mma(self.mma),
                                        shard.contained),
            dict(k=shard.k, q=shard.q, do=do, ta=shard.ta, p=shard.p, scalars=shard.scalars,
                 **shard.tables("chunk_first_step", "chunk_steps", "seg_first_chunk", "seg_chunks", "seg_order",
                                "num_segments"),
                 grad_out=grad_out, **_token_flags(shard)),
            dict(chunk_grads=(chunks, heads, value_dim, key_dim), grad_in=grad_out.shape),
            dict(num_householder=inputs.num_householder))
        reverse = self._launch(
            kl.ChunkReverseLaunch,
            kcfg.ChunkReverseConfig(shard.dtype, key_dim, value_dim, tile, kl.reverse_mma(self.mma, value_dim),
                                    shard.contained),
            dict(k=shard.k, v=shard.v, q=shard.q, do=do, ta=shard.ta, tb=shard.tb, p=shard.p, scalars=shard.scalars,
                 **shard.tables("chunk_first_step", "chunk_steps", "num_chunks"),
                 chunk_states=chunk_states, chunk_grads=scan["chunk_grads"], **_token_flags(shard)),
            dict(dv=(steps_all, heads, value_dim), dq_scan=(tokens_all, heads, key_dim),
                 dk_scan=(steps_all, heads, key_dim), d_ta=(chunks, heads, 64, 64), d_tb=(chunks, heads, 64, 64),
                 d_p=(chunks, heads, tile, 64), d_scalars=(chunks, heads, 4, 64)),
            dict(num_householder=inputs.num_householder))
        prep = self._launch(
            kl.ChunkPrepBackwardLaunch, kcfg.ChunkPrepBackwardConfig(shard.dtype, key_dim, tile, shard.contained),
            dict(q=shard.q, k=shard.k, g=_flat(inputs.g).astype(_F32), beta=_flat(inputs.beta).astype(_F32),
                 **shard.tables("chunk_first_step", "chunk_steps", "num_chunks"), **_token_flags(shard),
                 **{name: reverse[name] for name in ("d_ta", "d_tb", "d_p", "d_scalars", "dq_scan", "dk_scan")}),
            dict(dq=(tokens_all, heads, key_dim), dk=(steps_all, heads, key_dim), dg=(tokens_all, heads),
                 dbeta=(steps_all, heads)),
            dict(scale=float(inputs.scale), use_l2=int(bool(inputs.use_qk_l2norm_in_kernel)),
                 num_householder=inputs.num_householder))
        shaped = lambda x, like: x.reshape(like.shape).astype(like.dtype)  # noqa: E731
        grads = GDPInputGradients(shaped(prep["dq"], inputs.q), shaped(prep["dk"], inputs.k),
                                  shaped(reverse["dv"], inputs.v), shaped(prep["dg"], inputs.g),
                                  shaped(prep["dbeta"], inputs.beta))
        return grads, scan["grad_in"]


# --------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _FlaggedFallback:
    """``JaxGDPBackend``'s forward context for inputs with token flags (the kernels did not take them), and
    their ``read_bad`` flags: apply stores those tokens' outputs as NaN, as the contained output scan does."""

    context: object
    read_bad: jax.Array


def _with_read_bad(saved: CPSavedContext, read_bad: jax.Array) -> CPSavedContext:
    """A ``JaxGDPBackend`` saved context that also carries the read_bad flags, for ``_without_read_bad``."""
    return CPSavedContext(tensors=(*saved.tensors, read_bad), metadata={**saved.metadata, _READ_BAD: True})


def _without_read_bad(output_grad, saved: CPSavedContext):
    """-> (output_grad, saved context) for ``JaxGDPBackend``'s backward: the output gradient of read_bad tokens
    zero (a poisoned output passes none; the kernels zero those dO rows as they load), the flags taken off."""
    if not saved.metadata.get(_READ_BAD, False):
        return output_grad, saved
    read_bad = saved.tensors[-1]
    metadata = {name: value for name, value in saved.metadata.items() if name != _READ_BAD}
    output_grad = zero_read_bad_grad(output_grad, read_bad)
    return output_grad, CPSavedContext(tensors=saved.tensors[:-1], metadata=metadata)


def _token_flags(shard: _Shard) -> dict[str, jax.Array]:
    """The chunk launches' ``state_bad`` / ``read_bad`` / ``any_flagged``: the shard's token flags, or zero
    placeholders."""
    return shard.token_flag_arguments(jnp.zeros((1, 1), jnp.uint8), jnp.zeros((1,), jnp.int32))


def _scan_rows(dtype: str, key_dim: int, value_dim: int, num_householder: int, row_block: int) -> tuple[int, int]:
    """-> (ChunkScanConfig.row_block: the option, or ``launch.scan_row_block``'s choice for 0; the output scan's
    CTAs per state, the layout's ``row_blocks``)."""
    row_block = row_block or kl.scan_row_block(key_dim, value_dim, num_householder)
    row_block = row_block if row_block <= min(key_dim, value_dim) else 0
    scan_rows = kcfg.ChunkScanConfig(dtype, key_dim, value_dim, "output", 32, row_block).rows_per_cta
    return row_block, value_dim // scan_rows


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _no_addend(key_dim: int) -> jax.Array:
    """segment_fold's ``addend`` under ADD_NONE (not read): the smallest array of its type."""
    return jnp.zeros((1, 1, key_dim, 1), _F32)


def _last_nonempty(cu: jax.Array) -> jax.Array:
    """int32 []: index of the last sequence with tokens (0 when none has any)."""
    index = jnp.arange(cu.shape[0] - 1, dtype=jnp.int32)
    return jnp.max(jnp.where(cu[1:] > cu[:-1], index, 0))


def _initial_states(inputs: GDPInputs) -> jax.Array | None:
    """float32 [N, H, K, V] of ``inputs.initial_state`` (shape checked), or None."""
    kl.check_initial_state_shape(inputs)
    if inputs.initial_state is None:
        return None
    return jax.lax.stop_gradient(inputs.initial_state).astype(_F32)


def _final_states(shard: _Shard, final_state: jax.Array, start: jax.Array) -> jax.Array:
    """The output pass's final states [N, H, K, V] (written by each sequence's last segment), with an empty
    sequence's row (packed shards only: every row has tokens) replaced by its ``start`` state."""
    if shard.rows:
        return final_state
    empty = (shard.layout.seq_segments == 0)[:, None, None, None]
    return jnp.where(empty, start, final_state)


def _packed_stack(preceding) -> jax.Array | None:
    """Stacked forward summaries [n, ..., K, V + K] float32 from any summary form (None when absent)."""
    if preceding is None:
        return None
    preceding = as_packed_array(preceding)
    if not hasattr(preceding, "shape") or not hasattr(preceding, "dtype"):
        raise ValueError(f"preceding must be an array or a forward summary; received {type(preceding).__name__}")
    if preceding.dtype != _F32:
        raise ValueError(f"preceding summaries must be float32; received {preceding.dtype}")
    return preceding


def _packed_backward_stack(following) -> jax.Array | None:
    """Stacked backward summaries [n, ..., K, V + K] float32 from any summary form (None when absent)."""
    if following is None:
        return None
    following = as_packed_array(following)
    if not hasattr(following, "shape") or not hasattr(following, "dtype"):
        raise ValueError(f"following must be an array or a backward summary; received {type(following).__name__}")
    return following.astype(_F32)


__all__ = ["CuTeDSLGatedDeltaProductCPBackend", "auto_backend", "kernel_platform_reason", "unsupported_reason"]
