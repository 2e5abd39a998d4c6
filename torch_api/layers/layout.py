"""One rank's view of a packed batch for the torch layers: build once per step, share across layers.

A ``ShardLayout`` holds the host ``PackedLayout`` (replicated ids), the rank's GDP metadata, and
lazily built device tensors (conv/RoPE positions, cu_seqlens) and attention routings, so that N
layers of a step pay the host work once instead of N times. A model (``HybridDecoder``) agrees on
all its layers once per call (``agree_model``); a layer used on its own agrees per call::

    layout = build_shard_layout(doc_ids=global_doc_ids, total_len=T, cp_group=group)   # per step
    h = gdp_layer(h, layout=layout); h = attention_layer(h, layout=layout)

A step compiled with ``torch.compile`` (or captured in a CUDA graph) cannot run the header inside
the traced code: the batch agrees eagerly first, and the layers, run with their checks off, only
read what ``materialize`` built::

    layout.materialize(device); model.agree(input_ids, layout=layout)             # eager, per batch
    logits = compiled_model(input_ids, layout=layout)                            # no header inside

Without ``cp_group`` the same object describes the whole sequence on one device (cp_size 1).

Graph-ready layouts (``max_sequences=``): every tensor a step reads has a shape fixed by
(T, cp_size, max_sequences), never by the packing, so ``torch.compile`` traces one graph for every
packing of that signature and a CUDA graph captured on one packing replays another after
``copy_packing_`` wrote the new values into the captured buffers::

    layout = build_shard_layout(doc_ids=ids, total_len=T, cp_group=group, max_sequences=64).materialize(dev)
    model.agree(input_ids, layout=layout)            # eager, once per batch: header + checks
    ... capture model(input_ids, layout=layout) and its backward in a CUDA graph ...
    layout.copy_packing_(build_shard_layout(doc_ids=new_ids, total_len=T, cp_group=group, max_sequences=64))
    model.agree(input_ids, layout=layout); graph.replay()

  * GDP: local ``cu_seqlens`` padded to ``max_sequences + 1`` entries with empty sequences at the end
    (every backend gives the same outputs and gradients as without them);
  * attention: the ``cp_linear::blockdiag_attention_static`` op (torch_api.attention.static), which
    reads the ids as a device tensor [T] and exchanges K/V with an all-gather (fixed shapes; the
    halo / a2a modes move less but their shapes follow the packing).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from cp_linear.packing import PackedLayout, layout_from_ids
from cp_linear.zigzag import LAYOUTS, build_zigzag_cp_metadata, check_layout, local_positions
from cp_linear.validation import digest
from torch_api._dist import agree_or_raise, resolve_group

_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


class ShardLayout:
    """One rank's L tokens of a packed batch of T = cp_size * L tokens.

    packed        the host ``PackedLayout`` (doc_ids, seq_idx, position; replicated, global order)
    group         the CP ProcessGroup, or None on one device
    cp_rank/size  this rank and the group size (0 and 1 without CP)
    shard_layout  "contiguous": tokens ``[rank*L, (rank+1)*L)``; "zigzag": chunks rank and
                  2·cp−1−rank of 2·cp (``cp_linear.zigzag``, load-balanced causal attention)
    global_positions  int64 [L]: the global index of each local token
    gdp_metadata  ``PackedSequenceCPMetadata`` of the rank (``ZigzagCPMetadata`` under zig-zag;
                  None when unpacked)
    """

    def __init__(self, packed: PackedLayout, cp_group=None, max_sequences: int | None = None,
                 shard_layout: str = "contiguous"):
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
        self.shard_layout = check_layout(shard_layout)
        self.local_len = packed.total_len // self.cp_size
        # raises alike on every rank (replicated T): zig-zag needs T divisible by 2·cp
        self.global_positions = local_positions(packed.total_len, self.cp_size, self.cp_rank, shard_layout)
        if shard_layout == "zigzag" and max_sequences is not None:
            raise ValueError("a graph-ready layout (max_sequences) supports the contiguous layout only; "
                             "received shard_layout='zigzag'")
        if shard_layout == "zigzag":
            self.gdp_metadata = (build_zigzag_cp_metadata(packed.seq_idx.reshape(1, -1), self.cp_rank, self.cp_size)
                                 if self.is_cp and packed.packed else None)
        else:
            self.gdp_metadata = packed.gdp_metadata(self.cp_rank, self.cp_size) if self.is_cp else None
        # from replicated ids only, so every rank raises the same error here, before any collective
        self.max_sequences = _check_capacity(packed, self.cp_size, max_sequences)
        self._device_cache: dict = {}
        self._covered: set = set()
        self._agreed_model: tuple | None = None  # the signature an explicit HybridDecoder.agree covered

    @property
    def static_shapes(self) -> bool:
        """True for a graph-ready layout (``max_sequences`` given): see the module docstring."""
        return self.max_sequences is not None

    def static_signature(self) -> tuple:
        """What fixes the shapes of a graph-ready layout: (T, cp_size, group, max_sequences, packed)."""
        return (self.packed.total_len, self.cp_size, self.group_name, self.max_sequences, self.packed.packed)

    @property
    def is_cp(self) -> bool:
        return self.group is not None

    @property
    def zigzag(self) -> bool:
        return self.shard_layout == "zigzag"

    @property
    def shard_start(self) -> int:
        return self.cp_rank * self.local_len

    @property
    def conv_reach(self) -> int:
        """Most tokens the conv halo may take from one neighbour: L (contiguous) or L / 2 (zig-zag chunk)."""
        return self.local_len // 2 if self.zigzag else self.local_len

    def local(self, values: np.ndarray) -> np.ndarray:
        """This rank's rows of a per-token array in global order [T, ...]."""
        return np.asarray(values)[self.global_positions]

    # ------------------------------------------------------------------ device tensors (cached)

    def _cached(self, key, build):
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]

    def positions(self, device) -> torch.Tensor:
        """int64 [L]: index of each local token within its sequence (global, across ranks)."""
        local = self.local(self.packed.position)
        return self._cached(("position", device), lambda: torch.from_numpy(local.copy()).to(device))

    def _padded(self, cu) -> np.ndarray:
        """int32 cu_seqlens, padded with empty sequences to ``max_sequences + 1`` entries when graph-ready."""
        cu = np.asarray(cu, dtype=np.int32)
        if self.max_sequences is None:
            return cu
        return np.concatenate([cu, np.full(self.max_sequences + 1 - cu.shape[0], cu[-1], np.int32)])

    def cu_seqlens(self, device) -> torch.Tensor | None:
        """int32 [N + 1] GDP sequence boundaries on one device ([max_sequences + 1] when graph-ready);
        None when unpacked."""
        if not self.packed.packed:
            return None
        return self._cached(("cu", device), lambda: torch.from_numpy(self._padded(self.packed.cu_seqlens())).to(device))

    def gdp_sequences(self, batch: int) -> int:
        """N, the GDP sequences of the layout: runs of equal ids (padding runs included), or the batch rows
        when unpacked; the rows of a GDP layer's ``initial_state`` / ``final_state``."""
        return len(self.packed.cu_seqlens()) - 1 if self.packed.packed else int(batch)

    def doc_ids_tensor(self, device) -> torch.Tensor:
        """int32 [T]: the global doc ids (0 = padding; all ones when unpacked), what the graph-ready
        attention op reads (``torch_api.attention.static``)."""
        return self._cached(("doc_ids", device),
                            lambda: torch.from_numpy(self.packed.doc_ids.astype(np.int32)).to(device))

    def gdp_arrays(self, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(local cu_seqlens int32 [N + 1] or None when unpacked, rank_range int32 [2] =
        (preceding_rank_start, following_rank_stop)) on ``device``, built once: what the GDP CP
        custom op reads (``torch_api.gdp.library``)."""
        if self.zigzag:
            raise ValueError("gdp_arrays describe one contiguous shard; a zig-zag layout runs the GDP op with its "
                             "ZigzagCPMetadata (gdp_metadata) instead")

        def build():
            meta = self.gdp_metadata
            if meta is None:
                return None, torch.tensor([0, self.cp_size], dtype=torch.int32, device=device)
            cu = torch.from_numpy(self._padded(meta.local_cu_seqlens)).to(device)
            span = torch.tensor([meta.preceding_rank_start, meta.following_rank_stop], dtype=torch.int32)
            return cu, span.to(device)

        return self._cached(("gdp", device), build)

    def materialize(self, device) -> "ShardLayout":
        """Build every device tensor the layers read (positions, GDP arrays) on ``device`` now: call it
        once per batch before a compiled or CUDA-graph-captured step, whose traced code then only
        reads them (no host read). The step's agreement runs eagerly too (``HybridDecoder.agree``).
        Returns self."""
        device = torch.device(device)
        self.positions(device)
        if self.is_cp and not self.zigzag:
            self.gdp_arrays(device)
        else:
            self.cu_seqlens(device)
        if self.static_shapes:
            self.doc_ids_tensor(device)
        return self

    def copy_packing_(self, source: "ShardLayout") -> "ShardLayout":
        """Take ``source``'s packing (a graph-ready layout of the same T, group and max_sequences) and
        write its values into this layout's device tensors *in place*, the buffers a captured CUDA
        graph reads; host state (ids, metadata, agreement records) is replaced. Checks use host state
        only and depend on replicated values, so they raise alike on every rank. Returns self."""
        if not isinstance(source, ShardLayout):
            raise ValueError(f"source must be a ShardLayout; received {type(source).__name__}")
        if not (self.static_shapes and source.static_shapes):
            raise ValueError("copy_packing_ needs graph-ready layouts on both sides (build_shard_layout(..., "
                             "max_sequences=...)); a layout without it has packing-dependent shapes")
        if source.static_signature() != self.static_signature():
            raise ValueError(f"copy_packing_: source has (T, cp_size, group, max_sequences, packed) = "
                             f"{source.static_signature()}; this layout {self.static_signature()}")
        built = {}
        for key in list(self._device_cache):
            if not isinstance(key, tuple) or key[0] not in _STATIC_KEYS:
                del self._device_cache[key]  # host-derived (routings, one-device attention layout): rebuilt lazily
                continue
            built[key] = getattr(source, _STATIC_KEYS[key[0]])(*key[1:])
        for key, new in built.items():
            old = self._device_cache[key]
            for target, value in zip(old if isinstance(old, tuple) else (old,), new if isinstance(new, tuple) else (new,)):
                if target is not None:
                    target.copy_(value)
        self.packed, self.gdp_metadata = source.packed, source.gdp_metadata
        self._covered, self._agreed_model = set(), None
        return self

    def attention_routing(self, mode: str):
        """Helper-built ``BlockDiagRouting`` of this rank (CP only), one per exchange mode."""
        from torch_api.attention.blockdiag import prepare_blockdiag

        return self._cached(("routing", mode),
                            lambda: prepare_blockdiag(self.packed.doc_ids, self.group, mode, self.shard_layout))

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

    def signature(self, hidden_states, layer_signature=()) -> tuple[int, ...]:
        """What every rank must share for a layer call: input shape and dtype, autocast, grad mode,
        this layout (ids fingerprint, T, cp_size), the device type and the layer's own signature."""
        if not isinstance(hidden_states, torch.Tensor):
            return self.signature_of((-1, -1, -1), None, "", layer_signature)
        return self.signature_of(tuple(hidden_states.shape), hidden_states.dtype, hidden_states.device,
                                 layer_signature)

    def signature_of(self, shape, dtype, device, layer_signature=()) -> tuple[int, ...]:
        """``signature`` of a layer input with this shape, dtype and device (before it exists)."""
        device = str(device).split(":")[0]
        autocast = torch.is_autocast_enabled(device) if device in ("cpu", "cuda") else False
        autocast_dtype = _DTYPE_IDS.get(torch.get_autocast_dtype(device), 0) if autocast else 0
        return (*shape, _DTYPE_IDS.get(dtype, 0), int(autocast), autocast_dtype, int(torch.is_grad_enabled()),
                *self.packed.fingerprint(), self.cp_size, LAYOUTS.index(self.shard_layout), digest([device]),
                *layer_signature)

    def covers(self, signature, what: str) -> bool:
        """True when a model agreement (``agree_model``) already covered this layer call."""
        return (tuple(signature), what) in self._covered

    def agree(self, error: str | None, signature, what: str) -> bool:
        """Raise ``error`` on every rank together (CP), or here (one device). Returns True when a model
        agreement already covered the call (no collective ran).

        Under CP one fixed-size header travels per call, unless ``agree_model`` covered this exact
        (signature, what): a per-layer cache that one rank could hit and another miss would leave
        them in different collectives, so only a decision every rank made together may skip it.
        """
        error = error or self.packed.error
        if not self.is_cp or compiling():
            # a compiled step sends no header: its batch was agreed eagerly (``HybridDecoder.agree``)
            if error:
                raise ValueError(f"{what}: {error}")
            return self.is_cp
        if self.covers(signature, what):
            if error:  # a covered call only fails through state the model agreement compared
                raise ValueError(f"{what}: {error}")
            return True
        agree_or_raise(self.group, error, signature, what=what)
        return False

    def agree_model(self, error: str | None, signature, layers: list[tuple[tuple[int, ...], str]], *,
                    value_flags=None, value_checks=()) -> None:
        """One header for a whole model call (``signature``: its inputs, every layer's configuration
        in order, parameter flags); on success every ``(layer signature, what)`` in ``layers`` is
        covered, so those layers add no header of their own (their ops still check values)."""
        error = error or self.packed.error
        if not self.is_cp:
            if error:
                raise ValueError(f"model inputs: {error}")
            return
        agree_or_raise(self.group, error, signature, what="model inputs", value_flags=value_flags,
                       value_checks=value_checks)
        self._covered.update((tuple(sig), what) for sig, what in layers)

    def record_model_agreement(self, signature) -> None:
        """An explicit ``HybridDecoder.agree`` (a collective every rank ran) covered ``signature``."""
        self._agreed_model = tuple(signature)

    def agreed_model(self, signature) -> bool:
        """True when an explicit agreement covered this model call, so the eager step sends no header
        (sync-free); a rank whose call differs from what it agreed raises here, alone, instead of
        entering a header the others skip."""
        if self._agreed_model is None:
            return False
        if tuple(signature) != self._agreed_model:
            raise ValueError("model inputs: this call differs (shapes, dtype, grad or autocast mode, layers) from the "
                             "batch HybridDecoder.agree covered on this layout; agree again for the new call")
        return True


# device tensors a graph-ready layout rewrites in place (``copy_packing_``): cache key -> builder method
_STATIC_KEYS = {"position": "positions", "cu": "cu_seqlens", "gdp": "gdp_arrays", "doc_ids": "doc_ids_tensor"}


def _check_capacity(packed: PackedLayout, cp_size: int, max_sequences) -> int | None:
    """``max_sequences`` checked against the most GDP sequences any shard holds (replicated ids)."""
    if max_sequences is None:
        return None
    if isinstance(max_sequences, bool) or not isinstance(max_sequences, (int, np.integer)) or max_sequences < 1:
        raise ValueError(f"max_sequences must be a positive int or None; received {max_sequences!r}")
    if packed.packed:
        shards = packed.seq_idx.reshape(cp_size, -1)
        most = int(np.max(1 + np.count_nonzero(shards[:, 1:] != shards[:, :-1], axis=1)))
        if most > max_sequences:
            raise ValueError(f"max_sequences = {max_sequences} is too small: a shard of this packing holds {most} "
                             f"sequences (T = {packed.total_len}, cp_size = {cp_size})")
    return int(max_sequences)


def compiling() -> bool:
    """True while torch.compile traces: the layers then send no agreement header (a collective with a
    host read cannot be traced) and read only what ``ShardLayout.materialize`` built."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def build_shard_layout(*, total_len: int, doc_ids=None, seq_idx=None, cu_seqlens=None, cp_group=None,
                       max_sequences: int | None = None, layout: str = "contiguous") -> ShardLayout:
    """A ``ShardLayout`` from *global* ids (replicated on every rank; host-read once).

    total_len: T, the global length (local length x cp_size). At most one of ``doc_ids`` (int [T],
    0 = padding), ``seq_idx`` (int [1, T] nondecreasing) or ``cu_seqlens`` (int [N + 1]); none of
    them means every batch row is one sequence of T tokens. ``max_sequences``: build a graph-ready
    layout whose shapes do not depend on the packing (module docstring); the most GDP sequences (runs
    of equal doc ids, padding runs included) one shard may hold, else ValueError on every rank.
    ``layout``: "contiguous" (rank r holds tokens [r·L, (r+1)·L)) or "zigzag" (chunks r and 2·cp−1−r of
    2·cp, ``cp_linear.zigzag``): the ids stay in global order, the caller feeds each rank the tokens
    at ``ShardLayout.global_positions``; conv and RoPE positions, the GDP summaries and the attention
    plan follow. Under zig-zag the GDP layers need their checks on and attention all-gathers K/V.
    """
    return ShardLayout(layout_from_ids(doc_ids=doc_ids, seq_idx=seq_idx, cu_seqlens=cu_seqlens, total_len=total_len),
                       cp_group, max_sequences, layout)


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
