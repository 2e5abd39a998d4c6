import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_linear import build_blockdiag_plan, build_packed_sequence_cp_metadata, exchange_bytes, needed_kv_a2a_splits
from cp_linear.plan import (
    exchange_routing,
    exchange_shape,
    exchange_tokens_received,
    ragged_routing,
    resolve_exchange_mode,
)


def seq_idx_from_lengths(lengths):
    return np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)


# ------------------------------------------------------------------ packed-sequence metadata


def test_metadata_matches_hand_worked_example_5_4_7_at_cp4():
    ids = seq_idx_from_lengths([5, 4, 7])
    expected = {0: (0, 2, [0, 4]), 1: (0, 3, [0, 1, 4]), 2: (1, 4, [0, 1, 4]), 3: (2, 4, [0, 4])}
    for rank, (start, stop, cu) in expected.items():
        md = build_packed_sequence_cp_metadata(ids, rank, 4)
        assert (md.preceding_rank_start, md.following_rank_stop) == (start, stop)
        assert md.local_cu_seqlens.tolist() == cu
        assert md.local_cu_seqlens.dtype == np.int32
        assert md.local_seq_idx.tolist() == [ids[0, rank * 4:(rank + 1) * 4].tolist()]


def test_metadata_when_documents_end_on_rank_boundaries():
    ids = seq_idx_from_lengths([4, 4, 8])
    got = [build_packed_sequence_cp_metadata(ids, r, 4) for r in range(4)]
    assert [(m.preceding_rank_start, m.following_rank_stop) for m in got] == [(0, 1), (1, 2), (2, 4), (2, 4)]
    assert got[1].starts_new_sequence and got[1].ends_sequence
    assert not got[3].starts_new_sequence


def test_metadata_accepts_torch_and_jax_arrays():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    ids = seq_idx_from_lengths([3, 9, 4])
    ref = build_packed_sequence_cp_metadata(ids, 2, 4)
    for arr in (torch.as_tensor(ids), jnp.asarray(ids)):
        md = build_packed_sequence_cp_metadata(arr, 2, 4)
        assert md.local_cu_seqlens.tolist() == ref.local_cu_seqlens.tolist()
        assert (md.preceding_rank_start, md.following_rank_stop) == (ref.preceding_rank_start, ref.following_rank_stop)


def brute_force_metadata(ids, rank, cp):
    length = ids.shape[1] // cp
    local = ids[0, rank * length:(rank + 1) * length]
    first = min(i for i in range(ids.shape[1]) if ids[0, i] == local[0])
    last = max(i for i in range(ids.shape[1]) if ids[0, i] == local[-1])
    cu = [0] + [i for i in range(1, length) if local[i] != local[i - 1]] + [length]
    return first // length, last // length + 1, cu


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.sampled_from([1, 2, 3, 4, 8]))
def test_metadata_agrees_with_brute_force(lengths, cp):
    total = sum(lengths)
    lengths[-1] += (-total) % cp  # make T divisible by cp
    ids = seq_idx_from_lengths(lengths)
    for rank in range(cp):
        md = build_packed_sequence_cp_metadata(ids, rank, cp)
        start, stop, cu = brute_force_metadata(ids, rank, cp)
        assert (md.preceding_rank_start, md.following_rank_stop, md.local_cu_seqlens.tolist()) == (start, stop, cu)


@pytest.mark.parametrize(
    "ids, rank, cp, match",
    [
        pytest.param(np.array([[0, 0, 1, 0]]), 0, 2, "nondecreasing", id="non-monotone"),
        pytest.param(np.array([[0, 0, 1]]), 0, 2, "multiple of cp_size", id="T-not-divisible"),
        pytest.param(np.array([[0, 0, 1, 1]]), 2, 2, "cp_rank", id="rank-too-large"),
        pytest.param(np.array([[0, 0, 1, 1]]), -1, 2, "cp_rank", id="negative-rank"),
        pytest.param(np.array([0, 0, 1, 1]), 0, 2, r"\[1, T\]", id="1d-ids"),
        pytest.param(np.zeros((2, 4), np.int64), 0, 2, r"\[1, T\]", id="two-rows"),
        pytest.param(np.array([[0.0, 0.0, 1.0, 1.0]]), 0, 2, "integers", id="float-ids"),
        pytest.param(np.array([[0, 0, 1, 1]]), 0, 0, "cp_size", id="zero-cp"),
    ],
)
def test_metadata_rejects_bad_input(ids, rank, cp, match):
    with pytest.raises(ValueError, match=match):
        build_packed_sequence_cp_metadata(ids, rank, cp)


# ------------------------------------------------------------------ block-diagonal plans


def brute_force_needed(doc_ids, rank, cp):
    """Range of keys rank needs, by asking every query which keys it may see."""
    length = len(doc_ids) // cp
    needed = [j for i in range(rank * length, (rank + 1) * length) if doc_ids[i] > 0
              for j in range(i + 1) if doc_ids[j] == doc_ids[i]]
    if not needed:
        return None
    return min(min(needed), rank * length), max(needed) + 1


def test_blockdiag_plan_with_straddling_document_and_interior_padding():
    doc_ids = np.array([1, 1, 1, 0, 2, 2, 2, 2, 2, 2, 0, 0, 3, 3, 0, 0])
    plan = build_blockdiag_plan(doc_ids, 4)
    assert plan.local_len == 4
    assert plan.s_first == (0, 4, 4, 12)
    assert plan.real_end == (3, 8, 10, 14)
    assert plan.back == (0, 0, 4, 0)
    assert plan.use_halo and plan.halo_len == 4
    assert plan.recv[2] == ((0, 0), (4, 8), (8, 10), (12, 12))


def test_blockdiag_plan_document_over_all_ranks_rules_out_halo():
    plan = build_blockdiag_plan(np.ones(12, np.int64), 3)
    assert plan.back == (0, 4, 8)
    assert not plan.use_halo


def test_blockdiag_plan_all_padding_rank_has_empty_range():
    plan = build_blockdiag_plan(np.array([1, 1, 0, 0, 0, 0, 2, 2]), 4)
    assert (plan.s_first[1], plan.real_end[1]) == (2, 2)
    assert plan.needed_len(1) == 0
    assert needed_kv_a2a_splits(plan, 1)[1] == [0, 0, 0, 0]


@st.composite
def doc_layouts(draw):
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 10)), min_size=1, max_size=8))
    ids, next_doc = [], 1
    for is_padding, length in runs:
        if is_padding:
            ids += [0] * length
        else:
            ids += [next_doc] * length
            next_doc += 1
    ids += [0] * ((-len(ids)) % cp)
    return np.array(ids, np.int64), cp


@settings(max_examples=200, deadline=None)
@given(doc_layouts())
def test_a2a_splits_are_symmetric_and_rebuild_the_needed_range(layout):
    doc_ids, cp = layout
    plan = build_blockdiag_plan(doc_ids, cp)
    length = plan.local_len
    splits = [needed_kv_a2a_splits(plan, r) for r in range(cp)]
    for src in range(cp):
        for dst in range(cp):
            assert splits[src][0][dst] == splits[dst][1][src]
    for rank in range(cp):
        expected = brute_force_needed(doc_ids, rank, cp)
        if expected is None:
            assert plan.needed_len(rank) == 0
        else:
            assert (plan.s_first[rank], plan.real_end[rank]) == expected
        # what each source sends (its local indices, shifted to global) concatenates to the range
        received = []
        for src in range(cp):
            in_splits, _, send_index = splits[src]
            offset = sum(in_splits[:rank])
            received += (send_index[offset:offset + in_splits[rank]] + src * length).tolist()
        assert received == list(range(plan.s_first[rank], plan.real_end[rank]))
        assert plan.back[rank] == rank * length - plan.s_first[rank]
    assert plan.use_halo == all(b <= length for b in plan.back)


def test_exchange_volume_counts_the_tokens_each_mode_moves():
    # L = 3; each document spans two ranks, so ranks 1 and 3 each need their left neighbour's 3 tokens
    doc_ids = np.array([1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2])
    plan = build_blockdiag_plan(doc_ids, 4)
    assert plan.back == (0, 3, 0, 3)
    assert exchange_tokens_received(plan, "allgather") == [9, 9, 9, 9]
    assert exchange_tokens_received(plan, "halo") == [0, 3, 3, 3]
    assert exchange_tokens_received(plan, "a2a") == [0, 3, 0, 3]
    per_token = 2 * 2 * 2 * 8 * 2  # K and V, batch 2, 2 heads, dim 8, 2 bytes
    sizes = exchange_bytes(plan, "a2a", batch=2, kv_heads=2, head_dim=8, itemsize=2)
    assert sizes == {"total": 6 * per_token, "max_per_rank": 3 * per_token}


# T = 16, cp 4, L = 4: document 2 runs over tokens 5..14 (rank 3 needs it from rank 1: back 7 > L)
SPANS_THREE = np.array([1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0])


def test_auto_resolves_to_halo_when_straddles_fit_else_a2a_and_forced_halo_names_the_rank():
    fits = build_blockdiag_plan(np.array([1, 1, 1, 2, 2, 2, 2, 2]), 2)
    assert resolve_exchange_mode("auto", fits) == "halo" and resolve_exchange_mode("allgather", fits) == "allgather"
    spans = build_blockdiag_plan(SPANS_THREE, 4)
    assert resolve_exchange_mode("auto", spans) == "a2a"
    with pytest.raises(ValueError, match="rank 3's first document starts 7 tokens before its shard"):
        resolve_exchange_mode("halo", spans)
    with pytest.raises(ValueError, match="mode must be one of"):
        resolve_exchange_mode("ring", spans)


@pytest.mark.parametrize("mode", ["allgather", "halo", "a2a"])
def test_routing_window_covers_exactly_the_keys_each_rank_attends_to(mode):
    doc_ids = np.array([1, 1, 1, 2, 2, 2, 2, 2, 0, 3, 3, 3])  # L = 4 over cp 3: every straddle fits
    plan = build_blockdiag_plan(doc_ids, 3)
    for rank in range(3):
        routing = exchange_routing(plan, mode, rank)
        window_len = {"allgather": 12, "halo": plan.halo_len + 4, "a2a": plan.needed_len(rank)}[mode]
        window = range(routing.window_start, routing.window_start + window_len)  # global positions received
        assert routing.mode == mode and (routing.key_start, routing.key_stop) == (plan.s_first[rank],
                                                                                 plan.real_end[rank])
        assert routing.key_start in window or routing.key_start == routing.key_stop
        assert routing.key_stop - 1 in window or routing.key_start == routing.key_stop


def test_ragged_tables_deliver_each_rank_exactly_its_needed_range():
    plan = build_blockdiag_plan(SPANS_THREE, 4)
    shape = exchange_shape(plan, "a2a", a2a_impl="ragged", bucket=True)
    assert shape.recv_len >= max(plan.back) and shape.recv_len & (shape.recv_len - 1) == 0  # a power of two
    send_index, input_offsets, send_sizes, output_offsets, recv_sizes = ragged_routing(plan, shape)
    length = plan.local_len
    for dst in range(4):  # run the ragged all-to-all on the host with global positions as payload
        buffer = np.full(shape.recv_len, -1)
        for src in range(4):
            start, size = input_offsets[src, dst], send_sizes[src, dst]
            sent = send_index[src, start:start + size] + src * length
            buffer[output_offsets[src, dst]:output_offsets[src, dst] + send_sizes[src, dst]] = sent
        assert recv_sizes[dst].sum() == plan.back[dst] and list(buffer[buffer >= 0]) == list(
            range(plan.s_first[dst], dst * length))
    assert exchange_tokens_received(plan, shape) == [int(row.sum()) for row in recv_sizes]
    ppermute = exchange_shape(plan, "a2a", a2a_impl="ppermute")
    assert ppermute.piece_lens == (4, 3, 0)  # distance 1: a whole shard; 2: rank 3 needs rank 1's last 3
    assert exchange_tokens_received(plan, ppermute) == [0, 4, 7, 7]  # every distance sends in full


@pytest.mark.parametrize(
    "doc_ids, cp, match",
    [
        pytest.param(np.array([1, 1, 2, 2, 1, 1]), 2, "document id 1", id="id-reappears"),
        pytest.param(np.array([1, 1, 0, 1]), 2, "document id 1", id="id-reappears-after-padding"),
        pytest.param(np.array([1, 1, 2]), 2, "multiple of cp_size", id="T-not-divisible"),
        pytest.param(np.array([1, -1, 2, 2]), 2, "≥ 0", id="negative"),
        pytest.param(np.ones((2, 4), np.int64), 2, r"\[T\]", id="2d"),
    ],
)
def test_blockdiag_plan_rejects_bad_input(doc_ids, cp, match):
    with pytest.raises(ValueError, match=match):
        build_blockdiag_plan(doc_ids, cp)


@pytest.mark.parametrize("lengths, cp", [([5, 4, 7], 4), ([16], 4), ([1, 1, 14], 2), ([4, 4, 4, 4], 4), ([3, 10, 3], 4)])
def test_sequence_state_routing_names_the_ranks_of_each_sequence_start_and_end(lengths, cp):
    from cp_linear import sequence_state_routing

    ids = np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)
    local_len = sum(lengths) // cp
    routing = sequence_state_routing(ids, cp)
    offsets = np.cumsum([0] + lengths)
    for n in range(len(lengths)):  # token-by-token oracle
        assert routing.start_rank[n] == offsets[n] // local_len
        assert routing.end_rank[n] == (offsets[n + 1] - 1) // local_len
    for rank in range(cp):
        owned = sorted({int(ids[0, t]) for t in range(rank * local_len, (rank + 1) * local_len)})
        assert list(routing.local_rows[rank]) == owned
        metadata = build_packed_sequence_cp_metadata(ids, rank, cp)
        assert routing.first_row_continues(rank) == (metadata.preceding_rank_start < rank)
        assert routing.ends_here(rank)[-1] == (metadata.following_rank_stop == rank + 1)


def test_sequence_state_routing_of_batch_rows_spans_every_rank():
    from cp_linear import sequence_state_routing

    routing = sequence_state_routing(None, 3, rows=2)
    assert routing.start_rank == (0, 0) and routing.end_rank == (2, 2)
    assert [routing.first_row_continues(r) for r in range(3)] == [False, True, True]
    assert [routing.ends_here(r) for r in range(3)] == [(False, False), (False, False), (True, True)]
    with pytest.raises(ValueError, match="rows must be a positive int"):
        sequence_state_routing(None, 3)
