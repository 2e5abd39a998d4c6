"""Inputs of the CuTeDSL-backend tests on the kernels' emulation (shared by the torch and JAX tests), and a
recorder of the scan modes a call launches."""

import contextlib

import torch


def emulation_inputs(lengths, heads, key_dim, value_dim, n_h, seed, rows=1, dtype=torch.bfloat16):
    """q, k, v in ``dtype`` (bf16 by default) and float32 g (log-sigmoid, mostly near 0) and beta for ``rows``
    rows of ``sum(lengths)`` tokens (n_h steps per token for k, v, beta)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = r(rows, tokens, heads, key_dim).to(dtype)
    k = r(rows, tokens * n_h, heads, key_dim).to(dtype)
    v = r(rows, tokens * n_h, heads, value_dim).to(dtype)
    g = torch.nn.functional.logsigmoid(r(rows, tokens, heads) + 3.0)
    beta = torch.sigmoid(r(rows, tokens * n_h, heads))
    return q, k, v, g, beta


INFERENCE_LENGTHS = [0, 150, 0, 37, 700, 0]  # empty sequences, and one long sequence of many segments


def inference_case(layout, n_h, with_initial, seed):
    """(GDPInputs, initial states or None) of the lean-forward tests: packed sequences with empty ones and
    one long sequence of many segments at segment_chunks=2, or 3 rows; bf16, H = 2, K = V = 64."""
    from torch_api.gdp.types import GDPInputs

    heads, dim = 2, 64
    if layout == "rows":
        lengths, rows, cu = [260], 3, None
    else:
        lengths, rows = INFERENCE_LENGTHS, 1
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v, g, beta = emulation_inputs(lengths, heads, dim, dim, n_h, seed=seed, rows=rows)
    g = g * 0.05  # a slow decay: the initial state and earlier segments still matter at the end
    sequences = rows if cu is None else len(lengths)
    initial = None
    if with_initial:
        initial = torch.randn(sequences, heads, dim, dim, generator=torch.Generator().manual_seed(seed + 1)) * 0.3
    inputs = GDPInputs(q, k, v, g, beta, scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True,
                       cu_seqlens=cu)
    return inputs, initial


def fold_summaries(segments_per_sequence, spare_segments, heads, key_dim, value_dim, seed, device="cpu"):
    """Random segment summaries [S_max, H, V + K, K] float32 (rows [E^T ; M^T], M near 0.9 I so that
    long folds stay bounded) and seq_first_segment int32 [N + 1] for sequences of the given segment
    counts, with ``spare_segments`` unused rows after the real ones."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0] + list(segments_per_sequence), dtype=torch.int32).cumsum(0).to(torch.int32)
    total = int(starts[-1]) + spare_segments
    summaries = torch.randn(total, heads, value_dim + key_dim, key_dim, generator=gen) * 0.5
    summaries[:, :, value_dim:] = (0.9 * torch.eye(key_dim)
                                   + torch.randn(total, heads, key_dim, key_dim, generator=gen) * 0.01)
    return summaries.to(device), starts.to(device)


def prefix_fold(summaries, seq_first_segment, value_dim, write_final):
    """Prepare's fold from [0 ; I] with V + K rows through ``launch.run()`` -> (each segment's prefix
    map [S_max, H, V + K, K], final rows [N, H, V + K, K]); rows the launch does not write stay NaN."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    total, heads, key_dim = summaries.shape[0], summaries.shape[1], summaries.shape[3]
    sequences = seq_first_segment.shape[0] - 1
    nan = dict(fill_value=float("nan"), dtype=torch.float32, device=summaries.device)
    prefix = torch.full((total, heads, value_dim + key_dim, key_dim), **nan)
    final = torch.full((sequences, heads, value_dim + key_dim, key_dim), **nan)
    kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim), summaries=summaries, seq_first_segment=seq_first_segment,
                         init=prefix[:1], incoming=prefix, final=final, init_count=0, value_rows=value_dim,
                         identity_row=value_dim, first_sequence=0, write_final=write_final, descending=0).run()
    return prefix, final


def fold_both_ways(summaries, seq_first_segment, init, init_count, value_dim):
    """Every segment's incoming state [S_max, H, V, K] two ways, through ``launch.run()`` (the GPU
    kernels, or the emulation when a test patches it): the sequential fold from ``init`` (the
    forward's apply before the dedup), and prepare's prefix fold from [0 ; I] followed by
    segment_fold mode "apply_affine". Returns (sequential, via the prefix maps, the prefix maps)."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    total, heads, key_dim = summaries.shape[0], summaries.shape[1], summaries.shape[3]
    f32 = dict(dtype=torch.float32, device=summaries.device)
    sequential = torch.zeros(total, heads, value_dim, key_dim, **f32)
    kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim), summaries=summaries, seq_first_segment=seq_first_segment,
                         init=init, incoming=sequential, final=sequential[:1], init_count=init_count,
                         value_rows=value_dim, identity_row=value_dim, first_sequence=0, write_final=0,
                         descending=0).run()
    prefix, _ = prefix_fold(summaries, seq_first_segment, value_dim, kl.FINAL_EVERY)
    via_prefix = torch.full((total, heads, value_dim, key_dim), float("nan"), **f32)  # every row must be written
    kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim, "apply_affine"), summaries=prefix,
                         seq_first_segment=seq_first_segment, init=init, incoming=via_prefix, final=via_prefix[:1],
                         init_count=init_count, value_rows=value_dim, identity_row=value_dim, first_sequence=0,
                         write_final=0, descending=0).run()
    return sequential, via_prefix, prefix


def check_trailing_final_rows(device):
    """write_final=FINAL_TRAILING (prepare's CP summary): the last sequence with segments and the empty
    ones after it write their final rows ([0 ; I] for an empty one), bit for bit as with FINAL_EVERY;
    the other sequences' final rows are not written (their last map is skipped); the prefix maps are
    the same bits either way. Shared by the emulated and the GPU test."""
    from cp_linear.kernels import launch as kl

    heads, dim = 2, 64
    summaries, starts = fold_summaries([3, 0, 9, 1, 0], 2, heads, dim, dim, seed=53, device=device)
    every = prefix_fold(summaries, starts, dim, kl.FINAL_EVERY)
    trailing = prefix_fold(summaries, starts, dim, kl.FINAL_TRAILING)
    real = int(starts[-1])
    assert torch.equal(every[0][:real], trailing[0][:real])
    assert torch.equal(every[1][3:], trailing[1][3:])
    assert torch.isnan(trailing[1][:3]).all()
    identity = torch.cat([torch.zeros(dim, dim), torch.eye(dim)]).to(summaries.device)
    assert torch.equal(trailing[1][4], identity.expand(heads, -1, -1))


@contextlib.contextmanager
def recorded_scan_modes():
    """Yields the list of every ``ChunkScanLaunch``'s mode, in launch order, while the block runs (the
    launches still run, through whatever ``_Launch.run`` was in place)."""
    from cp_linear.kernels import launch as kl

    modes = []
    real_run = kl._Launch.run

    def run(launch):
        if isinstance(launch, kl.ChunkScanLaunch):
            modes.append(launch.config.mode)
        real_run(launch)

    kl._Launch.run = run
    try:
        yield modes
    finally:
        kl._Launch.run = real_run
