"""The zig-zag layout's host pieces (``cp_linear.zigzag``) against tiny independent oracles."""

import numpy as np
import pytest

from cp_linear.plan import build_packed_sequence_cp_metadata
from cp_linear.zigzag import (
    attention_block_work,
    build_zigzag_cp_metadata,
    gathered_chunk_order,
    inverse_permutation,
    layout_permutation,
    local_positions,
    virtual_rank_ranges,
)
from tests.cp_linear.gdp_cases import seq_idx_from_lengths


def test_worked_example_of_the_docstring():
    assert local_positions(16, 2, 0, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(16, 2, 1).tolist() == list(range(8, 16))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_permutation_places_chunk_r_and_its_mirror_on_rank_r(cp):
    chunk = 3
    perm = layout_permutation(2 * cp * chunk, cp, "zigzag")
    for rank in range(cp):
        local = perm[rank * 2 * chunk:(rank + 1) * 2 * chunk] // chunk
        assert local.tolist() == [rank] * chunk + [2 * cp - 1 - rank] * chunk
    inverse = inverse_permutation(perm)
    assert np.array_equal(perm[inverse], np.arange(perm.shape[0]))
    assert np.array_equal(layout_permutation(2 * cp * chunk, cp), np.arange(2 * cp * chunk))


@pytest.mark.parametrize("cp", [1, 2, 3, 5])
def test_gathered_chunk_order_puts_rank_major_items_in_sequence_order(cp):
    gathered = [c for rank in range(cp) for c in (rank, 2 * cp - 1 - rank)]  # what rank r contributes
    assert np.asarray(gathered)[gathered_chunk_order(cp, "zigzag")].tolist() == list(range(2 * cp))
    assert gathered_chunk_order(cp, "contiguous").tolist() == list(range(cp))


@pytest.mark.parametrize("lengths, cp", [([16], 2), ([5, 4, 7], 2), ([1, 2, 3, 4, 5, 9], 3), ([3] * 8, 4),
                                         ([2, 21, 1], 4)])
def test_metadata_ranges_follow_the_sequences_in_chunk_units(lengths, cp):
    ids = seq_idx_from_lengths(lengths)
    total = ids.shape[1]
    chunk = total // (2 * cp)
    starts = np.cumsum([0] + lengths[:-1])
    stops = np.cumsum(lengths)
    seq_of = np.repeat(np.arange(len(lengths)), lengths)
    for rank in range(cp):
        meta = build_zigzag_cp_metadata(ids, rank, cp)
        assert meta.error is None and meta.local_len == 2 * chunk
        for c, start, stop in virtual_rank_ranges(meta, rank, cp, "zigzag"):
            first, last = seq_of[c * chunk], seq_of[(c + 1) * chunk - 1]
            assert start == starts[first] // chunk  # the chunk holding the first sequence's first token
            assert stop == (stops[last] - 1) // chunk + 1
        assert [c for c, _, _ in virtual_rank_ranges(None, rank, cp, "zigzag")] == [rank, 2 * cp - 1 - rank]


def test_edited_metadata_is_reported_not_trusted():
    ids = seq_idx_from_lengths([5, 7, 4])
    meta = build_zigzag_cp_metadata(ids, 0, 2)
    swapped = type(meta)((meta.shards[1], meta.shards[0]), 0, 2)
    assert "built for chunks" in swapped.error
    other = build_packed_sequence_cp_metadata(seq_idx_from_lengths([8, 8]), 3, 4)
    mixed = type(meta)((meta.shards[0], other), 0, 2)
    assert "different global_seq_idx" in mixed.error


def test_length_must_split_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="multiple of 4"):
        build_zigzag_cp_metadata(seq_idx_from_lengths([6]), 0, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        local_positions(6, 2, 0, "zigzag")


def brute_force_block_work(doc_ids, cp, layout, block):
    """Count kept tiles by materialising the dense mask."""
    ids = np.asarray(doc_ids)
    total = ids.shape[0]
    pos = np.arange(total)
    allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]) & (ids[:, None] > 0)
    chunk = total // (cp * (2 if layout == "zigzag" else 1))
    work = []
    for rank in range(cp):
        local = local_positions(total, cp, rank, layout)
        count = 0
        for piece in range(0, local.shape[0], chunk):
            rows = local[piece:piece + chunk]
            for lo in range(0, chunk, block):
                tile_rows = allowed[rows[lo:lo + block]]
                count += sum(tile_rows[:, k:k + block].any() for k in range(0, total, block))
        work.append(count)
    return work


@pytest.mark.parametrize("doc_ids", [np.ones(48, int), np.repeat([1, 0, 2, 3, 0, 4], [7, 3, 20, 5, 2, 11]),
                                     np.repeat([1, 2, 3, 4], [12, 12, 12, 12])], ids=["one-doc", "mixed", "aligned"])
@pytest.mark.parametrize("cp, layout", [(2, "contiguous"), (2, "zigzag"), (3, "contiguous"), (4, "zigzag")])
def test_attention_block_work_matches_the_dense_mask(doc_ids, cp, layout):
    if doc_ids.shape[0] % (cp * (2 if layout == "zigzag" else 1)):
        doc_ids = doc_ids[: doc_ids.shape[0] // (2 * cp) * 2 * cp]
    assert attention_block_work(doc_ids, cp, layout, block_size=4).tolist() == brute_force_block_work(
        doc_ids, cp, layout, 4)


def test_zigzag_balances_one_long_document():
    work = {layout: attention_block_work(np.ones(1024, int), 4, layout, block_size=32)
            for layout in ("contiguous", "zigzag")}
    assert work["contiguous"].sum() == work["zigzag"].sum()  # the same mask, split differently
    assert work["contiguous"].max() / work["contiguous"].min() > 6
    assert work["zigzag"].max() == work["zigzag"].min()
