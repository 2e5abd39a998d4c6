"""``CuTeDSLGatedDeltaProductCPBackend``: the GDP forward on CuTeDSL Hopper kernels.

The forward half of the CP protocol runs on ``cp_linear.kernels`` (compiled once per shape
class, called through TVM-FFI on the current torch stream, no host synchronisation); the
backward half recomputes with ``TorchGDPBackend`` until the backward kernels land (the saved
context has exactly the layout ``TorchGDPBackend`` reads, see ``torch_api.gdp.chunk``).

Launch plan of one shard (N sequences; the first may continue from the previous rank, the last
may continue on the next one; every batch row is such a sequence when there is no cu_seqlens)::

    prepare   chunk_index -> wy_prepare (all chunks, parallel)
              state_pass from zero over the sequences that do not depend on S_in
                   (packed: sequences 1..N-1; or sequence 0 when N = 1 / rows, to get E)
              M: state_pass in transition mode over runs of G chunks (parallel), then an
                 affine fold of the run products; only when the trailing sequence spans the
                 shard (packed N = 1, or rows), else M = 0
    apply     affine fold of the preceding summaries -> S_in (on the device)
              state_pass of the first sequence from S_in (packed N >= 2: its only pass;
                 N = 1 / rows: a rerun, skipped when there is no preceding rank)
              output (all chunks, parallel)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cp_linear.chunking import CHUNK_SIZE as CHUNK
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.summary import CPForwardPackedSummary, CPForwardUnpackedSummary
from torch_api.gdp.chunk import TorchGDPBackend, make_cp_saved_context
from torch_api.gdp.types import GDPInputs
from torch_api.gdp.validation import check_gdp_inputs

SUPPORTED_HEAD_DIMS = (64, 128)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
INIT_ZERO, INIT_GIVEN, INIT_IDENTITY = 0, 1, 2


def _kernels():
    from cp_linear.kernels import cache, configs

    return cache, configs


@dataclass
class _Shard:
    """One shard flattened over its batch rows, plus the device workspaces of the forward.

    q [T_all, H, K], k [S_all, H, K], v [S_all, H, V] (input dtype); g [T_all, H], beta
    [S_all, H] float32; cu int32 [N + 1]; chunk_offsets int32 [N + 1]; chunk_start and chunk_len
    int32 [C_max] (first step and length of every chunk);
    w [S_all, H, K], u / new_values [S_all, H, V], gate_cumsum and k_inv_norm [S_all, H],
    chunk_states [C_max, H, K, V], all float32.
    """

    inputs: GDPInputs
    rows: bool  # True: each batch row is one sequence (no cu_seqlens)
    num_seqs: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    gate_cumsum: torch.Tensor
    k_inv_norm: torch.Tensor
    chunk_states: torch.Tensor
    new_values: torch.Tensor

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
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.q.dtype]

    @property
    def use_l2(self) -> int:
        return int(bool(self.inputs.use_qk_l2norm_in_kernel))

    @property
    def num_householder(self) -> int:
        return self.inputs.num_householder

    @property
    def steps_per_row(self) -> int:
        return self.inputs.k.shape[1]


@dataclass
class CuTeDSLForwardContext:
    """Between ``cp_forward_prepare`` and ``cp_forward_apply``."""

    shard: _Shard
    summary: torch.Tensor  # [1 or B, H, K, V + K] float32 (the packed summary, batch axis kept)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> contiguous [B*T, ...] (a view when already contiguous)."""
    return x.contiguous().flatten(0, 1)


class CuTeDSLGatedDeltaProductCPBackend:
    """GDP chunkwise-CP backend whose forward runs on CuTeDSL kernels for Hopper (sm_90a).

    Supports K, V in {64, 128}, n_h >= 1, bf16 / fp16 / fp32 inputs on a CUDA device, packed
    batches (``cu_seqlens``) and rows. Summaries are packed float32 ``[E | M]``.

    The backward half (``cp_backward_prepare`` / ``cp_backward_apply`` and
    ``one_device_backward``) is ``TorchGDPBackend``'s recomputation from the saved inputs, until
    the backward kernels land; it saves only the inputs, the incoming state and M.

    recompute_chunk_num: how many chunk states the backward recomputes between stored ones. The
    torch fallback backward recomputes all of them from the inputs, so today the forward stores
    no chunk states whatever the value; it is validated and recorded in the saved metadata.
    transition_group_chunks: chunks per parallel run when building M (None: about sqrt of the
    shard's chunk count).
    """

    def __init__(self, recompute_chunk_num: int = 0, transition_group_chunks: int | None = None):
        if not isinstance(recompute_chunk_num, int) or isinstance(recompute_chunk_num, bool) or recompute_chunk_num < 0:
            raise ValueError(f"recompute_chunk_num must be an int >= 0; received {recompute_chunk_num!r}")
        if transition_group_chunks is not None and (
                not isinstance(transition_group_chunks, int) or transition_group_chunks < 1):
            raise ValueError(f"transition_group_chunks must be a positive int or None; received "
                             f"{transition_group_chunks!r}")
        self.recompute_chunk_num = recompute_chunk_num
        self.transition_group_chunks = transition_group_chunks
        self._fallback = TorchGDPBackend()
        self._dummies: dict = {}

    # ------------------------------------------------------------------ checks and set-up

    @staticmethod
    def _check(inputs: GDPInputs) -> None:
        check_gdp_inputs(inputs)
        key_dim, value_dim = inputs.q.shape[-1], inputs.v.shape[-1]
        if key_dim not in SUPPORTED_HEAD_DIMS or value_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"CuTeDSLGatedDeltaProductCPBackend supports K, V in {SUPPORTED_HEAD_DIMS}; "
                             f"received K = {key_dim}, V = {value_dim}")
        if inputs.q.device.type != "cuda":
            raise ValueError(f"CuTeDSLGatedDeltaProductCPBackend needs CUDA tensors; received {inputs.q.device}")

    def _shard(self, inputs: GDPInputs) -> _Shard:
        self._check(inputs)
        q, k, v = _flat(inputs.q), _flat(inputs.k), _flat(inputs.v)
        device = q.device
        batch, tokens = inputs.q.shape[:2]
        steps_all = k.shape[0]
        heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
        if inputs.cu_seqlens is None:
            rows = True
            cu = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device=device)
        else:
            rows = False
            cu = inputs.cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
        num_seqs = cu.shape[0] - 1
        max_chunks = (steps_all + (CHUNK - 1) * num_seqs) // CHUNK
        if max_chunks * heads * key_dim * value_dim >= 2**31:
            raise ValueError(f"the chunk-state buffer would hold {max_chunks * heads * key_dim * value_dim} "
                             "elements (>= 2^31); split the shard")
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return _Shard(
            inputs=inputs, rows=rows, num_seqs=num_seqs, q=q, k=k, v=v,
            # the kernels read gates and betas as float32 (small [T, H] tensors; no-op when already so)
            g=_flat(inputs.g).float(), beta=_flat(inputs.beta).float(), cu=cu,
            chunk_offsets=torch.empty(num_seqs + 1, **i32), chunk_start=torch.empty(max_chunks, **i32),
            chunk_len=torch.empty(max_chunks, **i32),
            w=torch.empty(steps_all, heads, key_dim, **f32), u=torch.empty(steps_all, heads, value_dim, **f32),
            gate_cumsum=torch.empty(steps_all, heads, **f32), k_inv_norm=torch.empty(steps_all, heads, **f32),
            chunk_states=torch.empty(max_chunks, heads, key_dim, value_dim, **f32),
            new_values=torch.empty(steps_all, heads, value_dim, **f32))

    def _dummy(self, device, shape) -> torch.Tensor:
        """A small float32 tensor for kernel arguments that a launch mode does not read or write."""
        key = (device, shape)
        if key not in self._dummies:
            self._dummies[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return self._dummies[key]

    # ------------------------------------------------------------------ launches

    def _index_and_wy(self, shard: _Shard) -> None:
        cache, configs = _kernels()
        cache.compiled(configs.ChunkIndexConfig())(shard.cu, shard.chunk_offsets, shard.chunk_start,
                                                   shard.chunk_len, shard.num_householder)
        cache.compiled(configs.WYPrepareConfig(shard.dtype_name, shard.key_dim, shard.value_dim))(
            shard.k, shard.v, shard.g, shard.beta, shard.cu, shard.chunk_offsets, shard.chunk_start, shard.chunk_len,
            shard.w, shard.u, shard.gate_cumsum, shard.k_inv_norm, shard.num_householder, shard.use_l2)

    def _state_pass(self, shard: _Shard, *, seq_begin: int, seq_count: int, initial: torch.Tensor | None,
                    final: torch.Tensor, final_begin: int, final_col: int = 0) -> None:
        """The forward state pass over sequences [seq_begin, seq_begin + seq_count) (whole sequences).

        initial [seq_count, H, K, V] or None (zeros); the end state of local sequence z >= final_begin
        goes to final[z - final_begin, :, :, final_col:final_col + V].
        """
        cache, configs = _kernels()
        key_dim = shard.key_dim
        init = self._dummy(shard.q.device, (1, 1, key_dim, 1)) if initial is None else initial
        cache.compiled(configs.StatePassConfig(shard.dtype_name, key_dim))(
            shard.k, shard.w, shard.u, shard.gate_cumsum, shard.k_inv_norm, shard.cu, shard.chunk_offsets, init,
            shard.chunk_states, shard.new_values, final,
            shard.value_dim, shard.num_householder, seq_begin, seq_count, 1, 2**30,
            INIT_ZERO if initial is None else INIT_GIVEN, 1, 1, final_begin, final_col)

    def _transition(self, shard: _Shard, summary: torch.Tensor) -> None:
        """M of every sequence (all span the shard: rows, or packed N = 1) into summary[..., V:]."""
        cache, configs = _kernels()
        device, key_dim, heads = shard.q.device, shard.key_dim, shard.heads
        seq_count = shard.num_seqs
        chunks = -(-shard.steps_per_row // CHUNK)
        group = self.transition_group_chunks or max(4, math.isqrt(chunks))
        runs = -(-chunks // group)
        products = torch.empty(runs * seq_count, heads, key_dim, key_dim, dtype=torch.float32, device=device)
        unused_values = self._dummy(device, (1, 1, 1))
        unused_states = self._dummy(device, (1, 1, key_dim, 1))
        cache.compiled(configs.StatePassConfig(shard.dtype_name, key_dim))(
            shard.k, shard.w, unused_values, shard.gate_cumsum, shard.k_inv_norm, shard.cu, shard.chunk_offsets,
            unused_states, unused_states, unused_values, products,
            key_dim, shard.num_householder, 0, seq_count, runs, group, INIT_IDENTITY, 0, 0, 0, 0)
        self._fold(products.view(runs, seq_count * heads, key_dim, key_dim),
                   summary.view(seq_count * heads, key_dim, -1), width=key_dim, m_col=0, has_update=False,
                   init_identity=True, out_col=shard.value_dim)

    @staticmethod
    def _fold(stacked: torch.Tensor, out: torch.Tensor, *, width: int, m_col: int, has_update: bool,
              init_identity: bool, out_col: int) -> None:
        cache, configs = _kernels()
        cache.compiled(configs.AffineFoldConfig(stacked.shape[2]))(
            stacked, out, width, m_col, int(has_update), int(init_identity), out_col)

    def _output(self, shard: _Shard) -> torch.Tensor:
        cache, configs = _kernels()
        o = torch.empty(shard.q.shape[0], shard.heads, shard.value_dim, dtype=shard.q.dtype, device=shard.q.device)
        cache.compiled(configs.OutputConfig(shard.dtype_name, shard.key_dim, shard.value_dim))(
            shard.q, shard.k, shard.k_inv_norm, shard.new_values, shard.chunk_states, shard.gate_cumsum, shard.cu,
            shard.chunk_offsets, shard.chunk_start, shard.chunk_len, o, float(shard.inputs.scale),
            shard.num_householder, shard.use_l2)
        batch, tokens = shard.inputs.q.shape[:2]
        return o.view(batch, tokens, shard.heads, shard.value_dim)

    # ------------------------------------------------------------------ forward protocol

    def cp_forward_prepare(self, inputs: GDPInputs) -> tuple[CPForwardPackedSummary, CuTeDSLForwardContext]:
        shard = self._shard(inputs)
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        summary_rows = shard.num_seqs if shard.rows else 1
        summary = torch.empty(summary_rows, heads, key_dim, value_dim + key_dim, dtype=torch.float32,
                              device=shard.q.device)
        self._index_and_wy(shard)
        if shard.rows or shard.num_seqs == 1:
            # every sequence spans the shard: E from a zero-state pass, M from the transitions
            self._state_pass(shard, seq_begin=0, seq_count=shard.num_seqs, initial=None, final=summary,
                             final_begin=0)
            self._transition(shard, summary)
        else:
            # sequences 1..N-1 never see S_in; the last one gives E, and M = 0
            self._state_pass(shard, seq_begin=1, seq_count=shard.num_seqs - 1, initial=None, final=summary,
                             final_begin=shard.num_seqs - 2)
            summary[..., value_dim:].zero_()
        packed = summary if shard.rows else summary[0]
        return CPForwardPackedSummary(packed), CuTeDSLForwardContext(shard, summary)

    def cp_forward_apply(self, local_context: CuTeDSLForwardContext, preceding) -> CPForwardResult:
        shard, summary = local_context.shard, local_context.summary
        heads, key_dim, value_dim = shard.heads, shard.key_dim, shard.value_dim
        stacked = _packed_stack(preceding)
        first_count = shard.num_seqs if shard.rows else 1
        incoming = torch.zeros(first_count, heads, key_dim, value_dim, dtype=torch.float32, device=shard.q.device)
        count = 0 if stacked is None else stacked.shape[0]
        if count:
            expected = (count, *summary.shape) if shard.rows else (count, *summary.shape[1:])
            if tuple(stacked.shape) != expected:
                raise ValueError(f"preceding summaries must have shape {expected}; received {tuple(stacked.shape)}")
            self._fold(stacked.reshape(count, first_count * heads, key_dim, value_dim + key_dim),
                       incoming.view(first_count * heads, key_dim, value_dim), width=value_dim, m_col=value_dim,
                       has_update=True, init_identity=False, out_col=0)
        spans_shard = shard.rows or shard.num_seqs == 1
        if count or not spans_shard:
            # the first sequence(s) from S_in (a rerun when prepare already ran them from zero)
            final = self._dummy(shard.q.device, (1, 1, key_dim, 1))
            self._state_pass(shard, seq_begin=0, seq_count=first_count, initial=incoming if count else None,
                             final=final, final_begin=2**30)
        output = self._output(shard)
        transition = summary[..., value_dim:]
        saved_incoming = incoming if shard.rows else incoming[0]
        saved_transition = transition if shard.rows else transition[0]
        saved = make_cp_saved_context(shard.inputs, saved_incoming, saved_transition)
        saved.metadata["recompute_chunk_num"] = self.recompute_chunk_num
        return CPForwardResult(output, saved)

    # ------------------------------------------------------------------ backward: torch recomputation

    def cp_backward_prepare(self, output_grad: torch.Tensor, saved_context: CPSavedContext):
        """``TorchGDPBackend.cp_backward_prepare`` (recomputes from the saved inputs)."""
        return self._fallback.cp_backward_prepare(output_grad, saved_context)

    def cp_backward_apply(self, backward_context, following):
        """``TorchGDPBackend.cp_backward_apply``."""
        return self._fallback.cp_backward_apply(backward_context, following)

    # ------------------------------------------------------------------ one device

    def one_device_forward(self, inputs: GDPInputs, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, CPSavedContext]:
        """-> (o [B, T, H, V], final_state float32 [N, H, K, V], saved context as TorchGDPBackend's)."""
        shard = self._shard(inputs)
        shape = (shard.num_seqs, shard.heads, shard.key_dim, shard.value_dim)
        initial = None
        if initial_state is not None:
            if tuple(initial_state.shape) != shape:
                raise ValueError(f"initial_state must be [N, H, K, V] = {shape}; received {tuple(initial_state.shape)}")
            initial = initial_state.detach().to(device=shard.q.device, dtype=torch.float32).contiguous()
        final_state = torch.empty(shape, dtype=torch.float32, device=shard.q.device)
        self._index_and_wy(shard)
        self._state_pass(shard, seq_begin=0, seq_count=shard.num_seqs, initial=initial, final=final_state,
                         final_begin=0)
        output = self._output(shard)
        saved = CPSavedContext(
            tensors=(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, inputs.cu_seqlens, initial),
            metadata={"scale": float(inputs.scale), "num_householder": int(inputs.num_householder),
                      "use_qk_l2norm_in_kernel": bool(inputs.use_qk_l2norm_in_kernel),
                      "recompute_chunk_num": self.recompute_chunk_num})
        return output, final_state, saved

    def one_device_backward(self, output_grad, final_state_grad, saved_context: CPSavedContext):
        """``TorchGDPBackend.one_device_backward`` (recomputes from the saved inputs)."""
        return self._fallback.one_device_backward(output_grad, final_state_grad, saved_context)


def _packed_stack(preceding) -> torch.Tensor | None:
    """Stacked summaries [n, ..., K, V + K] float32 from any summary form (None when absent)."""
    if preceding is None:
        return None
    if isinstance(preceding, CPForwardPackedSummary):
        preceding = preceding.packed
    elif isinstance(preceding, CPForwardUnpackedSummary):
        preceding = torch.cat([preceding.state_update, preceding.transition], dim=-1)
    if not isinstance(preceding, torch.Tensor):
        raise ValueError(f"preceding must be a tensor or a forward summary; received {type(preceding).__name__}")
    if preceding.dtype != torch.float32:
        raise ValueError(f"preceding summaries must be float32; received {preceding.dtype}")
    return preceding.contiguous()
