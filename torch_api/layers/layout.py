"""One rank's view of a packed batch for the torch layers: build once per step, share across layers.

A ``ShardLayout`` holds the host ``PackedLayout`` (replicated ids), the rank's GDP metadata, and
lazily built device tensors (conv/RoPE positions, cu_seqlens) and attention routings, so that N
layers of a step pay the host work and the cross-rank agreement once instead of N times::

    layout = build_shard_layout(doc_ids=global_doc_ids, total_len=T, cp_group=group)   # per step
    h = gdp_layer(h, layout=layout); h = attention_layer(h, layout=layout)

Without ``cp_group`` the same object describes the whole sequence on one device (cp_size 1).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from torch_api._dist import agree_or_raise, resolve_group
from cp_linear.packing import PackedLayout, layout_from_ids

_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


class ShardLayout:
    """Tokens ``[rank*L, (rank+1)*L)`` of a packed batch of T = cp_size * L tokens.

    packed        the host ``PackedLayout`` (doc_ids, seq_idx, position; replicated)
    group         the CP ProcessGroup, or None on one device
    cp_rank/size  this rank and the group size (0 and 1 without CP)
    gdp_metadata  ``PackedSequenceCPMetadata`` of the rank (None when unpacked)
    """

    def __init__(self, packed: PackedLayout, cp_group=None):
        if not isinstance(packed, PackedLayout):
            raise ValueError(f"packed must be a PackedLayout; received {type(packed).__name__}")
        self.packed = packed
        self.group = None if cp_group is None else resolve_group(cp_group)
        self.group_name = None if self.group is None else self.group.group_name
        if self.group is None:
            self.cp_rank, self.cp_size = 0, 1
        else:
            self.cp_rank, self.cp_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        packed.check_cp_size(self.cp_size)
        self.local_len = packed.total_len // self.cp_size
        self.gdp_metadata = packed.gdp_metadata(self.cp_rank, self.cp_size) if self.is_cp else None
        self._device_cache: dict = {}
        self._agreed: set = set()

    @property
    def is_cp(self) -> bool:
        return self.group is not None

    @property
    def shard_start(self) -> int:
        return self.cp_rank * self.local_len

    # ------------------------------------------------------------------ device tensors (cached)

    def _cached(self, key, build):
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]

    def positions(self, device) -> torch.Tensor:
        """int64 [L]: index of each local token within its sequence (global, across ranks)."""
        local = self.packed.local(self.packed.position, self.cp_rank, self.cp_size)
        return self._cached(("position", device), lambda: torch.from_numpy(local.copy()).to(device))

    def cu_seqlens(self, device) -> torch.Tensor | None:
        """int32 [N + 1] GDP sequence boundaries on one device; None when unpacked."""
        if not self.packed.packed:
            return None
        return self._cached(("cu", device), lambda: torch.from_numpy(self.packed.cu_seqlens()).to(device))

    def gdp_arrays(self, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(local cu_seqlens int32 [N + 1] or None when unpacked, rank_range int32 [2] =
        (preceding_rank_start, following_rank_stop)) on ``device``, built once: what the GDP CP
        custom op reads (``torch_api.gdp.library``)."""
        def build():
            meta = self.gdp_metadata
            if meta is None:
                return None, torch.tensor([0, self.cp_size], dtype=torch.int32, device=device)
            cu = torch.as_tensor(meta.local_cu_seqlens, dtype=torch.int32).to(device)
            span = torch.tensor([meta.preceding_rank_start, meta.following_rank_stop], dtype=torch.int32)
            return cu, span.to(device)

        return self._cached(("gdp", device), build)

    def materialize(self, device, *, hidden_shape=None, dtype=None) -> "ShardLayout":
        """Build every device tensor the layers read (positions, GDP arrays) on ``device`` now and,
        under CP with ``hidden_shape`` ([B, L, D] of the layer inputs) and ``dtype``, run the
        cross-rank agreement for that signature: call it once per batch before a compiled or
        CUDA-graph-captured step, whose traced code then only reads them (no collective but the
        layers' own, no host read). Returns self."""
        device = torch.device(device)
        if self.is_cp and hidden_shape is not None:
            shape = list(hidden_shape)
            error = None
            if len(shape) != 3 or shape[1] != self.local_len:
                error = f"hidden_shape must be [B, L={self.local_len}, D]; received {shape}"
            self._agree_signature(error, shape, dtype, device, "layer inputs")
        self.positions(device)
        if self.is_cp:
            self.gdp_arrays(device)
        else:
            self.cu_seqlens(device)
        return self

    def attention_routing(self, mode: str):
        """Helper-built ``BlockDiagRouting`` of this rank (CP only), one per exchange mode."""
        from torch_api.attention.blockdiag import prepare_blockdiag

        return self._cached(("routing", mode), lambda: prepare_blockdiag(self.packed.doc_ids, self.group, mode))

    def attention_layout(self):
        """``DocCausalLayout`` of the whole sequence on one device (no CP)."""
        from torch_api.attention.kernel import DocCausalLayout

        total = self.packed.total_len
        return self._cached("doc_layout", lambda: DocCausalLayout.from_doc_ids(self.packed.doc_ids, 0, total, 0, total))

    # ------------------------------------------------------------------ checks

    def hidden_error(self, hidden_states, hidden_size: int) -> str | None:
        """Local problem with a layer input ``[B, L, D]``, or None."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            shape = tuple(getattr(hidden_states, "shape", ()))
            return f"hidden_states must be a tensor [B, L, D]; received shape {shape}"
        batch, length, width = hidden_states.shape
        if length != self.local_len or width != hidden_size:
            return (f"hidden_states must be [B, L={self.local_len}, D={hidden_size}] for this layout "
                    f"(T = {self.packed.total_len} over {self.cp_size} rank(s)); received {tuple(hidden_states.shape)}")
        if self.packed.packed and batch != 1:
            return f"a packed batch (ids given) needs B = 1; received B = {batch}"
        if hidden_states.dtype not in _DTYPE_IDS:
            return f"hidden_states must be float32, bfloat16, float16 or float64; received {hidden_states.dtype}"
        return None

    def agree(self, error: str | None, hidden_states, what: str) -> None:
        """Raise ``error`` on every rank together (CP), or here (one device).

        Under CP the first call per input signature runs one small all-gather; later layers of the
        step with the same signature skip it. An error for an already agreed signature comes from
        the module itself (identical on every rank of a replicated model) and raises locally.
        """
        if not self.is_cp or _compiling():
            # under torch.compile the agreement ran eagerly (``materialize``); shapes are static here
            if error:
                raise ValueError(f"{what}: {error}")
            return
        shape = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else [-1, -1, -1]
        self._agree_signature(error, shape, getattr(hidden_states, "dtype", None),
                              getattr(hidden_states, "device", ""), what)

    def _agree_signature(self, error, shape, dtype, device, what: str) -> None:
        signature = (*shape, _DTYPE_IDS.get(dtype, 0), *self.packed.fingerprint(), self.cp_size,
                     zlib.crc32(str(device).split(":")[0].encode()) & 0xFFFF)
        if signature in self._agreed:
            if error:
                raise ValueError(f"{what}: {error}")
            return
        agree_or_raise(self.group, error, signature, what=what)
        self._agreed.add(signature)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def build_shard_layout(*, total_len: int, doc_ids=None, seq_idx=None, cu_seqlens=None, cp_group=None) -> ShardLayout:
    """A ``ShardLayout`` from *global* ids (replicated on every rank; host-read once).

    total_len: T, the global length (local length x cp_size). At most one of ``doc_ids`` (int [T],
    0 = padding), ``seq_idx`` (int [1, T] nondecreasing) or ``cu_seqlens`` (int [N + 1]); none of
    them means every batch row is one sequence of T tokens.
    """
    return ShardLayout(layout_from_ids(doc_ids=doc_ids, seq_idx=seq_idx, cu_seqlens=cu_seqlens, total_len=total_len),
                       cp_group)


def resolve_layout(hidden_states, *, layout=None, cp_group=None, doc_ids=None, seq_idx=None,
                   cu_seqlens=None) -> ShardLayout:
    """The layout a layer call runs with: ``layout`` as given, else one built from the ids.

    Building problems (bad ids) come from replicated data, so every rank raises the same error.
    """
    if layout is not None:
        if not isinstance(layout, ShardLayout):
            raise ValueError(
                f"layout must be a ShardLayout (torch_api.layers.build_shard_layout); received "
                f"{type(layout).__name__}. A bare PackedSequenceCPMetadata lacks where the shard's first "
                "sequence starts on the previous rank, which the conv halo and RoPE need")
        if any(x is not None for x in (doc_ids, seq_idx, cu_seqlens)):
            raise ValueError("pass either layout or ids (doc_ids / seq_idx / cu_seqlens), not both")
        if cp_group is not None and resolve_group(cp_group) is not layout.group:
            raise ValueError("cp_group differs from the group layout was built for")
        return layout
    world = 1 if cp_group is None else dist.get_world_size(resolve_group(cp_group))
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be a tensor [B, L, D]; received shape "
                         f"{tuple(getattr(hidden_states, 'shape', ()))}")
    try:
        return build_shard_layout(total_len=hidden_states.shape[1] * world, doc_ids=doc_ids, seq_idx=seq_idx,
                                  cu_seqlens=cu_seqlens, cp_group=cp_group)
    except ValueError as err:
        if cp_group is None:
            raise
        # e.g. a rank whose L disagrees: the others are about to enter the layer's agreement
        agree_or_raise(resolve_group(cp_group), str(err), (), what="layer layout")
        raise


__all__ = ["ShardLayout", "build_shard_layout", "resolve_layout"]
