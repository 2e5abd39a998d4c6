"""Doc-causal attention of one rank's queries over a contiguous window of keys (after the exchange).

Glossary
  query window  the local shard: global positions ``[query_start, query_start + Lq)``
  key window    global positions ``[key_start, key_start + Nk)``; it starts at or before the
                document of the first local query, so the first local document may have more
                keys than queries (bottom-right causal alignment)
  allowed       query p may read key j iff doc(p) == doc(j) > 0 and j <= p (global positions)

Worked example (doc ids, '.' = padding), rank 1 of 2 with L = 6, key window [3, 11)::

    global   0 1 2 3 4 5 | 6 7 8 9 10 11
    doc      1 1 1 2 2 2 | 2 2 . 3  3  .
    queries                6 7 8 9 10 11      rows 8, 11 are padding -> exactly 0
    keys           3 4 5   6 7 8 9 10         query 7 reads keys 3..7 (doc 2), query 10 reads 9..10

Kernels (``kernel=``)
  "sdpa"  ``scaled_dot_product_attention`` over query chunks (``DocCausalLayout.query_chunks``): a
          chunk inside one document is plain bottom-right causal attention (no mask tensor, so the
          flash backend qualifies on CUDA); a chunk of several whole documents uses a boolean mask of
          at most [chunk, chunk]. Blocks between documents are never computed and mask memory stays
          below L * chunk. Exact on CPU (and any dtype).
  "flex"  ``flex_attention`` with a BlockMask built on the host from the document structure
          (``DocCausalLayout.block_sparsity``: no dense [Lq, Nk] mask); compiled on CUDA.
          This torch build has no CPU backward for it, so on CPU it serves forward-only checks.
  "varlen" FlashAttention's variable-length kernels (torch's ``aten._flash_attention_forward`` with
          cumulative sequence offsets; CUDA, bf16/fp16, head dim a multiple of 8 up to 256): each run of
          equal ids is one segment (``DocCausalLayout.varlen_segments``), causal bottom-right inside it,
          so blocks across documents are never computed and nothing is built per call but two offset
          vectors; GQA natively. Autograd through the aten op (its backward is FlashAttention's).
  "auto"  ``$CP_LINEAR_BLOCKDIAG_KERNEL`` if set, else "flex" on CUDA (head dim a power of two in
          [16, 256]) and "sdpa" elsewhere. Measured on an H200 (benchmarks/results/): flex is 27% faster
          fwd+bwd than sdpa with short documents and within 8% of the best sdpa variant with long ones;
          in the 32k decoder step flex's attention took 60 ms, varlen's (FlashAttention 2, not tuned
          for Hopper) 74 ms.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cp_linear.validation import any_in_ranges, digest, nonfinite_rows, sanitize
from torch_api import _prefix_counts  # noqa: F401  (the flag counts as a custom op: compiled steps)
from torch_api._poison import poison

KERNELS = ("sdpa", "flex", "varlen")
KERNEL_CHOICES = ("auto", *KERNELS)
KERNEL_ENV = "CP_LINEAR_BLOCKDIAG_KERNEL"
# queries per SDPA call: bounds the masks (and, on CPU, the [B, H, chunk, keys] score buffer)
CPU_CHUNK = 512
CUDA_CHUNK = 2048


# --------------------------------------------------------------------------- host layout


@dataclass(frozen=True)
class DocCausalLayout:
    """Host description of one rank's attention problem (built once per plan).

    query_doc  int64 [Lq]: doc ids of the local queries, starting at global ``query_start``
    key_doc    int64 [Nk]: doc ids of the key window, starting at global ``key_start``
    doc_start  int64 [Lq]: global position where each query's document starts (padding: itself)
    """

    query_start: int
    query_doc: np.ndarray
    key_start: int
    key_doc: np.ndarray
    doc_start: np.ndarray
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_doc_ids(cls, doc_ids: np.ndarray, query_start: int, query_len: int,
                     key_start: int, key_stop: int) -> "DocCausalLayout":
        ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        position = np.arange(ids.shape[0])
        new_run = np.concatenate([[True], ids[1:] != ids[:-1]])
        run_start = np.maximum.accumulate(np.where(new_run, position, 0))
        query = slice(query_start, query_start + query_len)
        layout = cls(query_start, ids[query].copy(), key_start, ids[key_start:key_stop].copy(),
                     run_start[query].copy())
        real = np.nonzero(layout.query_doc > 0)[0]
        if real.size and (layout.doc_start[real[0]] < key_start or query_start + real[-1] >= key_stop):
            raise ValueError(f"key window [{key_start}, {key_stop}) does not cover the documents of "
                             f"queries [{query_start}, {query_start + query_len})")
        for array in (layout.query_doc, layout.key_doc, layout.doc_start):
            array.flags.writeable = False
        return layout

    def fingerprint(self) -> int:
        """Digest of the layout (cached; its arrays are read-only)."""
        if "fingerprint" not in self._device_cache:
            self._device_cache["fingerprint"] = digest((self.query_start, self.key_start, self.query_doc.tobytes(),
                                                        self.key_doc.tobytes(), self.doc_start.tobytes()))
        return self._device_cache["fingerprint"]

    def key_ranges(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [Lq] each: the key-window range ``[start, stop)`` every query reads (empty for padding)."""
        key = ("key_ranges", device)
        if key not in self._device_cache:
            real = self.query_doc > 0
            stop = np.where(real, self.query_start + np.arange(self.query_len) + 1 - self.key_start, 0)
            start = np.where(real, self.doc_start - self.key_start, 0)
            self._device_cache[key] = (torch.from_numpy(start.astype(np.int64)).to(device),
                                       torch.from_numpy(stop.astype(np.int64)).to(device))
        return self._device_cache[key]

    @property
    def query_len(self) -> int:
        return int(self.query_doc.shape[0])

    @property
    def key_len(self) -> int:
        return int(self.key_doc.shape[0])

    @property
    def has_real_query(self) -> bool:
        return bool(np.any(self.query_doc > 0))

    def allowed(self, query_lo: int, query_hi: int, key_lo: int, key_hi: int) -> np.ndarray:
        """bool [query_hi - query_lo, key_hi - key_lo], local indices into the two windows."""
        q_doc = self.query_doc[query_lo:query_hi, None]
        k_doc = self.key_doc[None, key_lo:key_hi]
        q_pos = self.query_start + np.arange(query_lo, query_hi)[:, None]
        k_pos = self.key_start + np.arange(key_lo, key_hi)[None, :]
        return (q_doc == k_doc) & (k_pos <= q_pos) & (q_doc > 0)

    def query_chunks(self, chunk_size: int) -> list["QueryChunk"]:
        """Split the real queries into chunks of at most ``chunk_size`` (local indices).

        A chunk that starts inside a document continuing from earlier holds only that document:
        its keys run from the document's start to its last query (bottom-right causal, no mask).
        Any other chunk starts at a document start and groups whole documents (and the padding
        between them), so its keys are exactly its queries: a mask of at most [chunk, chunk].
        Padding at either end of a chunk is trimmed; all-padding stretches get no chunk.
        """
        ids, length = self.query_doc, self.query_len
        run_stop = np.empty(length, np.int64)  # one past the end of the run holding each query
        bounds = np.concatenate([np.nonzero(ids[1:] != ids[:-1])[0] + 1, [length]])
        run_stop[:] = np.repeat(bounds, np.diff(np.concatenate([[0], bounds])))
        real = np.nonzero(ids > 0)[0]
        chunks, lo = [], 0
        while lo < length:
            if ids[lo] == 0:
                lo = int(run_stop[lo])
                continue
            doc_start = int(self.doc_start[lo]) - self.query_start
            if doc_start < lo:  # continues a document that began before this chunk
                hi = min(int(run_stop[lo]), lo + chunk_size)
                key_lo = doc_start + self.query_start - self.key_start
                single_doc = True
            else:
                hi = int(real[real < lo + chunk_size][-1]) + 1
                key_lo = lo + self.query_start - self.key_start
                single_doc = bool(run_stop[lo] >= hi)
            chunks.append(QueryChunk(lo, hi, key_lo, self.query_start + hi - self.key_start, single_doc))
            lo = hi
        return chunks

    def varlen_segments(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """FlashAttention's varlen description: ``(cu_q, cu_k, max_q, max_k)``, int32 offsets [S + 1] into
        the query and key windows (local indices), one segment per run of equal query ids.

        Runs are adjacent, so their key ranges are too: run i reads keys [start of its document, its
        last query], and only the first run can reach before the query window (a document continuing
        from earlier). A padding run reads its own positions (its rows are zeroed afterwards); offsets
        are clipped to the key window, so a padding run past its end reads nothing (output 0). Each
        segment's key range ends at its last query: causal bottom-right alignment gives the doc rule.
        """
        if "varlen_segments" not in self._device_cache:
            ids = self.query_doc
            cu_q = np.concatenate([[0], np.nonzero(ids[1:] != ids[:-1])[0] + 1, [self.query_len]])
            first_key = (self.doc_start[0] if self.query_len else self.query_start) - self.key_start
            cu_k = np.clip(np.concatenate([[first_key], self.query_start + cu_q[1:] - self.key_start]), 0, self.key_len)
            self._device_cache["varlen_segments"] = (cu_q.astype(np.int32), cu_k.astype(np.int32),
                                                     int(np.max(np.diff(cu_q), initial=0)),
                                                     int(np.max(np.diff(cu_k), initial=0)))
        return self._device_cache["varlen_segments"]

    def block_sparsity(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Which [block_size x block_size] tiles hold an allowed pair: ``(any_allowed, all_allowed)``,
        bool [query blocks, key blocks] each (the flex BlockMask, built without a dense [Lq, Nk] mask).

        Query p reads exactly the keys ``[doc_start(p), p]``; a tile is full when every row is real,
        of one document, and its keys (a complete block) lie inside ``[doc_start, first row]``.
        """
        q_blocks = -(-self.query_len // block_size)
        k_blocks = -(-self.key_len // block_size)
        k_first = self.key_start + np.arange(k_blocks) * block_size
        k_last = np.minimum(k_first + block_size, self.key_start + self.key_len) - 1
        position = self.query_start + np.arange(self.query_len)
        real = self.query_doc > 0
        any_allowed = np.zeros((q_blocks, k_blocks), bool)
        all_allowed = np.zeros((q_blocks, k_blocks), bool)
        for block in range(q_blocks):
            rows = slice(block * block_size, min((block + 1) * block_size, self.query_len))
            pos, start, row_real = position[rows], self.doc_start[rows], real[rows]
            reads = row_real[:, None] & (start[:, None] <= k_last[None, :]) & (pos[:, None] >= k_first[None, :])
            any_allowed[block] = reads.any(axis=0)
            if row_real.all() and pos.shape[0] == block_size and start[0] == start[-1]:
                all_allowed[block] = (k_first >= start[0]) & (k_last <= pos[0]) & (k_last - k_first + 1 == block_size)
        return any_allowed, all_allowed


@dataclass(frozen=True)
class QueryChunk:
    """Queries ``[query_lo, query_hi)`` read keys ``[key_lo, key_hi)`` (local indices); the key range
    ends at the chunk's last query. ``single_doc``: one document, so the mask is bottom-right causal."""

    query_lo: int
    query_hi: int
    key_lo: int
    key_hi: int
    single_doc: bool


# --------------------------------------------------------------------------- kernel choice


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_reason(device: torch.device, head_dim: int, dtype: torch.dtype | None) -> str | None:
    """Why kernel="varlen" cannot run here (None when it can): FlashAttention's CUDA kernels (sm_80 or
    later), bf16/fp16 q/k/v, head dim a multiple of 8 up to 256."""
    if device.type != "cuda":
        return f"kernel='varlen' needs a CUDA GPU (FlashAttention); received a {device.type} tensor"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "kernel='varlen' needs torch's FlashAttention ops (aten._flash_attention_forward)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "kernel='varlen' needs an sm_80 or later GPU (FlashAttention 2)"
    if dtype is not None and dtype not in VARLEN_DTYPES:
        return f"kernel='varlen' takes bfloat16 or float16 q/k/v; received {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"kernel='varlen' needs a head dim that is a multiple of 8 up to 256; received {head_dim}"
    return None


def resolve_kernel(requested: str | None, device: torch.device, head_dim: int,
                   needs_grad: bool, dtype: torch.dtype | None = None) -> tuple[str | None, str | None]:
    """``(kernel, None)`` or ``(None, why not)`` for a request on this device; host only. ``dtype``:
    q's, checked for "varlen" (bf16/fp16) when given."""
    requested = "auto" if requested is None else requested
    if requested not in KERNEL_CHOICES:
        return None, f"kernel must be one of {KERNEL_CHOICES}; received {requested!r}"
    if requested == "auto":
        override = os.environ.get(KERNEL_ENV, "").strip()
        if override:
            if override not in KERNELS:
                return None, f"${KERNEL_ENV} must be one of {KERNELS}; it is {override!r}"
            requested = override
        else:
            flex_fits = head_dim >= 16 and head_dim <= 256 and head_dim & (head_dim - 1) == 0
            return ("flex" if device.type == "cuda" and flex_fits and flex_available() else "sdpa"), None
    if requested == "varlen":
        reason = varlen_reason(device, head_dim, dtype)
        return (None, reason) if reason else ("varlen", None)
    if requested == "flex":
        if not flex_available():
            return None, "kernel='flex' needs torch.nn.attention.flex_attention, absent in this torch build"
        if device.type == "cpu" and needs_grad:
            return None, "kernel='flex' has no CPU backward in torch; use kernel='sdpa' on CPU"
    return requested, None


# --------------------------------------------------------------------------- kernels


class _ZerosKeepingGraph(torch.autograd.Function):
    """Zeros shaped like q that still depend on q, k, v, so that their gradients are zeros (not None)
    and the exchange's backward collective runs on a rank whose shard is all padding."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.meta)


@dataclass
class _SdpaChunk:
    query_lo: int
    query_hi: int
    key_lo: int
    key_hi: int
    mask: torch.Tensor | None  # bool [queries, keys] for a multi-document chunk; None: pure causal
    valid: torch.Tensor | None  # bool [queries, 1, 1] when the chunk holds padding rows, else None


def _sdpa_chunks(layout: DocCausalLayout, device: torch.device, chunk_size: int) -> list[_SdpaChunk]:
    key = ("sdpa", device, chunk_size)
    if key not in layout._device_cache:
        chunks = []
        for chunk in layout.query_chunks(chunk_size):
            q_lo, q_hi, k_lo, k_hi = chunk.query_lo, chunk.query_hi, chunk.key_lo, chunk.key_hi
            mask = valid = None
            if not chunk.single_doc:
                allowed = layout.allowed(q_lo, q_hi, k_lo, k_hi)
                real = layout.query_doc[q_lo:q_hi] > 0
                # a padding row reads key 0 so that no row is fully masked (some SDPA backends return
                # NaN there); its output is zeroed afterwards, so it gets exactly zero gradient.
                allowed[~real, 0] = True
                mask = torch.from_numpy(allowed).to(device)
                valid = None if real.all() else torch.from_numpy(real).to(device).view(-1, 1, 1)
            chunks.append(_SdpaChunk(q_lo, q_hi, k_lo, k_hi, mask, valid))
        layout._device_cache[key] = chunks
    return layout._device_cache[key]


def _sdpa(q, k, v, mask, scale):
    """q [B, Hq, Lq, D], k/v [B, H, Nk, D] (H = Hq, or Hkv on CPU) -> [B, Hq, Lq, D];
    ``mask`` None means bottom-right causal."""
    queries, keys = q.shape[2], k.shape[2]
    causal = mask is None and queries == keys
    if mask is None and keys > queries:
        mask = causal_lower_right(queries, keys)
    gqa = {} if q.shape[1] == k.shape[1] else {"enable_gqa": True}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa)


def _sdpa_attention(q, k, v, layout, scale, chunk_size):
    batch, _, q_heads, head_dim = q.shape
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda:
        # the CUDA flash/efficient/cuDNN backends want dense key rows and equal head counts: expand
        # the key window once here rather than once per chunk
        group = q_heads // k.shape[2]
        k_t = k_t.repeat_interleave(group, dim=1) if group > 1 else k_t.contiguous()
        v_t = v_t.repeat_interleave(group, dim=1) if group > 1 else v_t.contiguous()
    pieces, cursor = [], 0
    for chunk in _sdpa_chunks(layout, q.device, chunk_size):
        if chunk.query_lo > cursor:
            pieces.append(q.new_zeros(batch, chunk.query_lo - cursor, q_heads, head_dim))
        out = _sdpa(q_t[:, :, chunk.query_lo:chunk.query_hi], k_t[:, :, chunk.key_lo:chunk.key_hi],
                    v_t[:, :, chunk.key_lo:chunk.key_hi], chunk.mask, scale).transpose(1, 2)
        if chunk.valid is not None:
            out = torch.where(chunk.valid, out, 0.0)
        pieces.append(out)
        cursor = chunk.query_hi
    if cursor < layout.query_len:
        pieces.append(q.new_zeros(batch, layout.query_len - cursor, q_heads, head_dim))
    return torch.cat(pieces, dim=1)


_COMPILED_FLEX = None


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # eager: forward-only checks on CPU
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        # compiled once per process; torch.compile marks the key length dynamic after the first
        # change of shape, so later steps (new plans, new key windows) do not recompile.
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


FLEX_BLOCK = 128


def _kv_blocks(tiles: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [q blocks, k blocks] -> BlockMask's (counts [1, 1, nq], indices [1, 1, nq, nk]) int32."""
    counts = tiles.sum(axis=1).astype(np.int32)
    # stable argsort of "not selected" puts the selected key blocks first, in ascending order
    indices = np.argsort(~tiles, axis=1, kind="stable").astype(np.int32)
    return (torch.from_numpy(counts).to(device).view(1, 1, -1),
            torch.from_numpy(indices).to(device).view(1, 1, *tiles.shape))


def flex_block_mask(layout: DocCausalLayout, device: torch.device, block_size: int = FLEX_BLOCK):
    """The doc-causal BlockMask of ``layout`` and the real-query rows (bool [1, Lq, 1, 1]); cached."""
    key = ("flex", device, block_size)
    if key not in layout._device_cache:
        from torch.nn.attention.flex_attention import BlockMask

        q_doc = torch.from_numpy(layout.query_doc.copy()).to(device)
        k_doc = torch.from_numpy(layout.key_doc.copy()).to(device)
        q_pos = torch.arange(layout.query_len, device=device) + layout.query_start
        k_pos = torch.arange(layout.key_len, device=device) + layout.key_start

        def doc_causal(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == k_doc[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx]) & (q_doc[q_idx] > 0)

        any_allowed, all_allowed = layout.block_sparsity(block_size)
        block_mask = BlockMask.from_kv_blocks(*_kv_blocks(any_allowed & ~all_allowed, device),
                                              *_kv_blocks(all_allowed, device), BLOCK_SIZE=block_size,
                                              mask_mod=doc_causal, seq_lengths=(layout.query_len, layout.key_len))
        valid = (q_doc > 0).view(1, -1, 1, 1)
        layout._device_cache[key] = (block_mask, valid)
    return layout._device_cache[key]


def _flex_attention(q, k, v, layout, scale):
    block_mask, valid = flex_block_mask(layout, q.device)
    out = _flex_fn(q.device)(q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
                             block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return torch.where(valid, out.transpose(1, 2), 0.0)


def _varlen_offsets(layout: DocCausalLayout, device: torch.device, batch: int):
    """Device offsets for ``batch`` rows (row b's segments shifted by b·Lq and b·Nk), max_q, max_k and
    the real-query rows (bool [1, Lq, 1, 1]); cached. Rows are stacked only when their key ranges
    cover the whole window (a segment's keys run up to the next one's first key, so a gap at the
    window's ends would join the next row's first segment); otherwise ``batch`` must be 1."""
    key = ("varlen", device, batch)
    if key not in layout._device_cache:
        cu_q, cu_k, max_q, max_k = layout.varlen_segments()
        rows = np.arange(batch)[:, None]
        cu_q = np.append((cu_q[None, :-1] + rows * layout.query_len).reshape(-1), batch * layout.query_len)
        cu_k = np.append((cu_k[None, :-1] + rows * layout.key_len).reshape(-1), (batch - 1) * layout.key_len
                         + cu_k[-1])
        layout._device_cache[key] = (torch.from_numpy(cu_q.astype(np.int32)).to(device),
                                     torch.from_numpy(cu_k.astype(np.int32)).to(device), max_q, max_k,
                                     torch.from_numpy(layout.query_doc > 0).to(device).view(1, -1, 1, 1))
    return layout._device_cache[key]


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """FlashAttention's varlen causal kernel: q [B, Lq, Hq, D], k/v [B, Nk, Hkv, D] flattened to
    token-major rows; segment i is queries [cu_q[i], cu_q[i+1]) over keys [cu_k[i], cu_k[i+1]) (rows of
    all batches), bottom-right causal. Differentiable (the aten op's registered backward)."""
    batch, queries, q_heads, head_dim = q.shape
    rows = lambda x: x.reshape(-1, x.shape[2], head_dim).contiguous()  # noqa: E731
    out = torch.ops.aten._flash_attention_forward(rows(q), rows(k), rows(v), cu_q, cu_k, max_q, max_k, 0.0, True,
                                                  False, scale=scale)[0]
    return out.view(batch, queries, q_heads, head_dim)


def _varlen_doc_attention(q, k, v, layout, scale):
    cu_k_host = layout.varlen_segments()[1]
    if q.shape[0] == 1 or (cu_k_host[0] == 0 and cu_k_host[-1] == layout.key_len):
        cu_q, cu_k, max_q, max_k, valid = _varlen_offsets(layout, q.device, q.shape[0])
        return torch.where(valid, varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale), 0.0)
    cu_q, cu_k, max_q, max_k, valid = _varlen_offsets(layout, q.device, 1)
    return torch.cat([torch.where(valid, varlen_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], cu_q, cu_k, max_q,
                                                          max_k, scale), 0.0) for b in range(q.shape[0])])


def doc_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocCausalLayout, *,
                         scale: float | None = None, kernel: str = "sdpa",
                         chunk_size: int | None = None, contain: bool = False) -> torch.Tensor:
    """Attention of local queries over the key window under the doc-causal mask.

    q [B, Lq, Hq, D], k/v [B, Nk, Hkv, D] (any strides; Hq a multiple of Hkv) with ``Lq`` and ``Nk``
    matching ``layout``; ``kernel`` already resolved ("sdpa", "flex" or "varlen"). Returns [B, Lq, Hq, D];
    padding rows are exactly 0 and receive zero gradient.

    contain: for inputs whose values were not checked. A masked-out key still enters the kernels'
    matmuls (0 * NaN = NaN), so the kernel runs on sanitised q/k/v (NaN/Inf -> 0) and a real query
    gets NaN, by selection, exactly when its own q or a key/value it may read (its document, up to
    itself) is non-finite; every other output is exact (``cp_linear.validation``).
    """
    if not contain:
        return _doc_causal_attention(q, k, v, layout, scale=scale, kernel=kernel, chunk_size=chunk_size)
    with torch.no_grad():
        query_bad = nonfinite_rows(q, 1)  # [B, Lq, Hq]
        key_bad = nonfinite_rows(k, 1) | nonfinite_rows(v, 1)  # [B, Nk, Hkv]
        start, stop = layout.key_ranges(q.device)
        reads_bad = any_in_ranges(key_bad, start, stop)  # [B, Lq, Hkv]
        group = q.shape[2] // k.shape[2]
        bad = query_bad | (reads_bad.repeat_interleave(group, dim=2) if group > 1 else reads_bad)
        bad = bad & (stop > start)[None, :, None]  # padding rows stay exactly 0
    out = _doc_causal_attention(sanitize(q), sanitize(k), sanitize(v), layout, scale=scale, kernel=kernel,
                                chunk_size=chunk_size)
    return poison(out, bad[..., None])


def _doc_causal_attention(q, k, v, layout, *, scale, kernel, chunk_size):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not layout.has_real_query:
        return _ZerosKeepingGraph.apply(q, k, v)
    if kernel == "flex":
        return _flex_attention(q, k, v, layout, scale)
    if kernel == "varlen":
        return _varlen_doc_attention(q, k, v, layout, scale)
    if kernel != "sdpa":
        raise ValueError(f"kernel must be one of {KERNELS} here; received {kernel!r}")
    if chunk_size is None:
        chunk_size = CUDA_CHUNK if q.is_cuda else CPU_CHUNK
    return _sdpa_attention(q, k, v, layout, scale, chunk_size)


def attention_flops(layout: DocCausalLayout, batch: int, q_heads: int, head_dim: int) -> int:
    """Forward matmul FLOPs over allowed (query, key) pairs only: 4 * pairs * B * Hq * D."""
    real = np.nonzero(layout.query_doc > 0)[0]
    positions = layout.query_start + real
    pairs = int(np.sum(positions - layout.doc_start[real] + 1))
    return 4 * pairs * batch * q_heads * head_dim


__all__ = ["DocCausalLayout", "KERNELS", "KERNEL_CHOICES", "QueryChunk", "attention_flops", "doc_causal_attention",
           "flex_available", "flex_block_mask", "resolve_kernel", "varlen_attention", "varlen_reason"]
