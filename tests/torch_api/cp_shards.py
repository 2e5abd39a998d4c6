"""W ranks' CP forward and backward composed on one device, and the float64 reference of the same problem.

No process group: the packed tokens are cut into W contiguous shards by the CP plan
(``cp_linear.build_packed_sequence_cp_metadata``), every shard runs the backend's four functions,
and the all-gather + slice of ``torch_api.gdp.cp`` is done by stacking every rank's summary and
slicing it per rank (``preceding_rank_start .. rank`` forward, ``rank + 1 .. following_rank_stop``
backward), so each rank's apply receives exactly what it would receive over the wire::

    forward   prepare(shard r) for every r -> stack [s_0 .. s_{W-1}] -> apply(r, stack[start_r:r])
    backward  prepare(do_r, saved_r) for every r -> stack [b_0 .. b_{W-1}] -> apply(r, stack[r+1:stop_r])

Shared by the GPU test (``test_cutedsl_backend.py``), the CPU test on the kernels' emulation
(``test_cutedsl_emulated.py``) and ``benchmarks/bench_cp_share.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch

from cp_linear import build_packed_sequence_cp_metadata
from cp_linear.plan import PackedSequenceCPMetadata
from torch_api.gdp.cp import _slice_summary
from torch_api.gdp.types import GDPInputs, float32_region


@dataclass(frozen=True)
class CPBackwardCase:
    """One global problem: ``lengths`` packed documents split over ``cp_size`` ranks."""

    cp_size: int
    lengths: tuple[int, ...]
    num_householder: int
    l2norm: bool
    heads: int = 2
    key_dim: int = 64
    value_dim: int = 64

    @property
    def id(self) -> str:
        docs = ",".join(map(str, self.lengths))
        return (f"cp{self.cp_size}-docs{docs}-H{self.heads}-K{self.key_dim}-V{self.value_dim}"
                f"-nh{self.num_householder}{'-l2' if self.l2norm else ''}")


# (a) one document spanning both ranks, at K = V = 128 (the warpgroup-MMA scan on the GPU); (b) the 500-token
# document spans all three ranks (shards of 256); (c) packed documents, the 200-token one crossing token 256
CP_BACKWARD_CASES = [
    CPBackwardCase(cp_size=2, lengths=(512,), num_householder=2, l2norm=True, key_dim=128, value_dim=128),
    CPBackwardCase(cp_size=3, lengths=(100, 500, 168), num_householder=3, l2norm=True),
    CPBackwardCase(cp_size=2, lengths=(90, 200, 222), num_householder=1, l2norm=False),
]


class RankShard(NamedTuple):
    """One rank's share: its plan metadata, its inputs and where its tokens / steps lie globally."""

    metadata: PackedSequenceCPMetadata
    inputs: GDPInputs
    tokens: slice  # of q, g and the output
    steps: slice  # of k, v and beta (num_householder steps per token)


class ComposedGradients(NamedTuple):
    """Per-token output and input gradients, concatenated over ranks (the global packed layout)."""

    output: torch.Tensor  # [1, T, H, V]
    dq: torch.Tensor  # [1, T, H, K]
    dk: torch.Tensor  # [1, T*n_h, H, K]
    dv: torch.Tensor  # [1, T*n_h, H, V]
    dg: torch.Tensor  # [1, T, H]
    dbeta: torch.Tensor  # [1, T*n_h, H]


GRADIENT_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def seq_idx_of(lengths) -> np.ndarray:
    """int64 [1, T]: document n's tokens carry id n (the frontends' ``global_seq_idx``)."""
    return np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)


def split_into_shards(q, k, v, g, beta, lengths, cp_size: int, *, num_householder: int, l2norm: bool,
                      scale: float | None = None) -> list[RankShard]:
    """Global packed inputs (B = 1) -> every rank's ``RankShard``, as the CP plan cuts them: rank r holds
    tokens [r L, (r + 1) L) and its documents' local ``cu_seqlens`` (int32, on q's device)."""
    ids = seq_idx_of(lengths)
    if ids.shape[1] != q.shape[1]:
        raise ValueError(f"lengths sum to {ids.shape[1]} tokens; q holds {q.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    local = q.shape[1] // cp_size
    shards = []
    for rank in range(cp_size):
        metadata = build_packed_sequence_cp_metadata(ids, rank, cp_size)
        tokens = slice(rank * local, (rank + 1) * local)
        steps = slice(rank * local * num_householder, (rank + 1) * local * num_householder)
        cu = torch.tensor(metadata.local_cu_seqlens, dtype=torch.int32).to(q.device)
        inputs = GDPInputs(q[:, tokens], k[:, steps], v[:, steps], g[:, tokens], beta[:, steps], scale,
                           num_householder, l2norm, cu)
        shards.append(RankShard(metadata, inputs, tokens, steps))
    return shards


def gathered(summaries):
    """Every rank's summary stacked on a new leading axis, in the form it was returned: what
    ``torch_api.gdp.cp._all_gather_summary`` hands each rank."""
    first = summaries[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(summaries)
    return replace(first, **{f.name: torch.stack([getattr(s, f.name) for s in summaries]) for f in fields(first)})


def preceding_ranks(shard: RankShard, rank: int) -> slice:
    return slice(shard.metadata.preceding_rank_start, rank)


def following_ranks(shard: RankShard, rank: int) -> slice:
    return slice(rank + 1, shard.metadata.following_rank_stop)


class ForwardPass(NamedTuple):
    outputs: list  # per rank [1, L, H, V]
    saved_contexts: list  # per rank, for cp_backward_prepare
    gathered: object  # every rank's forward summary stacked [W, H, K, V + K] (the all-gather's result)


class BackwardPass(NamedTuple):
    gradients: list  # per rank GDPInputGradients
    gathered: object  # every rank's backward summary stacked [W, H, K, V + K]


def cp_forward(backend, shards: list[RankShard]) -> ForwardPass:
    """Every rank's prepare, the gather, every rank's apply on its preceding ranks' summaries."""
    prepared = [backend.cp_forward_prepare(shard.inputs) for shard in shards]
    stack = gathered([summary for summary, _ in prepared])
    results = [backend.cp_forward_apply(local, _slice_summary(stack, preceding_ranks(shards[r], r)))
               for r, (_, local) in enumerate(prepared)]
    return ForwardPass([result.output for result in results], [result.saved_context for result in results], stack)


def cp_backward(backend, shards: list[RankShard], output_grad: torch.Tensor, saved_contexts) -> BackwardPass:
    """Every rank's backward prepare (its slice of ``output_grad`` [1, T, H, V]), the gather, every
    rank's apply on its following ranks' summaries."""
    prepared = [backend.cp_backward_prepare(output_grad[:, shard.tokens], saved)
                for shard, saved in zip(shards, saved_contexts)]
    stack = gathered([summary for summary, _ in prepared])
    return BackwardPass([backend.cp_backward_apply(local, _slice_summary(stack, following_ranks(shards[r], r)))
                         for r, (_, local) in enumerate(prepared)], stack)


def cp_forward_backward(backend, q, k, v, g, beta, output_grad, lengths, cp_size: int, *, num_householder: int,
                        l2norm: bool) -> ComposedGradients:
    """The CP step of ``cp_size`` ranks on one device -> outputs and input gradients over all tokens.
    ``output_grad`` [1, T, H, V]: dL/do (no final-state gradient: the CP op returns no final state)."""
    shards = split_into_shards(q, k, v, g, beta, lengths, cp_size, num_householder=num_householder, l2norm=l2norm)
    with float32_region(q.device):  # as the CP op runs the backend
        forward = cp_forward(backend, shards)
        grads = cp_backward(backend, shards, output_grad, forward.saved_contexts).gradients
    return ComposedGradients(torch.cat(forward.outputs, dim=1),
                             *(torch.cat([getattr(grad, name) for grad in grads], dim=1) for name in GRADIENT_NAMES))


def float64_reference(q, k, v, g, beta, output_grad, lengths, *, num_householder: int, l2norm: bool,
                      scale: float | None = None) -> ComposedGradients:
    """The same global problem in float64 on the CPU, document by document: the output by the token
    recurrence (``cp_linear.reference``), the gradients by ``backward_algorithm.sequence_backward``
    (zero final-state gradient). Inputs are taken as given (already rounded to their dtype)."""
    from cp_linear.kernels.backward_algorithm import sequence_backward
    from cp_linear.reference import naive_gated_delta_product

    as64 = [x.detach().double().cpu() for x in (q, k, v, g, beta, output_grad)]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n_h, heads, key_dim, value_dim = num_householder, q.shape[2], q.shape[3], v.shape[3]
    cu = np.cumsum([0, *lengths])
    output, _ = naive_gated_delta_product(*(x.numpy() for x in as64[:5]), scale=scale, num_householder=n_h,
                                          cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
    per_document = [[] for _ in GRADIENT_NAMES]
    zero_final = torch.zeros(heads, key_dim, value_dim, dtype=torch.float64)
    for t0, t1 in zip(cu[:-1], cu[1:]):
        x_q, x_k, x_v, x_g, x_beta, x_do = as64
        grads = sequence_backward(x_q[0, t0:t1], x_k[0, t0 * n_h:t1 * n_h], x_v[0, t0 * n_h:t1 * n_h], x_g[0, t0:t1],
                                  x_beta[0, t0 * n_h:t1 * n_h], x_do[0, t0:t1], zero_final, num_householder=n_h,
                                  scale=scale, use_l2=l2norm)
        for slot, grad in enumerate(grads[:5]):
            per_document[slot].append(grad)
    return ComposedGradients(torch.from_numpy(output), *(torch.cat(parts, 0)[None] for parts in per_document))


def case_inputs(case: CPBackwardCase, *, dtype: torch.dtype, device, seed: int):
    """(q, k, v, g, beta, output_grad) of a case: q, k, v and dL/do in ``dtype``, g and beta float32.
    k has unit rows (``random_gdp_inputs``), so the recurrence stays contractive without the l2norm too;
    g is scaled to a slow decay so that the state carried across a rank boundary matters (a missing or
    misordered summary moves the outputs and gradients by about 0.3 rather than 0.03)."""
    from tests.cp_linear.gdp_cases import random_gdp_inputs

    rng = np.random.default_rng(seed)
    tokens = sum(case.lengths)
    arrays = random_gdp_inputs(rng, tokens=tokens, heads=case.heads, key_dim=case.key_dim,
                               value_dim=case.value_dim, num_householder=case.num_householder)
    output_grad = rng.normal(size=(1, tokens, case.heads, case.value_dim))
    q, k, v, g, beta, output_grad = (torch.tensor(x, dtype=torch.float32).to(device) for x in (*arrays, output_grad))
    return q.to(dtype), k.to(dtype), v.to(dtype), g * 0.1, beta, output_grad.to(dtype)
