"""Vectorised chunk math of Gated DeltaProduct in WY/UT form, and the chunk-to-chunk recurrences.

Vocabulary
  step     one Householder update. Token t owns steps t*n_h .. t*n_h + n_h - 1; its gate g[t] sits
           on the first step and q[t] is read on the last (docs/design.md §2), so GDP over T tokens is a
           gated delta rule over S = T*n_h steps.
  chunk    at most C consecutive steps (64) of ONE sequence, as ``cp_linear.chunking`` lays them out
           (the one layout of every backend). Unfilled slots hold identity steps (q = k = v = 0,
           beta = 0, g = 0), which leave the state unchanged and whose outputs are dropped.
  chunk-major layout  [NC, B, H, C, D]: chunk index first, so the state recurrences read one
           contiguous [B, H, ...] block per chunk.
  state entering chunk c   S_c [B, H, K, V]; the chunk ends in ``transition_c @ S_c + update_c``
           and reads ``o_c = state_read_c @ S_c + local_output_c`` ([C, V] per head).

Packed batch (B = 1, several sequences): with cu_seqlens = [0, 3, 70] and n_h = 1, C = 64 the
second sequence (67 steps) starts at chunk 1::

    chunk 0: steps 0..2 of seq 0, then 61 padding steps      keep[0] = 0 (chunk 1 starts seq 1)
    chunk 1: steps 0..63 of seq 1                            keep[1] = 1
    chunk 2: steps 64..66 of seq 1, then padding
The number of chunk slots is the static bound ``cp_linear.chunking.max_chunks`` (extra slots are
all padding), so the layout is built on the device from cu_seqlens without a host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cp_linear.chunking import chunk_layout
from cp_linear.gdp import L2NORM_EPS


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + L2NORM_EPS) over the last axis (``cp_linear.gdp``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def on_last_step(x: torch.Tensor, num_householder: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T*n_h, H, D]: each token's row on its last step, zeros elsewhere (q, do)."""
    n = num_householder
    if n == 1:
        return x
    batch, tokens = x.shape[:2]
    return F.pad(x.unsqueeze(2), (0, 0, 0, 0, n - 1, 0)).reshape(batch, tokens * n, *x.shape[2:])


def on_first_step(g: torch.Tensor, num_householder: int) -> torch.Tensor:
    """[B, T, H] -> [B, T*n_h, H]: each token's gate on its first step, zeros elsewhere."""
    n = num_householder
    if n == 1:
        return g
    batch, tokens, heads = g.shape
    return F.pad(g.unsqueeze(2), (0, 0, 0, n - 1)).reshape(batch, tokens * n, heads)


def last_steps(per_step: torch.Tensor, num_householder: int) -> torch.Tensor:
    """[B, T*n_h, H, V] -> [B, T, H, V]: the value on each token's last step (where q is read)."""
    batch, steps = per_step.shape[:2]
    n = num_householder
    return per_step.view(batch, steps // n, n, *per_step.shape[2:])[:, :, n - 1]


# --------------------------------------------------------------------------- layout


def _as_tensor(x, device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int64)


@dataclass(frozen=True)
class ChunkPlacement:
    """The torch view of ``cp_linear.chunking.ChunkLayout``: index tensors that move a shard between
    its steps [B, S, ...] and the chunk-major layout [NC, B, H, C, D], and the per-sequence bookkeeping
    of the recurrence.

    Two modes:
      rows    (``cu_seqlens`` None): each of the B rows is one sequence; one layout serves every row
      packed  (B = 1): N sequences from ``cu_seqlens`` (possibly empty), each starting a chunk

    source   int64 [NC * C]: the step each slot holds (S = padding); ``slot`` int64 [S]: the inverse
    keep     float32 [NC]: 0 where the next chunk starts a new sequence, else 1
    starts   bool [NC]: the chunk starts a sequence; ``chunk_seq`` int64 [NC] its sequence
    first_chunk, last_chunk int64 [N]; nonempty bool [N]
    """

    rows: bool
    batch: int
    steps: int
    num_chunks: int
    chunk_size: int
    num_sequences: int
    source: torch.Tensor
    slot: torch.Tensor
    keep: torch.Tensor
    starts: torch.Tensor
    chunk_seq: torch.Tensor
    first_chunk: torch.Tensor
    last_chunk: torch.Tensor
    nonempty: torch.Tensor

    @classmethod
    def build(cls, batch: int, steps: int, num_householder: int, cu_seqlens: torch.Tensor | None,
              chunk_size: int, device: torch.device) -> "ChunkPlacement":
        """cu_seqlens: token offsets int [N + 1] of a packed row (B = 1), or None for rows."""
        rows = cu_seqlens is None
        tokens = steps // num_householder
        if rows:
            # [0, tokens] made on the device: torch.tensor(list, device=cuda) is a synchronising copy
            cu_seqlens = torch.arange(2, dtype=torch.int32, device=device) * tokens
        layout, bounds = chunk_layout(cu_seqlens.to(device=device, dtype=torch.int32), total_steps=steps,
                                      num_householder=num_householder, chunk_size=chunk_size)
        starts = layout.starts_sequence()
        keep = torch.ones(layout.num_slots, dtype=torch.float32, device=device)
        if layout.num_slots > 1:
            keep[:-1] = (~starts[1:]).float()
        return cls(rows=rows, batch=batch, steps=steps, num_chunks=layout.num_slots, chunk_size=chunk_size,
                   num_sequences=batch if rows else layout.num_sequences,
                   source=_as_tensor(layout.slot_source(), device), slot=_as_tensor(layout.step_slot(bounds), device),
                   keep=keep, starts=starts, chunk_seq=_as_tensor(layout.chunk_seq, device),
                   first_chunk=_as_tensor(layout.first_chunk(), device),
                   last_chunk=_as_tensor(layout.last_chunk(), device), nonempty=layout.sequence_nonempty())

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H, D] (or [B, S, H]) -> [NC, B, H, C, D] (or [NC, B, H, C]), padding slots zero."""
        squeeze = x.dim() == 3
        if squeeze:
            x = x.unsqueeze(-1)
        batch, _, heads, dim = x.shape
        padded = torch.cat([x, x.new_zeros(batch, 1, heads, dim)], dim=1).index_select(1, self.source)
        chunked = padded.view(batch, self.num_chunks, self.chunk_size, heads, dim).permute(1, 0, 3, 2, 4)
        chunked = chunked.contiguous()
        return chunked.squeeze(-1) if squeeze else chunked

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """[NC, B, H, C, D] -> [B, S, H, D] (drops the padding slots)."""
        nc, batch, heads, chunk, dim = y.shape
        return y.permute(1, 0, 3, 2, 4).reshape(batch, nc * chunk, heads, dim).index_select(1, self.slot)

    # -- sequences: initial and final states ([N, H, K, V]) <-> recurrence coordinates ([B, H, K, V])

    def initial_and_resets(self, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, H, K, V] -> (state entering chunk 0 [B, H, K, V], reset states [NC, B, H, K, V] or None).

        ``resets[c]`` is the initial state of the sequence that starts at chunk c + 1 (else 0)."""
        if self.rows:
            return initial_state, None
        entering = initial_state.index_select(0, self.chunk_seq[:1])
        resets = initial_state.new_zeros(self.num_chunks, *initial_state.shape[1:])
        if self.num_chunks > 1:
            starting = initial_state.index_select(0, self.chunk_seq[1:])
            resets[:-1] = starting * self.starts[1:].view(-1, 1, 1, 1).to(starting.dtype)
        return entering, resets.unsqueeze(1)

    def final_states(self, transition, update, states, initial_state: torch.Tensor) -> torch.Tensor:
        """State at the end of every sequence [N, H, K, V] from the recurrence's states [NC + 1, B, ...];
        an empty sequence ends in its initial state."""
        if self.rows:
            return states[-1]
        last = self.last_chunk
        ends = transition.index_select(0, last) @ states.index_select(0, last) + update.index_select(0, last)
        return torch.where(self.nonempty.view(-1, 1, 1, 1), ends[:, 0], initial_state)

    def final_state_grads(self, final_state_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """dL/d(final states) [N, H, K, V] -> (gradient after the last chunk [B, H, K, V],
        extra gradients on each chunk's end state [NC, B, H, K, V] or None)."""
        if self.rows:
            return final_state_grad, None
        inject = final_state_grad.new_zeros(self.num_chunks, *final_state_grad.shape[1:])
        mask = self.nonempty.view(-1, 1, 1, 1).to(final_state_grad.dtype)
        inject.index_add_(0, self.last_chunk, final_state_grad * mask)
        return torch.zeros_like(final_state_grad[:1]), inject.unsqueeze(1)

    def initial_state_grads(self, state_grads: torch.Tensor, final_state_grad: torch.Tensor | None) -> torch.Tensor:
        """dL/d(state entering each chunk) [NC + 1, B, H, K, V] -> dL/d(initial states) [N, H, K, V]
        (an empty sequence passes its final-state gradient straight through)."""
        if self.rows:
            return state_grads[0]
        entering = state_grads.index_select(0, self.first_chunk)[:, 0]
        through = torch.zeros_like(entering) if final_state_grad is None else final_state_grad
        return torch.where(self.nonempty.view(-1, 1, 1, 1), entering, through)


# --------------------------------------------------------------------------- per-chunk math


@dataclass
class ChunkTerms:
    """Per-chunk affine maps of the incoming state, float32, chunk-major.

    state_read    [NC, B, H, C, K]   output o_c = state_read_c @ S_c + local_output_c  (scale folded in)
    local_output  [NC, B, H, C, V]
    transition    [NC, B, H, K, K]   end state = transition_c @ S_c + update_c
    update        [NC, B, H, K, V]
    """

    state_read: torch.Tensor
    local_output: torch.Tensor
    transition: torch.Tensor
    update: torch.Tensor

    def detached(self) -> "ChunkTerms":
        return ChunkTerms(*(t.detach() for t in (self.state_read, self.local_output, self.transition, self.update)))


def chunk_terms(q, k, v, g, beta, scale: float) -> ChunkTerms:
    """WY/UT form of every chunk at once (differentiable).

    q, k [NC, B, H, C, K]; v [NC, B, H, C, V]; g, beta [NC, B, H, C], all float32 per step.
    With G the cumulative gate inside the chunk, decay[i, j] = exp(G_i - G_j) for i ≥ j, and the
    unit lower triangular ``A = I + tril(beta_i k_i.k_j decay_ij, -1)``:
      w = A^-1 diag(beta exp(G)) k   (how the incoming state enters the corrected values)
      u = A^-1 diag(beta) v          (the corrected values from a zero state)
    the chunk reads o = scale (exp(G) q S + (q k^T * decay) (u - w S)) and ends in
    exp(G_C) S + k_end^T (u - w S), k_end[j] = exp(G_C - G_j) k_j (cp_linear.reference.wy_chunk).
    """
    chunk = q.shape[-2]
    key_dim = k.shape[-1]
    cum = g.cumsum(-1)  # [NC, B, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # mask before exp: exp(G_i - G_j) above the diagonal may overflow
    decay = torch.where(causal, cum[..., :, None] - cum[..., None, :], float("-inf")).exp()
    gate = cum.exp()
    lower = ((k @ k.transpose(-1, -2)) * decay * beta[..., :, None]).tril(-1)
    rhs = torch.cat([(beta * gate)[..., None] * k, beta[..., None] * v], dim=-1)
    wu = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :key_dim], wu[..., key_dim:]
    attn = (q @ k.transpose(-1, -2)) * decay * scale
    state_read = (scale * gate)[..., None] * q - attn @ w
    local_output = attn @ u
    k_end = (cum[..., -1:] - cum).exp()[..., None] * k
    eye = torch.eye(key_dim, dtype=q.dtype, device=q.device)
    transition = gate[..., -1, None, None] * eye - k_end.transpose(-1, -2) @ w
    update = k_end.transpose(-1, -2) @ u
    return ChunkTerms(state_read, local_output, transition, update)


# --------------------------------------------------------------------------- recurrences over chunks


def _per_chunk(x: torch.Tensor) -> torch.Tensor:
    """[NC, B, H, R, W] -> [NC, B*H, R, W] (a view)."""
    return x.reshape(x.shape[0], -1, *x.shape[-2:])


def forward_states(transition, update, initial, *, keep=None, resets=None) -> torch.Tensor:
    """States entering every chunk plus the state after the last one: [NC + 1, B, H, K, V].

    S_{c+1} = keep_c (transition_c S_c + update_c) + resets_c, S_0 = initial [B, H, K, V].
    """
    if keep is not None:  # by selection: a non-finite state must not cross into the next sequence as NaN * 0
        kept = keep.view(-1, 1, 1, 1, 1) > 0
        transition, update = torch.where(kept, transition, 0.0), torch.where(kept, update, 0.0)
    if resets is not None:
        update = update + resets
    num_chunks = transition.shape[0]
    matrices, offsets = _per_chunk(transition), _per_chunk(update)
    states = update.new_empty(num_chunks + 1, *offsets.shape[1:])
    states[0] = initial.reshape(offsets.shape[1:])
    for c in range(num_chunks):
        torch.baddbmm(offsets[c], matrices[c], states[c], out=states[c + 1])
    return states.view(num_chunks + 1, *update.shape[1:])


def fold_summary(transition, update, *, keep=None, resets=None) -> torch.Tensor:
    """``[E | M]`` [B, H, K, V + K] of all chunks: the recurrence run on ``[S | I]`` from ``[0 | I]``.

    E is the state after the last chunk from a zero incoming state (a later sequence starts from its
    reset state, zero under CP); M = d(state after the last chunk) / d(incoming state), zero once a
    new sequence started.
    """
    if keep is not None:
        kept = keep.view(-1, 1, 1, 1, 1) > 0
        transition, update = torch.where(kept, transition, 0.0), torch.where(kept, update, 0.0)
    if resets is not None:
        update = update + resets
    matrices, offsets = _per_chunk(transition), _per_chunk(update)
    value_dim = update.shape[-1]
    blocks, key_dim = offsets.shape[1], offsets.shape[2]
    eye = torch.eye(key_dim, dtype=update.dtype, device=update.device).expand(blocks, key_dim, key_dim)
    acc = torch.cat([update.new_zeros(blocks, key_dim, value_dim), eye], dim=-1)
    for c in range(transition.shape[0]):
        acc = torch.bmm(matrices[c], acc)
        acc[..., :value_dim] += offsets[c]
    return acc.view(*update.shape[1:-1], value_dim + key_dim)


def backward_state_grads(transition, read_grads, final_grad, *, keep=None, inject=None):
    """Adjoint of ``forward_states``: returns (lam [NC + 1, B, H, K, V], mu [NC, B, H, K, V]).

    lam_c = dL/dS_c (state entering chunk c), lam_NC = final_grad; mu_c = dL/d(end state of chunk c)
    = keep_c lam_{c+1} + inject_c; lam_c = read_grads_c + transition_c^T mu_c, where
    read_grads_c = state_read_c^T do_c is what chunk c's own outputs contribute.
    """
    num_chunks = transition.shape[0]
    matrices_t = _per_chunk(transition).transpose(-1, -2)
    local = _per_chunk(read_grads)
    lams = read_grads.new_empty(num_chunks + 1, *local.shape[1:])
    lams[num_chunks] = final_grad.reshape(local.shape[1:])
    separate = keep is not None or inject is not None
    mus = read_grads.new_empty(num_chunks, *local.shape[1:]) if separate else lams[1:]
    injected = _per_chunk(inject) if inject is not None else None
    zero = read_grads.new_zeros(())
    for c in range(num_chunks - 1, -1, -1):
        if separate:
            if keep is not None:
                torch.where(keep[c] > 0, lams[c + 1], zero, out=mus[c])
            else:
                mus[c].copy_(lams[c + 1])
            if injected is not None:
                mus[c] += injected[c]
        torch.baddbmm(local[c], matrices_t[c], mus[c], out=lams[c])
    shape = read_grads.shape[1:]
    return lams.view(num_chunks + 1, *shape), mus.view(num_chunks, *shape)
