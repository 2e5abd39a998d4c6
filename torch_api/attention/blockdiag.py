"""Block-diagonal (per-document causal) softmax attention under context parallelism.

Each rank holds a contiguous shard of L tokens of a packed sequence of T = cp_size * L tokens;
``doc_ids`` [T] is replicated (0 = padding). A query reads earlier keys of its own document only,
so rank r needs the K/V range ``[s_first[r], real_end[r])`` of the plan (``cp_linear.build_blockdiag_plan``).
Three exchanges bring those keys in; which one, and what each rank sends and receives, is the
core's policy (``cp_linear.plan``: ``resolve_exchange_mode``, ``exchange_routing``); this module
turns the routing into torch.distributed collectives (torch_api/attention/exchange.py):

  "allgather"  every rank gathers all of K/V                  always possible, moves the most
  "halo"       the last ``max(back)`` tokens of the left rank  only when every back[r] <= L
  "a2a"        each rank receives exactly what it needs         always possible, moves the least
  "auto"       "halo" when the plan allows it, else "a2a"

Calling protocol (why it cannot hang): a ``BlockDiagRouting`` (plan, mode, host layout; device index
tensors built once per device) is built locally by ``prepare_blockdiag`` and never communicates.
Every ``blockdiag_attention`` call then runs one small fixed-size all-gather
(``torch_api._dist.agree_or_raise``) *before* any data collective, whatever its flags: every rank
learns whether any rank found a problem (bad doc ids, impossible forced halo, unavailable kernel,
shapes, an edited routing, NaN/Inf with ``check_inputs``) or disagrees (doc ids fingerprint, mode,
shapes, dtype, flags, scale), and all raise the same ValueError. Passing a torch ``doc_ids`` tensor
instead of a routing looks the routing up in a small cache keyed by the tensor's identity and
version, so an in-place edit builds a new routing (and a new fingerprint, which the header compares).
The layers (``torch_api.layers``) fold their own checks into this header; under a ``HybridDecoder``,
whose one agreement per step covers every layer, they skip it when ``check_inputs=False``.

Zig-zag layout (``layout="zigzag"``, ``cp_linear.zigzag``): rank r holds chunks r and 2·cp−1−r. The
plan is the contiguous one over 2·cp virtual shards (one per chunk, global positions), each local
chunk is one *query piece* attending its own key range; K/V travel by all-gather and are put back in
global order (the backward: reduce-scatter after the reverse permutation). The halo and a2a modes
are contiguous-only: asking for them under zig-zag is an error on every rank ("auto" all-gathers).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from cp_linear.plan import (
    EXCHANGE_MODES,
    MODE_CHOICES,
    BlockDiagPlan,
    ExchangeRouting,
    build_blockdiag_plan,
    exchange_routing,
    ids_fingerprint,
    validate_doc_ids,
)
from cp_linear.validation import NONFINITE, attention_dims_error, digest
from torch_api._dist import agree_or_raise, nonfinite_flags, resolve_group
from torch_api.attention.exchange import all_gather_kv, left_halo_kv, needed_kv_all_to_all
from torch_api.attention.kernel import KERNELS, DocCausalLayout, resolve_kernel
from cp_linear.zigzag import LAYOUTS, inverse_permutation, layout_permutation, rank_chunks, zigzag_attention_mode_error

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CACHE_SIZE = 8


@dataclass(frozen=True)
class QueryPiece:
    """Local queries ``[query_lo, query_hi)`` attend the global keys ``[key_start, key_stop)`` under
    ``layout``: the whole shard (contiguous layout) or one chunk (zig-zag)."""

    query_lo: int
    query_hi: int
    key_start: int
    key_stop: int
    layout: DocCausalLayout

    def fingerprint(self) -> tuple:
        return (self.query_lo, self.query_hi, self.key_start, self.key_stop, self.layout.fingerprint())


@dataclass
class BlockDiagRouting:
    """One rank's routing for one ``doc_ids`` layout (typically one training step), reusable across layers.

    plan            the replicated ``BlockDiagPlan`` (None when ``error`` is set)
    exchange        this rank's ``cp_linear.plan.ExchangeRouting`` (the resolved mode, the window
                    it receives, the key range it attends to, the a2a splits); None on error
    error           a local problem found while preparing; raised on every rank by the first call
    shard_layout    "contiguous" or "zigzag" (``cp_linear.zigzag``); under zig-zag ``plan`` is the plan
                    of the 2·cp chunks and ``pieces`` has one entry per local chunk
    pieces          the ``QueryPiece`` s of the local queries, in local order
    """

    group: dist.ProcessGroup
    rank: int
    cp_size: int
    requested_mode: str
    doc_fingerprint: tuple[int, int]
    plan: BlockDiagPlan | None = None
    exchange: ExchangeRouting | None = None
    layout: DocCausalLayout | None = None
    error: str | None = None
    shard_layout: str = "contiguous"
    pieces: tuple[QueryPiece, ...] = ()
    _send_index: dict = field(default_factory=dict, repr=False)
    _seal: int = field(default=-1, repr=False)

    def _derived(self) -> tuple:
        exchange = self.exchange
        routed = None if exchange is None else (
            exchange.mode, exchange.rank, exchange.window_start, exchange.key_start, exchange.key_stop,
            exchange.halo_len, exchange.in_splits, exchange.out_splits,
            None if exchange.send_index is None else exchange.send_index.tobytes())
        return (self.rank, self.cp_size, self.requested_mode, self.doc_fingerprint, self.plan, routed, self.error,
                None if self.layout is None else self.layout.fingerprint(), self.shard_layout,
                tuple(piece.fingerprint() for piece in self.pieces))

    def seal(self) -> None:
        """Record a digest of every derived field (``prepare_blockdiag`` does this once)."""
        self._seal = digest(self._derived())

    def tamper_error(self) -> str | None:
        """Non-None when a field changed after ``prepare_blockdiag`` built the routing."""
        if self._seal != digest(self._derived()):
            return ("the BlockDiagRouting was edited after prepare_blockdiag built it (its fields no longer match "
                    "the digest recorded then); build a new one with prepare_blockdiag(doc_ids, cp_group, mode)")
        return None

    @property
    def mode(self) -> str | None:
        """The exchange actually used: "allgather", "halo" or "a2a" (None on error)."""
        return None if self.exchange is None else self.exchange.mode

    @property
    def local_len(self) -> int:
        """L, the local query rows (under zig-zag the plan's shards are chunks of L / 2)."""
        return self.plan.local_len * (2 if self.shard_layout == "zigzag" else 1)

    def send_index(self, device: torch.device) -> torch.Tensor:
        if device not in self._send_index:
            self._send_index[device] = torch.from_numpy(self.exchange.send_index).to(device)
        return self._send_index[device]

    def global_order(self, device: torch.device) -> torch.Tensor:
        """int64 [T] (zig-zag): the rows of the rank-ordered gathered shards in global order."""
        key = ("global_order", device)
        if key not in self._send_index:
            total = self.plan.local_len * self.plan.cp_size
            order = inverse_permutation(layout_permutation(total, self.cp_size, self.shard_layout))
            self._send_index[key] = torch.from_numpy(order).to(device)
        return self._send_index[key]

    def signature(self) -> list[int]:
        mode_id = EXCHANGE_MODES.index(self.mode) if self.mode in EXCHANGE_MODES else -1
        layout_id = LAYOUTS.index(self.shard_layout) if self.shard_layout in LAYOUTS else -1
        return [mode_id, self.cp_size, *self.doc_fingerprint, layout_id]


def _fingerprint(ids: np.ndarray | None) -> tuple[int, int]:
    if ids is None:
        return (-1, -1)
    return (int(ids.shape[0]), ids_fingerprint(ids))


def prepare_blockdiag(doc_ids, cp_group, mode: str = "auto", layout: str = "contiguous") -> BlockDiagRouting:
    """Build this rank's routing from the replicated ``doc_ids`` int [T]; local, no communication.

    ``layout``: "contiguous" or "zigzag" (``cp_linear.zigzag``; all-gather only). Problems (bad ids,
    a forced halo that cannot work, an unknown mode or layout) are recorded, not raised: the first
    ``blockdiag_attention`` call raises them on every rank at once.
    """
    group = resolve_group(cp_group)
    rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    if layout == "zigzag":
        routing = _build_zigzag_routing(doc_ids, group, rank, cp_size, mode)
    elif layout == "contiguous":
        routing = _build_routing(doc_ids, group, rank, cp_size, mode)
    else:
        routing = BlockDiagRouting(group, rank, cp_size, mode, (-1, -1), shard_layout=str(layout),
                                   error=f"layout must be one of {LAYOUTS}; received {layout!r}")
    routing.seal()
    return routing


def _build_zigzag_routing(doc_ids, group, rank: int, cp_size: int, mode: str) -> BlockDiagRouting:
    """The zig-zag routing: the contiguous plan of the 2·cp chunks, one query piece per local chunk."""
    ids = plan = None
    try:
        mode_error = zigzag_attention_mode_error(mode)
        if mode_error:
            raise ValueError(mode_error)
        ids = validate_doc_ids(doc_ids, 2 * cp_size)
        plan = build_blockdiag_plan(ids, 2 * cp_size)
        chunk = plan.local_len
        pieces = tuple(
            QueryPiece(slot * chunk, (slot + 1) * chunk, plan.s_first[c], plan.real_end[c],
                       DocCausalLayout.from_doc_ids(ids, c * chunk, chunk, plan.s_first[c], plan.real_end[c]))
            for slot, c in enumerate(rank_chunks(rank, cp_size, "zigzag")))
    except ValueError as err:
        return BlockDiagRouting(group, rank, cp_size, mode, _fingerprint(ids), plan=plan, error=str(err),
                                shard_layout="zigzag")
    exchange = ExchangeRouting("allgather", rank, 0, min(p.key_start for p in pieces), max(p.key_stop for p in pieces))
    return BlockDiagRouting(group, rank, cp_size, mode, _fingerprint(ids), plan=plan, exchange=exchange,
                            shard_layout="zigzag", pieces=pieces)


def _build_routing(doc_ids, group, rank: int, cp_size: int, mode: str) -> BlockDiagRouting:
    ids = plan = None
    try:
        if mode not in MODE_CHOICES:
            raise ValueError(f"mode must be one of {MODE_CHOICES}; received {mode!r}")
        ids = validate_doc_ids(doc_ids, cp_size)
        plan = build_blockdiag_plan(ids, cp_size)
        exchange = exchange_routing(plan, mode, rank)
    except ValueError as err:
        return BlockDiagRouting(group, rank, cp_size, mode, _fingerprint(ids), plan=plan, error=str(err))
    local_len = plan.local_len
    layout = DocCausalLayout.from_doc_ids(ids, rank * local_len, local_len, exchange.key_start, exchange.key_stop)
    return BlockDiagRouting(group, rank, cp_size, mode, _fingerprint(ids), plan=plan, exchange=exchange, layout=layout,
                            pieces=(QueryPiece(0, local_len, exchange.key_start, exchange.key_stop, layout),))


# --------------------------------------------------------------------------- routing cache


_ROUTINGS: OrderedDict = OrderedDict()


def _cached_routing(doc_ids, cp_group, mode: str, layout: str = "contiguous") -> BlockDiagRouting:
    """Reuse the routing of the same live ``doc_ids`` tensor (same version) within a step."""
    if not isinstance(doc_ids, torch.Tensor):
        return prepare_blockdiag(doc_ids, cp_group, mode, layout)
    group = resolve_group(cp_group)
    key = (id(doc_ids), doc_ids._version, id(group), mode, layout)
    hit = _ROUTINGS.get(key)
    if hit is not None and hit[0]() is doc_ids:
        _ROUTINGS.move_to_end(key)
        return hit[1]
    routing = prepare_blockdiag(doc_ids, group, mode, layout)
    _ROUTINGS[key] = (weakref.ref(doc_ids), routing)
    while len(_ROUTINGS) > _CACHE_SIZE:
        _ROUTINGS.popitem(last=False)
    return routing


# --------------------------------------------------------------------------- the public op


def _check_call(routing: BlockDiagRouting, q, k, v, cp_group, mode, scale, layout="contiguous") -> str | None:
    """This call's local problem, or None. Runs on host metadata only."""
    if not isinstance(routing, BlockDiagRouting):
        return f"doc_ids must be ids or a BlockDiagRouting; received {type(routing).__name__}"
    if routing.error:
        return routing.error
    tampered = routing.tamper_error()
    if tampered:
        return tampered
    try:
        if resolve_group(cp_group) is not routing.group:
            return "cp_group differs from the group the routing was prepared for"
    except ValueError as err:
        return str(err)
    if mode not in ("auto", routing.requested_mode):
        return f"mode={mode!r} differs from the routing's mode={routing.requested_mode!r}"
    if layout != routing.shard_layout:
        return f"layout={layout!r} differs from the routing's layout={routing.shard_layout!r}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor; received {type(t).__name__}"
        if t.ndim != 4:
            return f"{name} must have shape [B, L, H, D]; received shape {tuple(t.shape)}"
    if k.shape != v.shape:
        return f"k and v must have the same shape; received {tuple(k.shape)} and {tuple(v.shape)}"
    local_len = routing.local_len
    if q.shape[0] != k.shape[0] or q.shape[1] != local_len or k.shape[1] != local_len or q.shape[3] != k.shape[3]:
        return (f"expected q [B, L={local_len}, Hq, D] and k/v [B, L={local_len}, Hkv, D] with equal B and D; "
                f"received q {tuple(q.shape)}, k/v {tuple(k.shape)}")
    empty = attention_dims_error(q.shape, k.shape)
    if empty:
        return empty
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share one float dtype of {_DTYPES}; received {q.dtype}, {k.dtype}, {v.dtype}"
    if k.device != q.device or v.device != q.device:
        return f"q, k, v must be on one device; received {q.device}, {k.device}, {v.device}"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return f"scale must be a positive finite number or None; received {scale!r}"
    return None


def _call_signature(q, k) -> list[int]:
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.ndim == 4 and k.ndim == 4):
        return [-1] * 7
    dtype_id = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    return [q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], dtype_id, int(q.is_cuda)]


def exchange_window(routing: BlockDiagRouting, kv: torch.Tensor) -> torch.Tensor:
    """Run the routing's exchange on token-major kv [L, B, 2, Hkv, D]; returns its window (no agreement:
    only for callers that already went through ``blockdiag_attention`` with this routing, e.g. benchmarks)."""
    exchange = routing.exchange
    if exchange.mode == "allgather":
        window = all_gather_kv(kv, routing.group)
        # zig-zag: the gathered shards hold chunks out of order; the window is global [0, T)
        return window if routing.shard_layout == "contiguous" else window.index_select(0, routing.global_order(kv.device))
    if exchange.mode == "halo":
        return left_halo_kv(kv, exchange.halo_len, routing.group)
    return needed_kv_all_to_all(kv, routing.send_index(kv.device), list(exchange.in_splits),
                                list(exchange.out_splits), routing.group)


QKV_CHECKS = tuple((name, f"{NONFINITE} in {name}") for name in ("q", "k", "v"))


def blockdiag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids, *, cp_group,
                        mode: str = "auto", scale: float | None = None, kernel: str = "auto",
                        check_inputs: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """Block-diagonal causal attention of this rank's shard under CP (differentiable).

    q [B, L, Hq, D], k/v [B, L, Hkv, D]: the local shards (Hq a multiple of Hkv); ``doc_ids`` int [T]
    replicated on every rank (0 = padding, anywhere), or a ``BlockDiagRouting`` from
    ``prepare_blockdiag``. ``mode`` in {"auto", "allgather", "halo", "a2a"}; ``kernel`` in
    {"auto", "sdpa", "flex", "varlen"} (torch_api/attention/kernel.py). Returns [B, L, Hq, D]; padding rows
    are exactly 0. Bad input on any rank raises the same ValueError on every rank before any
    data collective: one fixed-size agreement per call (one collective, one host sync).

    check_inputs: NaN/Inf in q, k or v is an error (checked in the same agreement). With False the
    values are not read; a non-finite input is contained instead: outputs that attend to it are NaN,
    every other output (other documents, earlier tokens, padding) is exact.

    layout: "contiguous" (rank r holds global tokens [r·L, (r+1)·L)) or "zigzag" (chunks r and
    2·cp−1−r of 2·cp, ``cp_linear.zigzag``; ``doc_ids`` stay in global order; all-gather only).
    """
    return attend(q, k, v, doc_ids, cp_group=cp_group, mode=mode, scale=scale, kernel=kernel,
                  check_inputs=check_inputs, layout=layout)


def attend(q, k, v, doc_ids, *, cp_group, mode: str = "auto", scale: float | None = None, kernel: str = "auto",
           check_inputs: bool = True, extra_error: str | None = None, extra_signature=(),
           what: str = "blockdiag_attention inputs", agreed: bool = False, layout: str = "contiguous") -> torch.Tensor:
    """``blockdiag_attention`` with the layers' hooks: ``extra_error`` / ``extra_signature`` join this
    call's agreement header (one header for layer and op); ``agreed=True`` (only for a call a wider
    agreement already covered, and only without value checks) skips the header."""
    routing = doc_ids if isinstance(doc_ids, BlockDiagRouting) else _cached_routing(doc_ids, cp_group, mode, layout)
    group = routing.group if isinstance(routing, BlockDiagRouting) else resolve_group(cp_group)
    error = extra_error or _check_call(routing, q, k, v, cp_group, mode, scale, layout)
    kernel_name, needs_grad = None, -1
    if error is None:
        # a rank without autograd would skip the backward collectives: agree on it too
        needs_grad = int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        kernel_name, error = resolve_kernel(kernel, q.device, q.shape[3], bool(needs_grad), q.dtype)
    if not agreed or check_inputs or error is not None:
        kernel_id = KERNELS.index(kernel_name) if kernel_name in KERNELS else -1
        routing_signature = routing.signature() if isinstance(routing, BlockDiagRouting) else [-1]
        scale_id = -1 if scale is None else digest([float(scale)]) if isinstance(scale, (int, float)) else -2
        signature = [*routing_signature, kernel_id, needs_grad, int(bool(check_inputs)), scale_id,
                     *_call_signature(q, k), *extra_signature]
        flags = nonfinite_flags(q, k, v) if check_inputs and error is None else None
        agree_or_raise(group, error, signature, what=what, value_flags=flags, value_checks=QKV_CHECKS)
    return run_blockdiag_op(q, k, v, routing, scale=scale, kernel=kernel_name, contain=not check_inputs)


def run_blockdiag_op(q, k, v, routing: BlockDiagRouting, *, scale: float | None, kernel: str,
                     contain: bool) -> torch.Tensor:
    """The op after validation and agreement: ``cp_linear::blockdiag_attention`` (exchange inside,
    autograd registered; ``torch_api.attention.library``). ``kernel`` resolved ("sdpa", "flex" or "varlen");
    ``contain``: unchecked values, non-finite ones contained (``doc_causal_attention(contain=True)``)."""
    from torch_api.attention.library import routing_name

    return torch.ops.cp_linear.blockdiag_attention(q, k, v, routing_name(routing),
                                                   0.0 if scale is None else float(scale), kernel, contain)


__all__ = ["BlockDiagRouting", "QKV_CHECKS", "QueryPiece", "attend", "blockdiag_attention", "exchange_window", "prepare_blockdiag",
           "run_blockdiag_op"]
