"""``cp_linear.kernels.launch.forward_layout`` against a plain-Python oracle, in every array namespace
the frontends use (numpy, torch, jax), and torch's cache of the rows layout
(``torch_api.gdp.cutedsl.rows_layout``) against the uncached computation."""

import math

import numpy as np
import pytest
import torch

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl

TABLES = ("chunk_first_step", "chunk_steps", "num_chunks", "seq_first_segment", "seq_segments", "seg_first_chunk",
          "seg_chunks", "seg_flags", "num_segments", "seg_grad_flags", "seg_order")


def oracle_layout(lengths, n_h, segment_chunks, max_chunks, max_segments, *, summary_sequence=None,
                  grad_summary_sequence=None, every_segment=False, values_only_from=None):
    """The tables sequence by sequence and chunk by chunk, zero-padded to the layout's bounds."""
    per_chunk = kcfg.tokens_per_chunk(n_h)
    first_step, steps, first_chunk, chunks, flags, grad_flags = [], [], [], [], [], []
    seq_segments, token = [], 0
    for n, length in enumerate(lengths):
        seq_chunk_count = math.ceil(length / per_chunk)
        segment_count = math.ceil(seq_chunk_count / segment_chunks)
        for index in range(segment_count):
            first_chunk.append(len(first_step) + index * segment_chunks)
            chunks.append(min(segment_chunks, seq_chunk_count - index * segment_chunks))
            flags.append(int(every_segment or index < segment_count - 1 or n == summary_sequence))
            # bit 1: a first segment from zero rows, whose transition rows nobody reads
            if flags[-1] and index == 0 and values_only_from is not None and n >= values_only_from:
                flags[-1] += 2
            backward_summary = int(every_segment or index >= 1 or n == grad_summary_sequence)
            # bit 1: the forward summarised it too (the backward takes its transition rows from there)
            grad_flags.append(backward_summary + 2 * (backward_summary and flags[-1] & 1))
        for index in range(seq_chunk_count):
            first_step.append((token + index * per_chunk) * n_h)
            steps.append(min(per_chunk, length - index * per_chunk) * n_h)
        seq_segments.append(segment_count)
        token += length

    def padded(values, size):
        return values + [0] * (size - len(values))

    # grid slots: whole segments in order, then the shorter ones longest first (ties: earlier first), then
    # the unused slots as they are
    real = len(chunks)
    whole = [s for s in range(real) if chunks[s] == segment_chunks]
    shorter = [s for s in range(real) if chunks[s] < segment_chunks]
    if len(lengths) <= kcfg.LAYOUT_SORT_SEQUENCES:  # beyond, sequence order
        shorter.sort(key=lambda s: (-chunks[s], s))
    order = whole + shorter + list(range(real, max_segments))

    return dict(chunk_first_step=padded(first_step, max_chunks), chunk_steps=padded(steps, max_chunks),
                num_chunks=[len(first_step)], seq_first_segment=np.cumsum([0] + seq_segments).tolist(),
                seq_segments=seq_segments, seg_first_chunk=padded(first_chunk, max_segments),
                seg_chunks=padded(chunks, max_segments), seg_flags=padded(flags, max_segments),
                num_segments=[sum(seq_segments)], seg_grad_flags=padded(grad_flags, max_segments), seg_order=order)


def _jax_array(values):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(values, dtype=jnp.int32)


NAMESPACES = {"numpy": lambda cu: np.asarray(cu, dtype=np.int32),
              "torch-int32": lambda cu: torch.tensor(cu, dtype=torch.int32),
              "torch-int64": lambda cu: torch.tensor(cu, dtype=torch.int64),
              "jax": _jax_array}


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("lengths, n_h, segment_chunks, summary_sequence, grad_summary_sequence", [
    pytest.param([300], 1, 2, None, None, id="one-sequence"),
    pytest.param([300], 2, 2, 0, 0, id="one-sequence-cp-flags"),
    pytest.param([0], 2, 2, None, None, id="one-empty-sequence"),
    pytest.param([150, 0, 37, 301], 2, 2, None, None, id="packed-with-empty"),
    pytest.param([150, 0, 37, 301], 2, 2, 3, 0, id="packed-with-empty-cp-flags"),
    pytest.param([64, 65, 1], 3, 1, None, 0, id="segment-per-chunk"),
    pytest.param([200, 0, 0], 2, 3, 0, None, id="trailing-empty"),
    pytest.param([300, 420, 100, 768, 150], 1, 4, None, None, id="shorter-segments-sorted"),
    pytest.param(list(np.random.default_rng(5).integers(1, 300, kcfg.LAYOUT_SORT_SEQUENCES + 1)), 2, 2, None, 0,
                 id="too-many-to-sort"),
])
@pytest.mark.parametrize("every_segment", [False, True])
@pytest.mark.parametrize("values_only_from", [None, 0, 1])
def test_forward_layout_matches_oracle(namespace, lengths, n_h, segment_chunks, summary_sequence,
                                       grad_summary_sequence, every_segment, values_only_from):
    cu = NAMESPACES[namespace](np.cumsum([0] + lengths).tolist())
    layout = kl.forward_layout(cu, total_tokens=sum(lengths), num_householder=n_h, heads=16, row_blocks=2,
                               sm_count=132, segment_chunks=segment_chunks, summary_sequence=summary_sequence,
                               grad_summary_sequence=grad_summary_sequence, every_segment_summary=every_segment,
                               every_segment_grad_summary=every_segment, values_only_from=values_only_from)
    expected = oracle_layout(lengths, n_h, segment_chunks, layout.max_chunks, layout.max_segments,
                             summary_sequence=summary_sequence, grad_summary_sequence=grad_summary_sequence,
                             every_segment=every_segment, values_only_from=values_only_from)
    for name in TABLES:
        table = getattr(layout, name)
        assert "int32" in str(table.dtype), name
        assert np.asarray(table).tolist() == expected[name], name


# --------------------------------------------------------------------------- torch's cached rows layout


def _rows_args(tokens, segment_chunks=None):
    return dict(total_tokens=2 * tokens, num_householder=2, heads=4, row_blocks=2, sm_count=132,
                segment_chunks=segment_chunks, ctas_per_sm=2, every_segment_summary=True,
                every_segment_grad_summary=False)


@pytest.fixture
def empty_rows_cache(monkeypatch):
    from torch_api.gdp import cutedsl

    monkeypatch.setattr(cutedsl, "_ROWS_LAYOUTS", type(cutedsl._ROWS_LAYOUTS)())
    return cutedsl


def test_rows_layout_equals_uncached_forward_layout(empty_rows_cache):
    cutedsl = empty_rows_cache
    args = _rows_args(tokens=300, segment_chunks=2)
    cu = torch.arange(0, 3 * 300, 300, dtype=torch.int32)
    uncached = kl.forward_layout(cu, **args)
    for _ in range(2):  # built, then from the cache
        layout, tables = cutedsl.rows_layout(torch.device("cpu"), 2, **args)
        for name in TABLES:
            assert torch.equal(getattr(layout, name), getattr(uncached, name)), name
        assert torch.equal(tables, torch.cat([getattr(uncached, name) for name in TABLES]))
        assert (layout.max_chunks, layout.max_segments) == (uncached.max_chunks, uncached.max_segments)


def test_rows_layout_caches_per_shape(empty_rows_cache):
    cutedsl = empty_rows_cache
    cpu = torch.device("cpu")
    short, short_tables = cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=300))
    long, long_tables = cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=5000))
    assert len(cutedsl._ROWS_LAYOUTS) == 2
    assert long.max_chunks > short.max_chunks and long_tables.shape != short_tables.shape
    again, again_tables = cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=300))
    assert again_tables is short_tables and again is not short  # same tensors, a fresh layout object
    again.seg_flags = None  # a caller's field assignment does not reach the cache
    assert cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=300))[0].seg_flags is not None


def test_rows_layout_cache_keeps_the_most_recent(empty_rows_cache, monkeypatch):
    cutedsl = empty_rows_cache
    monkeypatch.setattr(cutedsl, "ROWS_LAYOUTS_KEPT", 2)
    cpu = torch.device("cpu")
    first = cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=100))[1]
    cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=200))
    cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=100))  # used again: now the most recent
    cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=300))  # drops tokens=200
    assert len(cutedsl._ROWS_LAYOUTS) == 2
    assert cutedsl.rows_layout(cpu, 2, **_rows_args(tokens=100))[1] is first


def test_token_checks_config_names_the_inputs_the_kernel_takes():
    """Both frontends ask ``launch.token_checks_config``: one tensor-core dtype for q, k, v, float32 g and
    beta, K and V in HEAD_DIMS, n_h in TOKEN_CHECKS_HOUSEHOLDERS, sizes in (0, 2**31)."""
    good = ("bfloat16", "bfloat16", "bfloat16", "float32", "float32")
    sizes = (10, 20, 20, 5, 10)
    assert kl.token_checks_config(good, 128, 64, 2, sizes) == kcfg.TokenChecksConfig("bfloat16", 128, 64, 2)
    assert kl.token_checks_config(("float16",) * 3 + good[3:], 64, 64, 3, sizes) is not None
    rejected = [
        (("bfloat16", "float16", "bfloat16", "float32", "float32"), 128, 128, 2, sizes),  # mixed q, k, v
        (("float32",) * 5, 128, 128, 2, sizes),  # no tensor-core dtype
        (good[:3] + ("bfloat16", "float32"), 128, 128, 2, sizes),  # g not float32
        (good, 32, 128, 2, sizes),  # K outside HEAD_DIMS
        (good, 128, 256, 2, sizes),  # V outside HEAD_DIMS
        (good, 128, 128, max(kcfg.TOKEN_CHECKS_HOUSEHOLDERS) + 1, sizes),
        (good, 128, 128, 2, (10, 0, 20, 5, 10)),  # an empty input
        (good, 128, 128, 2, (10, 2**31, 20, 5, 10)),  # past int32 indexing
    ]
    for arguments in rejected:
        assert kl.token_checks_config(*arguments) is None, arguments
