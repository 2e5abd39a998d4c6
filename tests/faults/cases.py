"""The fault suite's torch cases: one function per fault, run on every rank of a process group.

Issue 16 classes (``FaultCase.fault_class``):
  1  ranks hold different packed ids (same length)          5  NaN/Inf in the inputs
  2  layer / model configuration differs across ranks       6  domain: g > 0, beta outside [0, 2], K, V, empty T
  3  ``check_inputs`` (or another flag) differs across ranks  7  metadata edited after it was built
  4  a later call changes shape, dtype or ids on one rank

A case either expects the *same* ValueError on every rank (``expect="error"``, its message matching
``pattern``) or returns, on every rank, the list of its own problems against the one-device op or a
reference (``expect="exact"``: an empty list on every rank). The runners (tests/faults/test_torch_faults.py
on gloo, benchmarks/gpu_fault_suite.py on NCCL) run each case in one task, time it, check it with
``problems_of`` and then run ``healthy`` to show that the group still works. Every function is defined
at module level (the pool pickles it) and creates its tensors with ``device(rank)``: the CPU, or GPU
``rank`` when ``$CP_LINEAR_FAULT_DEVICE`` is "cuda" (the NCCL runner sets it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cp_linear import build_packed_sequence_cp_metadata
from cp_linear.model_config import DecoderConfig

DEVICE_ENV = "CP_LINEAR_FAULT_DEVICE"
CASE_LIMIT_S = 30.0  # a case that takes longer than this hung somewhere (the pools time collectives out at 20 s)
LOCAL_LEN = 8
HEADS, KEY_DIM, VALUE_DIM, N_H = 2, 8, 6, 2
HIDDEN = 16


def device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if os.environ.get(DEVICE_ENV) == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class FaultCase:
    fault_class: int
    name: str
    fn: object
    args: tuple = ()
    world: int = 2
    expect: str = "error"  # "error" | "exact"
    pattern: str = ""

    @property
    def id(self) -> str:
        return f"class{self.fault_class}-{self.name}-w{self.world}"


# --------------------------------------------------------------------------- checking outcomes


def problems_of(case: FaultCase, outcome: list[tuple[bool, object]], elapsed: float) -> list[str]:
    """What is wrong with one run of ``case`` (``GlooPool.run_collect`` outcome); empty when it passed."""
    problems = []
    if elapsed > CASE_LIMIT_S:
        problems.append(f"took {elapsed:.1f} s (> {CASE_LIMIT_S} s): a rank waited on a collective")
    if case.expect == "error":
        for rank, (ok, value) in enumerate(outcome):
            if ok:
                problems.append(f"rank {rank} raised nothing and returned {value!r}")
            elif value.type_name != "ValueError":
                problems.append(f"rank {rank} raised {value.type_name}: {value.message[:300]}")
        messages = {value.message for ok, value in outcome if not ok and value.type_name == "ValueError"}
        if len(messages) > 1:
            problems.append(f"ranks raised different messages: {sorted(messages)}")
        for message in messages:
            if not re.search(case.pattern, message):
                problems.append(f"message {message!r} does not match {case.pattern!r}")
    else:
        for rank, (ok, value) in enumerate(outcome):
            if not ok:
                problems.append(f"rank {rank} raised {value.type_name}: {value.message[:300]}")
            elif value:
                problems.append(f"rank {rank}: {'; '.join(value)}")
    return problems


def healthy(rank: int, world: int) -> bool:
    """A correct collective (and an agreement header) after a case: the group must still be usable."""
    from torch_api._dist import agree_or_raise

    total = torch.full((1,), float(rank + 1), device=device(rank))
    dist.all_reduce(total)
    agree_or_raise(dist.group.WORLD, None, [world], what="health check")
    return float(total.item()) == world * (world + 1) / 2


# --------------------------------------------------------------------------- inputs


def seq_idx(lengths) -> np.ndarray:
    return np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)


def gdp_full_inputs(total: int, seed: int = 0) -> list[torch.Tensor]:
    """float32 q, k, v, g, beta of a whole packed sequence (CPU; the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    steps = total * N_H
    q = torch.randn(1, total, HEADS, KEY_DIM, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, steps, HEADS, KEY_DIM, generator=gen), dim=-1)
    v = torch.randn(1, steps, HEADS, VALUE_DIM, generator=gen)
    g = -torch.rand(1, total, HEADS, generator=gen)
    beta = torch.rand(1, steps, HEADS, generator=gen)
    return [q, k, v, g, beta]


def gdp_shard(full, rank: int, dev) -> list[torch.Tensor]:
    token = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    step = slice(token.start * N_H, token.stop * N_H)
    return [x[:, token if i in (0, 3) else step].contiguous().to(dev) for i, x in enumerate(full)]


def run_gdp_cp(rank, world, full, lengths, *, check_inputs=True, metadata=None, grad=False):
    from torch_api.gdp.cp import gdp_chunkwise_context_parallel

    dev = device(rank)
    shard = gdp_shard(full, rank, dev)
    if grad:
        shard = [x.requires_grad_() for x in shard]
    metadata = metadata or build_packed_sequence_cp_metadata(seq_idx(lengths), rank, world)
    out = gdp_chunkwise_context_parallel(*shard, cp_group=dist.group.WORLD, metadata=metadata, num_householder=N_H,
                                         check_inputs=check_inputs)
    return out, shard


def docs(*runs) -> list[int]:
    """docs((1, 5), (0, 3)) -> five 1s then three 0s."""
    return [doc for doc, length in runs for _ in range(length)]


def attention_full_inputs(total: int, *, heads=(4, 2), dim=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, heads[0], dim, generator=gen, dtype=dtype)
    k = torch.randn(1, total, heads[1], dim, generator=gen, dtype=dtype)
    v = torch.randn(1, total, heads[1], dim, generator=gen, dtype=dtype)
    return q, k, v


def attention_shard(tensors, rank, dev):
    return [x[:, rank * LOCAL_LEN:(rank + 1) * LOCAL_LEN].contiguous().to(dev) for x in tensors]


def small_gdp_config(**changes):
    from cp_linear.model_config import GDPConfig

    options = dict(hidden_size=HIDDEN, head_dim=8, num_heads=2, expand_v=1.0, num_householder=2, conv_size=4)
    options.update(changes)
    return GDPConfig(**options)


def layer_call(rank, world, layer, doc_ids, *, nan_at=None):
    from torch_api.layers import build_shard_layout

    dev = device(rank)
    torch.manual_seed(1)
    x = torch.randn(1, LOCAL_LEN, HIDDEN).to(dev)
    if nan_at is not None:
        x[0, nan_at, 0] = float("nan")
    layout = build_shard_layout(total_len=world * LOCAL_LEN, doc_ids=torch.tensor(doc_ids), cp_group=dist.group.WORLD)
    return layer.to(dev)(x, layout=layout)


# --------------------------------------------------------------------------- class 1: different packed ids


def gdp_ranks_hold_different_ids(rank, world):
    total = world * LOCAL_LEN
    lengths = [5, 6, total - 11] if rank == 0 else [3, 9, total - 12]  # same T, each self-consistent
    run_gdp_cp(rank, world, gdp_full_inputs(total), lengths)


def attention_ranks_hold_different_doc_ids(rank, world):
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    ids = docs((1, 5), (2, total - 5)) if rank == 0 else docs((1, 7), (2, total - 7))
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    blockdiag_attention(q, k, v, torch.tensor(ids), cp_group=dist.group.WORLD)


# --------------------------------------------------------------------------- class 2: configurations differ


def gdp_layer_config_differs(rank, world, field, value):
    from torch_api.layers import GatedDeltaProduct

    torch.manual_seed(0)
    changes = {field: value} if rank == world - 1 else {}
    layer_call(rank, world, GatedDeltaProduct(small_gdp_config(**changes)), docs((1, 5), (2, world * LOCAL_LEN - 5)))


def attention_layer_heads_differ(rank, world):
    from torch_api.layers import BlockDiagAttention

    torch.manual_seed(0)
    kv_heads = 1 if rank == world - 1 else 2
    layer = BlockDiagAttention(hidden_size=HIDDEN, num_heads=2, num_kv_heads=kv_heads, head_dim=8)
    layer_call(rank, world, layer, docs((1, 5), (2, world * LOCAL_LEN - 5)))


def decoder_differs(rank, world, layer_types_last_rank):
    from torch_api.layers import HybridDecoder

    torch.manual_seed(0)
    layer_types = tuple(layer_types_last_rank) if rank == world - 1 else ("gdp", "attention")
    config = DecoderConfig(vocab_size=32, hidden_size=HIDDEN, num_layers=len(layer_types), num_heads=2, head_dim=8,
                           num_kv_heads=1, layer_types=layer_types)
    model = HybridDecoder(config).to(device(rank))
    ids = torch.randint(0, 32, (1, LOCAL_LEN)).to(device(rank))
    logits = model(ids, doc_ids=torch.tensor(docs((1, 5), (2, world * LOCAL_LEN - 5))), cp_group=dist.group.WORLD)
    logits.float().sum().backward()


# --------------------------------------------------------------------------- class 3: check_inputs differs


def gdp_check_inputs_differs(rank, world):
    total = world * LOCAL_LEN
    out, _ = run_gdp_cp(rank, world, gdp_full_inputs(total), [5, total - 5], check_inputs=rank != world - 1)
    out.sum().backward()


def attention_check_inputs_differs(rank, world):
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    blockdiag_attention(q, k, v, torch.tensor(docs((1, 5), (2, total - 5))), cp_group=dist.group.WORLD,
                        check_inputs=rank != world - 1)


def gdp_layer_check_inputs_differs(rank, world):
    from torch_api.layers import GatedDeltaProduct

    torch.manual_seed(0)
    layer = GatedDeltaProduct(small_gdp_config(), cp_check_inputs=rank != world - 1)
    layer_call(rank, world, layer, docs((1, 5), (2, world * LOCAL_LEN - 5)))


# --------------------------------------------------------------------------- class 4: a later call changes


def attention_later_call_changes(rank, world, change):
    """Call once (agreed by every rank), then call again with one rank changed: dtype, L, D or the ids."""
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    ids = torch.tensor(docs((1, 5), (2, total - 5)))
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    blockdiag_attention(q, k, v, ids, cp_group=dist.group.WORLD)
    if rank == world - 1:
        if change == "dtype":
            q, k, v = (x.double() for x in (q, k, v))
        elif change == "length":
            q, k, v = (x[:, :-1] for x in (q, k, v))
        elif change == "head_dim":
            q, k, v = (torch.cat([x, x[..., :2]], dim=-1) for x in (q, k, v))
        elif change == "doc_ids_in_place":
            ids[5] = 1  # still valid ids (document 1 grows by one token), edited in place
    blockdiag_attention(q, k, v, ids, cp_group=dist.group.WORLD)


# --------------------------------------------------------------------------- class 5: NaN / Inf


def gdp_nonfinite_checked(rank, world, name):
    total = world * LOCAL_LEN
    full = gdp_full_inputs(total)
    index = ["q", "k", "v", "g", "beta"].index(name)
    if rank == world - 1:  # the first row of this rank's shard
        row = (world - 1) * LOCAL_LEN * (1 if name in ("q", "g") else N_H)
        full[index] = full[index].clone()
        full[index][0, row].view(-1)[0] = float("nan")
    run_gdp_cp(rank, world, full, [5, total - 5])


def gdp_output_grad_nonfinite(rank, world):
    total = world * LOCAL_LEN
    out, _ = run_gdp_cp(rank, world, gdp_full_inputs(total), [5, total - 5], grad=True)
    grad = torch.ones_like(out)
    if rank == 0:
        grad[0, 1, 0, 0] = float("inf")
    out.backward(grad)


def attention_nonfinite_checked(rank, world):
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    if rank == 0:
        k[0, 2, 1, 0] = float("nan")
    blockdiag_attention(q, k, v, torch.tensor(docs((1, 5), (2, total - 5))), cp_group=dist.group.WORLD)


def gdp_layer_nonfinite_checked(rank, world):
    from torch_api.layers import GatedDeltaProduct

    torch.manual_seed(0)
    layer_call(rank, world, GatedDeltaProduct(small_gdp_config()), docs((1, 5), (2, world * LOCAL_LEN - 5)),
               nan_at=3 if rank == world - 1 else None)


def expected_gdp_poison(lengths, bad_tokens, total) -> np.ndarray:
    """bool [T]: a token's output depends on a non-finite input of an earlier token of its sequence."""
    poisoned = np.zeros(total, bool)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for start, stop in zip(starts[:-1], starts[1:]):
        first_bad = [t for t in bad_tokens if start <= t < stop]
        if first_bad:
            poisoned[min(first_bad):stop] = True
    return poisoned


def contained_gdp_gradients(run, clean, dirty, poisoned, state_poisoned, final_bad, n_h, seed=0):
    """The gradients of a contained GDP step (``run(inputs, check_inputs=False) -> (o, final_state)`` on
    ``dirty``, a copy of ``clean`` with non-finite entries), and those of the clean step whose output and
    final-state gradients are zero where ``poisoned`` bool [T, H] / ``final_bad`` bool [N, H]: the
    contained step passes no gradient through a poisoned output, so both must agree everywhere. Exactly
    zero: q's gradient at a poisoned (token, head), and every input's where ``state_poisoned`` bool [T, H]
    (at or after a non-finite k, v, g or beta of its sequence: all it reaches is poisoned).
    -> (dirty grads, clean grads, zero masks), the masks bool [rows, H] per input."""
    grads = {}
    for name, inputs, check in (("dirty", dirty, False), ("clean", clean, True)):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out, final = run(leaves, check_inputs=check)
        gen = torch.Generator().manual_seed(seed)  # the same output gradients for both
        do = torch.randn(out.shape, generator=gen).to(out.dtype)
        dfinal = torch.randn(final.shape, generator=gen)
        if name == "clean":
            do = do * torch.from_numpy(~poisoned)[None, :, :, None].to(do.dtype)
            dfinal = dfinal * torch.from_numpy(~final_bad)[:, :, None, None]
        torch.autograd.backward([out, final], [do, dfinal])
        grads[name] = [x.grad for x in leaves]
    zero = [torch.from_numpy(poisoned)] + [torch.from_numpy(np.repeat(state_poisoned, per, axis=0))
                                           for per in (n_h, n_h, 1, n_h)]  # q, then k, v, g, beta
    return grads["dirty"], grads["clean"], zero


def gdp_nonfinite_contained(rank, world):
    """check_inputs=False: NaN in v (a sequence spanning ranks 0-1, head 1) and -Inf in g (the last
    sequence, head 0). The outputs that depend on them are NaN, every other output equals the
    one-device op on clean inputs, and so do the gradients of every (sequence, head) without one."""
    from torch_api.gdp.ops import gated_delta_product

    total = world * LOCAL_LEN
    lengths = [3, 9, total - 12]  # sequence 1 = tokens 3..11 spans ranks 0 and 1
    bad = [(6, 1), (total - 3, 0)]  # (token, head)
    clean = gdp_full_inputs(total)
    dirty = [x.clone() for x in clean]
    dirty[2][0, 6 * N_H + 1, 1, 2] = float("nan")
    dirty[3][0, total - 3, 0] = float("-inf")
    poisoned = np.zeros((total, HEADS), bool)
    untouched = np.ones((total, HEADS), bool)  # (token, head) whose sequence holds no bad input
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for token, head in bad:
        poisoned[:, head] |= expected_gdp_poison(lengths, [token], total)
        sequence = np.searchsorted(starts, token, side="right") - 1
        untouched[starts[sequence]:starts[sequence + 1], head] = False

    out, shard = run_gdp_cp(rank, world, dirty, lengths, check_inputs=False, grad=True)
    finite = torch.isfinite(out).all(-1)[0].cpu()  # [L, H]
    (torch.where(torch.isfinite(out), out, 0.0) ** 2).sum().backward()
    cu = torch.tensor(starts, dtype=torch.int32)
    ref_in = [x.clone().requires_grad_() for x in clean]
    ref, _ = gated_delta_product(*ref_in, num_householder=N_H, cu_seqlens=cu)
    weight = torch.from_numpy(~poisoned).float()[None, :, :, None]
    (ref.pow(2) * weight).sum().backward()

    token = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    problems = []
    if not np.array_equal(~finite.numpy(), poisoned[token]):
        problems.append(f"non-finite (token, head) at {np.argwhere(~finite.numpy()).tolist()}, expected "
                        f"{np.argwhere(poisoned[token]).tolist()} (local tokens)")
    error = (out[0].detach().cpu()[finite] - ref[0, token].detach()[finite]).abs().max().item()
    if error > 1e-4:
        problems.append(f"finite outputs differ from the clean one-device op by {error:.2e}")
    for name, mine, theirs, per in zip(("q", "k", "v", "g", "beta"), shard, ref_in, (1, N_H, N_H, 1, N_H)):
        keep = torch.from_numpy(np.repeat(untouched[token], per, axis=0))  # [rows, H]
        mine_grad = mine.grad[0].cpu()[keep]
        ref_grad = theirs.grad[0, token.start * per:token.stop * per][keep]
        if not torch.allclose(mine_grad, ref_grad, rtol=1e-3, atol=1e-4):
            error = (mine_grad - ref_grad).abs().max().item()
            problems.append(f"d{name} of the untouched sequences differs from the one-device op by {error:.2e}")
    return problems


def attention_nonfinite_contained(rank, world):
    """check_inputs=False: NaN in a padding token's v (rank 0), Inf in k inside document 2 (rank 1):
    every other output equals the float64 reference on clean inputs; padding rows stay 0."""
    from cp_linear.reference import blockdiag_attention as reference
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    ids = docs((1, 4), (0, 2), (2, 6), (3, total - 12))  # padding at 4, 5; document 2 = tokens 6..11
    clean = attention_full_inputs(total)
    q, k, v = (x.clone() for x in clean)
    v[0, 5, 1, 0] = float("nan")  # padding token, on rank 0
    k[0, 9, 0, 3] = float("inf")  # document 2, on rank 1 (kv head 0 -> q heads 0, 1)
    out = blockdiag_attention(*attention_shard((q, k, v), rank, device(rank)), torch.tensor(ids),
                              cp_group=dist.group.WORLD, check_inputs=False).cpu()
    ref = torch.from_numpy(reference(*(x.double().numpy() for x in clean), np.array(ids)))
    token = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)
    expected = np.zeros((total, 4), bool)
    expected[9:12, 0:2] = True
    expected = expected[token]
    got = ~torch.isfinite(out[0]).all(-1).numpy()
    problems = []
    if not np.array_equal(got, expected):
        problems.append(f"non-finite outputs at {np.argwhere(got).tolist()}, expected {np.argwhere(expected).tolist()}")
    mask = torch.from_numpy(~got)
    error = (out[0][mask].double() - ref[0, token][mask]).abs().max().item()
    if error > 1e-4:
        problems.append(f"finite outputs differ from the float64 reference by {error:.2e}")
    padding = torch.tensor(ids)[token] == 0
    if padding.any() and not torch.equal(out[0][padding], torch.zeros_like(out[0][padding])):
        problems.append("padding rows are not exactly zero")
    return problems


# --------------------------------------------------------------------------- class 6: domain


def gdp_domain(rank, world, fault):
    total = world * LOCAL_LEN
    full = gdp_full_inputs(total)
    lengths = [5, total - 5]
    if fault == "g_positive" and rank == world - 1:
        full[3] = full[3].clone()
        full[3][0, -1, 0] = 20.0
    elif fault == "beta_above_2" and rank == 0:
        full[4] = full[4] + 2.0
    elif fault == "beta_negative" and rank == world - 1:
        full[4] = full[4] - 1.0
    elif fault == "key_dim_300":
        full[0], full[1] = torch.zeros(*full[0].shape[:3], 300), torch.zeros(*full[1].shape[:3], 300)
    elif fault == "value_dim_600":
        full[2] = torch.zeros(*full[2].shape[:3], 600)
    elif fault == "empty_shards":
        from torch_api.gdp.cp import gdp_chunkwise_context_parallel

        q, k, v, g, beta = (x[:, :0].to(device(rank)) for x in full)
        gdp_chunkwise_context_parallel(q, k, v, g, beta, cp_group=dist.group.WORLD, num_householder=N_H)
        return
    run_gdp_cp(rank, world, full, lengths)


def attention_scale_differs(rank, world):
    """A scale that differs on one rank would only change that rank's numbers: silently wrong."""
    from torch_api.attention.blockdiag import blockdiag_attention

    total = world * LOCAL_LEN
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    blockdiag_attention(q, k, v, torch.tensor(docs((1, 5), (2, total - 5))), cp_group=dist.group.WORLD,
                        scale=0.5 if rank == world - 1 else None)


def decoder_token_out_of_range(rank, world):
    from torch_api.layers import HybridDecoder

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=32, hidden_size=HIDDEN, num_layers=2, num_heads=2, head_dim=8, num_kv_heads=1)
    model = HybridDecoder(config).to(device(rank))
    ids = torch.randint(0, 32, (1, LOCAL_LEN))
    if rank == world - 1:
        ids[0, 3] = 32  # an embedding lookup would fail on this rank alone
    model(ids.to(device(rank)), doc_ids=torch.tensor(docs((1, 5), (2, world * LOCAL_LEN - 5))),
          cp_group=dist.group.WORLD)


# --------------------------------------------------------------------------- class 7: edited metadata


def gdp_edited_metadata(rank, world, ranks_that_edit):
    total = world * LOCAL_LEN
    lengths = [3, total - 3]  # rank 1's first sequence starts on rank 0: preceding_rank_start = 0
    metadata = build_packed_sequence_cp_metadata(seq_idx(lengths), rank, world)
    if ranks_that_edit == "all" or rank == world - 1:
        metadata = dataclasses.replace(metadata, preceding_rank_start=rank)  # "starts here": drops its state
    run_gdp_cp(rank, world, gdp_full_inputs(total), lengths, metadata=metadata)


def attention_edited_routing(rank, world):
    from torch_api.attention.blockdiag import blockdiag_attention, prepare_blockdiag

    total = world * LOCAL_LEN
    routing = prepare_blockdiag(docs((1, 5), (2, total - 5)), dist.group.WORLD)
    if rank == world - 1:
        # would silently drop the first keys of the document it continues
        routing.exchange = dataclasses.replace(routing.exchange, key_start=routing.exchange.key_start + 2)
    q, k, v = attention_shard(attention_full_inputs(total), rank, device(rank))
    blockdiag_attention(q, k, v, routing, cp_group=dist.group.WORLD)


def layer_edited_layout(rank, world):
    from torch_api.layers import GatedDeltaProduct
    from torch_api.layers.layout import ShardLayout
    from cp_linear.packing import PackedLayout

    torch.manual_seed(0)
    total = world * LOCAL_LEN
    packed = PackedLayout.from_doc_ids(docs((1, 5), (2, total - 5)))
    if rank == world - 1:
        position = packed.position.copy()
        position[5:] = np.arange(total - 5) + 5  # conv and RoPE would reach across the document start
        packed = dataclasses.replace(packed, position=position)
    layout = ShardLayout(packed, dist.group.WORLD)
    x = torch.randn(1, LOCAL_LEN, HIDDEN).to(device(rank))
    GatedDeltaProduct(small_gdp_config()).to(device(rank))(x, layout=layout)


# --------------------------------------------------------------------------- the registry

_DIFFER = r"disagree across ranks"

CASES = [
    FaultCase(1, "gdp-ranks-hold-different-ids", gdp_ranks_hold_different_ids,
              pattern=r"GDP context-parallel forward disagree across ranks"),
    FaultCase(1, "gdp-ranks-hold-different-ids", gdp_ranks_hold_different_ids, world=3,
              pattern=r"GDP context-parallel forward disagree across ranks"),
    FaultCase(1, "attention-ranks-hold-different-doc-ids", attention_ranks_hold_different_doc_ids, pattern=_DIFFER),
    FaultCase(2, "gdp-layer-num-householder", gdp_layer_config_differs, ("num_householder", 3), pattern=_DIFFER),
    FaultCase(2, "gdp-layer-conv-size", gdp_layer_config_differs, ("conv_size", 3), world=3, pattern=_DIFFER),
    FaultCase(2, "gdp-layer-short-conv-on-one-rank", gdp_layer_config_differs, ("use_short_conv", False),
              pattern=_DIFFER),
    FaultCase(2, "gdp-layer-heads", gdp_layer_config_differs, ("num_heads", 1), pattern=_DIFFER),
    FaultCase(2, "attention-layer-kv-heads", attention_layer_heads_differ, pattern=_DIFFER),
    FaultCase(2, "decoder-layer-order", decoder_differs, (("attention", "gdp"),), pattern=r"model inputs " + _DIFFER),
    FaultCase(2, "decoder-layer-count", decoder_differs, (("gdp", "attention", "gdp"),), world=3,
              pattern=r"model inputs " + _DIFFER),
    FaultCase(3, "gdp-op", gdp_check_inputs_differs, pattern=_DIFFER),
    FaultCase(3, "attention-op", attention_check_inputs_differs, world=3, pattern=_DIFFER),
    FaultCase(3, "gdp-layer", gdp_layer_check_inputs_differs, pattern=_DIFFER),
    FaultCase(3, "attention-scale", attention_scale_differs, pattern=_DIFFER),
    FaultCase(4, "attention-dtype", attention_later_call_changes, ("dtype",), pattern=_DIFFER),
    FaultCase(4, "attention-local-length", attention_later_call_changes, ("length",),
              pattern=r"rejected on 1 rank\(s\) — rank \d: expected q \[B, L=8"),
    FaultCase(4, "attention-head-dim", attention_later_call_changes, ("head_dim",), world=3, pattern=_DIFFER),
    FaultCase(4, "attention-doc-ids-edited-in-place", attention_later_call_changes, ("doc_ids_in_place",),
              pattern=_DIFFER),
    FaultCase(5, "gdp-nan-in-v-checked", gdp_nonfinite_checked, ("v",),
              pattern=r"GDP context-parallel forward rejected on 1 rank\(s\) — rank \d: non-finite .* in v"),
    FaultCase(5, "gdp-nan-in-q-checked", gdp_nonfinite_checked, ("q",), world=3,
              pattern=r"rank \d: non-finite .* in q"),
    FaultCase(5, "gdp-inf-in-output-grad-checked", gdp_output_grad_nonfinite,
              pattern=r"backward rejected on 1 rank\(s\) — rank 0: non-finite .* in output_grad"),
    FaultCase(5, "attention-nan-in-k-checked", attention_nonfinite_checked,
              pattern=r"blockdiag_attention inputs rejected on 1 rank\(s\) — rank 0: non-finite .* in k"),
    FaultCase(5, "gdp-layer-nan-in-hidden-checked", gdp_layer_nonfinite_checked,
              pattern=r"rejected on 1 rank\(s\) — rank \d: non-finite values \(NaN or Inf\) in q, k, v"),
    FaultCase(5, "gdp-nonfinite-contained", gdp_nonfinite_contained, expect="exact"),
    FaultCase(5, "gdp-nonfinite-contained", gdp_nonfinite_contained, world=3, expect="exact"),
    FaultCase(5, "attention-nonfinite-contained", attention_nonfinite_contained, expect="exact"),
    FaultCase(5, "attention-nonfinite-contained", attention_nonfinite_contained, world=3, expect="exact"),
    FaultCase(6, "gdp-g-positive", gdp_domain, ("g_positive",), pattern=r"rank \d: g > 0"),
    FaultCase(6, "gdp-beta-above-2", gdp_domain, ("beta_above_2",), world=3, pattern=r"rank 0: beta outside \[0, 2\]"),
    FaultCase(6, "gdp-beta-negative", gdp_domain, ("beta_negative",), pattern=r"rank \d: beta outside \[0, 2\]"),
    FaultCase(6, "gdp-key-dim-300", gdp_domain, ("key_dim_300",), pattern=r"K = 300 exceeds the supported maximum"),
    FaultCase(6, "gdp-value-dim-600", gdp_domain, ("value_dim_600",), pattern=r"V = 600 exceeds the supported maximum"),
    FaultCase(6, "gdp-empty-shards", gdp_domain, ("empty_shards",), pattern=r"empty inputs are not supported"),
    FaultCase(6, "decoder-token-id-out-of-range", decoder_token_out_of_range,
              pattern=r"model inputs rejected on 1 rank\(s\) — rank \d: token ids outside \[0, 32\)"),
    FaultCase(7, "gdp-metadata-edited-on-one-rank", gdp_edited_metadata, ("one",),
              pattern=r"rank (\d): metadata.preceding_rank_start = \1 does not match"),
    FaultCase(7, "gdp-metadata-edited-on-every-rank", gdp_edited_metadata, ("all",), world=3,
              pattern=r"metadata.preceding_rank_start = \d does not match"),
    FaultCase(7, "attention-routing-edited", attention_edited_routing,
              pattern=r"rank \d: the BlockDiagRouting was edited"),
    FaultCase(7, "layer-packed-layout-edited", layer_edited_layout,
              pattern=r"rank \d: PackedLayout.position does not match its doc_ids"),
]
