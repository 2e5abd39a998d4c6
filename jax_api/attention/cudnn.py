"""Document-causal attention on one device through cuDNN's fused flash attention (packed segments).

``jax.nn.dot_product_attention`` takes no segment ids, so packed documents would need a dense mask
over every key (``blockdiag.masked_attention``: T² scores). cuDNN's *packed layout* (Hopper, through
``jax._src.cudnn.fused_attention_stablehlo``) takes each segment's start and length and runs causal
attention inside each segment only, forward and backward, on bf16/fp16 tensor cores: the blocks
across documents are never computed. Here a segment is one run of equal ``doc_ids``, padding runs
included, so every token belongs to exactly one segment and gets a finite row (padding rows are
then set to exact zeros, as in ``masked_attention``).

The number of segments is a static shape (cuDNN's graph and its softmax statistics, float32
[B · max_runs, Hq, T], are sized by it): ``max_runs`` is a bound that ``TokenLayout`` derives from the
packing's ids (a power of two, so new packings reuse the compiled program). A packing with more
runs than the bound cannot be seen at trace time; it turns every output into NaN instead of
dropping documents silently.

Non-finite inputs are contained as in ``masked_attention`` (``contain_nonfinite``): cuDNN sees
sanitised q/k/v, and the queries that may read a non-finite value are set to NaN by selection.

Under CP (``cudnn_window_attention``) a rank's queries are a piece of the sequence and the keys a
window around it; the first local document may have begun earlier, which needs bottom-right causal
alignment, and this cuDNN entry point aligns top-left. So the queries are placed in the key window's
own rows (a query buffer as long as the window, zeros elsewhere), and each segment is a run of one
document's keys from its first row in the window to its last local query: top-left alignment is
then exact, at the price of the dummy query rows before the first local query (their outputs are
dropped, so they add nothing to the gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_api.attention.blockdiag import contain_nonfinite

__all__ = ["CUDNN_UNDER_CP", "FORCE_CUDNN_ATTENTION", "cudnn_attention_reason", "cudnn_cp_reason",
           "cudnn_document_attention", "cudnn_window_attention", "document_segments", "window_segments"]

# Tests on machines without cuDNN set this to run the packing math around an emulated call.
FORCE_CUDNN_ATTENTION = False
# The CP path (``cudnn_window_attention``: segments at gaps in the packed buffer, dummy query rows):
# ``pytest -m gpu tests/jax_api/test_cudnn_attention.py`` passed on an H200 (benchmarks/NOTES.md,
# 2026-12-03 fifth). A switch, so a cuDNN regression can be bypassed without a code change.
CUDNN_UNDER_CP = True

CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 256  # on Hopper; the head dim must also be a multiple of 8


def cudnn_attention_reason(q: jax.Array, k: jax.Array) -> str | None:
    """Why ``cudnn_document_attention`` cannot run q [B, T, Hq, D] with k [B, T, Hkv, D] here (None when
    it can): a Hopper-or-later CUDA GPU as JAX's default backend (the packed layout needs sm_90), cuDNN
    loaded by JAX, bfloat16/float16 inputs, D <= 256 and a multiple of 8."""
    if not FORCE_CUDNN_ATTENTION:
        backend = jax.default_backend()
        if backend not in ("gpu", "cuda"):
            return f"cuDNN attention needs a CUDA GPU; JAX's default backend is {backend}"
        capability = str(getattr(jax.devices()[0], "compute_capability", "0"))
        if tuple(int(part) for part in capability.split(".")[:2]) < (9, 0):
            return f"cuDNN's packed attention needs Hopper (sm_90) or later; the GPU reports {capability}"
        try:
            from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

            check_cudnn_version()
        except (ImportError, RuntimeError) as err:
            return f"cuDNN attention is not available in this JAX: {err}"
    if jnp.dtype(q.dtype) not in CUDNN_DTYPES or k.dtype != q.dtype:
        return f"cuDNN attention takes bfloat16 or float16 q/k/v; received {jnp.dtype(q.dtype).name}"
    head_dim = q.shape[-1]
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return f"cuDNN attention needs D <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8; received D = {head_dim}"
    return None


def document_segments(doc_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed-layout description of the runs of equal ``doc_ids`` (int [T]).

    Returns offsets int32 [1, max_runs + 1] (each run's first token, then -1), lengths int32
    [1, max_runs] (each run's length, then -1) and ``overflow`` (bool scalar: more runs than
    ``max_runs``; the trailing runs are then missing from the description).
    """
    # the window case with every position a local query: each run is one whole segment
    every_token = jnp.arange(doc_ids.shape[0], dtype=jnp.int32)
    return window_segments(every_token, doc_ids, every_token, max_runs)


def _packed_causal(q, k, v, offsets, lengths, *, scale: float):
    """cuDNN's causal flash attention within each packed segment (q [B, T, Hq, D], BTNH layout)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                 kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL,
                                 qkv_layout="BTNH")


def _padding_zeroed(out, real_queries, overflow):
    """out [B, L, Hq, D] with exact zeros on padding rows (``real_queries`` bool [L] False), and NaN
    everywhere when the segments overflowed their bound."""
    keep = real_queries[None, :, None, None] & ~overflow
    return jnp.where(keep, out, jnp.where(overflow, jnp.nan, 0.0).astype(out.dtype))


def cudnn_document_attention(q, k, v, doc_ids, *, max_runs: int, scale: float, packed_causal=None):
    """Causal attention within each document; q [B, T, Hq, D], k/v [B, T, Hkv, D] (GQA: Hq a multiple of
    Hkv), doc_ids int [T] shared by the rows (0 = padding; each document one contiguous run).

    Returns [B, T, Hq, D] in q's dtype: padding rows exactly 0, NaN by selection where a query may read
    a non-finite input (and everywhere when the packing has more than ``max_runs`` runs).
    ``packed_causal`` replaces the cuDNN call (same signature as ``_packed_causal``; tests emulate it).
    """
    attend_segments = _packed_causal if packed_causal is None else packed_causal
    offsets, lengths, overflow = document_segments(doc_ids, max_runs)
    batch = q.shape[0]  # unpacked rows (B > 1) share doc_ids: the same segments in every row
    offsets, lengths = (jnp.broadcast_to(x, (batch, x.shape[1])) for x in (offsets, lengths))

    def attend(clean_q, clean_keys, clean_values):
        # contain_nonfinite hands keys over as [T, B, Hkv, D]; cuDNN takes BTNH
        out = attend_segments(clean_q, jnp.moveaxis(clean_keys, 0, 1), jnp.moveaxis(clean_values, 0, 1),
                              offsets, lengths, scale=scale)
        return _padding_zeroed(out, doc_ids > 0, overflow)

    positions = jnp.arange(q.shape[1], dtype=jnp.int32)
    keys, values = jnp.moveaxis(k, 1, 0), jnp.moveaxis(v, 1, 0)
    return contain_nonfinite(attend, q, keys, values, positions, doc_ids, query_start=0).astype(q.dtype)


def cudnn_cp_reason(q: jax.Array, k: jax.Array, max_runs: int | None) -> str | None:
    """Why a CP shard's attention runs the jnp masked softmax rather than ``cudnn_window_attention``."""
    if not CUDNN_UNDER_CP:
        return "cuDNN attention under CP is switched off (jax_api.attention.cudnn.CUDNN_UNDER_CP)"
    if max_runs is None or max_runs < 2:
        return "no bound on the segments of a shard (pass max_runs; layouts built by build_layout carry one)"
    return cudnn_attention_reason(q, k)


def window_segments(positions: jax.Array, doc_ids: jax.Array, local_rows: jax.Array, max_runs: int):
    """cuDNN's packed-layout description of the segments a window of key rows needs for its local queries.

    positions int32 [N]: each row's global position, ascending, empty rows (-1 in the window) first as
    the int32 minimum; local_rows int [Lq]: the rows of the local queries. A segment is a run of rows of
    one document at consecutive positions that holds a local query, from its first row to its last
    local query. Returns offsets [1, max_runs + 1], lengths [1, max_runs] (-1 past the segments) and
    ``overflow`` (more segments than ``max_runs``).
    """
    rows = positions.shape[0]
    last = doc_ids.shape[0] - 1
    row_docs = jnp.where(positions >= 0, doc_ids[jnp.clip(positions, 0, last)], -1)
    new_run = jnp.concatenate([jnp.ones((1,), bool),
                               (row_docs[1:] != row_docs[:-1]) | (positions[1:] != positions[:-1] + 1)])
    run = jnp.cumsum(new_run) - 1  # [N], run index of each row
    row_index = jnp.arange(rows, dtype=jnp.int32)
    is_local = jnp.zeros((rows,), bool).at[local_rows].set(True)
    run_first = jax.ops.segment_min(row_index, run, num_segments=rows)
    run_last_local = jax.ops.segment_max(jnp.where(is_local, row_index, -1), run, num_segments=rows)
    wanted = run_last_local >= 0
    chosen = jnp.nonzero(wanted, size=max_runs, fill_value=0)[0]
    count = jnp.sum(wanted)
    real = jnp.arange(max_runs) < count
    starts = jnp.where(real, run_first[chosen], -1)
    lengths = jnp.where(real, run_last_local[chosen] - run_first[chosen] + 1, -1)
    offsets = jnp.concatenate([starts, jnp.full((1,), -1, starts.dtype)]).astype(jnp.int32)
    return offsets[None], lengths.astype(jnp.int32)[None], count > max_runs


def _rows_in_segments(offsets: jax.Array, lengths: jax.Array, rows: int) -> jax.Array:
    """bool [B, rows]: the row lies in one of the segments that offsets [B, M + 1] / lengths [B, M] describe."""
    row = jnp.arange(rows)[None, :, None]
    starts, counts = offsets[:, None, :-1], lengths[:, None, :]
    return jnp.any((row >= starts) & (row < starts + counts) & (counts > 0), axis=-1)


def cudnn_window_attention(q, keys, values, key_positions, doc_ids, *, query_start, max_runs: int, scale: float,
                           packed_causal=None):
    """``blockdiag.masked_attention``'s contract on cuDNN: queries q [B, Lq, Hq, D] at global positions
    ``query_start + [0, Lq)`` over a key window keys/values [N, B, Hkv, D] with key_positions int32 [N]
    (-1: empty row), which holds every position a local query reads (its document up to itself).
    Returns [B, Lq, Hq, D] in q's dtype: padding rows 0, NaN by selection where a query may read a
    non-finite input, and everywhere when a piece needs more than ``max_runs`` segments."""
    attend_segments = _packed_causal if packed_causal is None else packed_causal
    batch, length = q.shape[:2]
    filled = jnp.where(key_positions >= 0, key_positions, jnp.iinfo(jnp.int32).min)
    order = jnp.argsort(filled)  # empty rows first, then ascending positions
    positions = filled[order]
    query_positions = query_start + jnp.arange(length, dtype=jnp.int32)
    # each local position is in the window once; unrolled (the default method is a while loop)
    local_rows = jnp.searchsorted(positions, query_positions, method="scan_unrolled")
    offsets, lengths, overflow = window_segments(positions, doc_ids, local_rows, max_runs)
    offsets, lengths = (jnp.broadcast_to(x, (batch, x.shape[1])) for x in (offsets, lengths))

    # cuDNN leaves the gradient rows outside every segment unwritten (NaN seen on an H200): keys and
    # values enter through a select, so those rows get an exact zero gradient
    covered = _rows_in_segments(offsets, lengths, positions.shape[0])[:, :, None, None]

    def attend(clean_q, clean_keys, clean_values):
        rows_q = jnp.zeros((batch, positions.shape[0], *q.shape[2:]), q.dtype).at[:, local_rows].set(clean_q)
        rows_k, rows_v = (jnp.where(covered, jnp.moveaxis(x[order], 0, 1), 0)  # [B, N, Hkv, D]
                          for x in (clean_keys, clean_values))
        out = attend_segments(rows_q, rows_k, rows_v, offsets, lengths, scale=scale)[:, local_rows]
        return _padding_zeroed(out, doc_ids[query_positions] > 0, overflow)

    return contain_nonfinite(attend, q, keys, values, key_positions, doc_ids,
                             query_start=query_start).astype(q.dtype)
