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


def fold(summaries, seq_first_segment, *, init, rows, write_final, descending=0, init_count=None, addend=None,
         add_mode=0, transition_count=None, incoming=None, final_rows=None, value_dim=None, config_rows=32):
    """One segment_fold launch (mode "fold") through ``launch.run()`` -> (incoming [S_max, H, rows, K],
    final [final_rows, H, rows, K]); outputs start as NaN (or ``incoming``, updated in place), so rows
    the launch does not write show. Defaults: every init row read, no addend, every transition row."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    total, heads, key_dim = summaries.shape[0], summaries.shape[1], summaries.shape[3]
    sequences = seq_first_segment.shape[0] - 1
    value_dim = rows if value_dim is None else value_dim
    nan = dict(fill_value=float("nan"), dtype=torch.float32, device=summaries.device)
    if incoming is None:
        incoming = torch.full((total, heads, rows, key_dim), **nan)
    final = torch.full((sequences if final_rows is None else final_rows, heads, rows, key_dim), **nan)
    kl.SegmentFoldLaunch(
        kcfg.SegmentFoldConfig(key_dim, "fold", config_rows), summaries=summaries, seq_first_segment=seq_first_segment,
        init=incoming[:1] if init is None else init,
        addend=summaries.new_zeros(1, 1, key_dim, 1) if addend is None else addend, incoming=incoming, final=final,
        init_count=(0 if init is None else init.shape[0]) if init_count is None else init_count,
        value_rows=value_dim, identity_row=value_dim,
        transition_count=sequences if transition_count is None else transition_count, add_mode=add_mode,
        write_final=write_final, descending=descending).run()
    return incoming, final


def prefix_fold(summaries, seq_first_segment, value_dim, write_final, transition_count=None):
    """Prepare's fold from [0 ; I] with V + K rows through ``launch.run()`` -> (each segment's prefix
    map [S_max, H, V + K, K], final rows [N, H, V + K, K]); rows the launch does not write stay NaN."""
    return fold(summaries, seq_first_segment, init=None, rows=value_dim + summaries.shape[3], value_dim=value_dim,
                write_final=write_final, transition_count=transition_count)


def fold_both_ways(summaries, seq_first_segment, init, init_count, value_dim):
    """Every segment's incoming state [S_max, H, V, K] two ways, through ``launch.run()`` (the GPU
    kernels, or the emulation when a test patches it): the sequential fold from ``init`` (the
    forward's apply before the dedup), and prepare's prefix fold from [0 ; I] followed by
    segment_fold mode "apply_affine". Returns (sequential, via the prefix maps, the prefix maps)."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl

    total, heads, key_dim = summaries.shape[0], summaries.shape[1], summaries.shape[3]
    f32 = dict(dtype=torch.float32, device=summaries.device)
    sequential, _ = fold(summaries, seq_first_segment, init=init, init_count=init_count, rows=value_dim,
                         write_final=kl.FINAL_NONE, incoming=torch.zeros(total, heads, value_dim, key_dim, **f32))
    prefix, _ = prefix_fold(summaries, seq_first_segment, value_dim, kl.FINAL_EVERY)
    via_prefix = torch.full((total, heads, value_dim, key_dim), float("nan"), **f32)  # every row must be written
    kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim, "apply_affine"), summaries=prefix,
                         seq_first_segment=seq_first_segment, init=init, addend=summaries.new_zeros(1, 1, key_dim, 1),
                         incoming=via_prefix, final=via_prefix[:1], init_count=init_count, value_rows=value_dim,
                         identity_row=value_dim, transition_count=0, add_mode=kl.ADD_NONE, write_final=kl.FINAL_NONE,
                         descending=0).run()
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


def check_fold_modes(device):
    """The fold's CP shortcuts, bit for bit against the plain fold they stand for (shared by the emulated
    and the GPU test): FINAL_LEADING (only sequence 0's final rows), ADD_TRAILING (in place, only the
    trailing sequence, its end + addend), ADD_EVERY (every end + addend[n]) on the backward's descending
    fold, and ``transition_count`` on the forward's prefix fold (transition rows only where needed)."""
    from cp_linear.kernels import launch as kl

    heads, dim = 2, 64
    # sequence 3 is the trailing one (the last with segments); 4 is empty
    summaries, starts = fold_summaries([3, 0, 9, 4, 0], 2, heads, dim, dim, seed=54, device=device)
    gen = torch.Generator().manual_seed(55)
    ends = torch.randn(5, heads, dim, dim, generator=gen).to(device)
    addend = torch.randn(5, heads, dim, dim, generator=gen).to(device)  # [A, H, K, V]
    real = int(starts[-1])
    backward = dict(init=ends, rows=dim, descending=1)
    plain, every_final = fold(summaries, starts, write_final=kl.FINAL_EVERY, **backward)
    assert not torch.isnan(plain[:real]).any()
    leading, leading_final = fold(summaries, starts, write_final=kl.FINAL_LEADING, final_rows=1, **backward)
    assert torch.equal(leading[:real], plain[:real]) and torch.equal(leading_final, every_final[:1])
    # ADD_TRAILING over the plain fold: the trailing sequence's rows as a plain fold from end + addend
    shifted = ends.clone()
    shifted[3] = ends[3] + addend[0].transpose(-1, -2)
    want, _ = fold(summaries, starts, write_final=kl.FINAL_NONE, **{**backward, "init": shifted})
    got, _ = fold(summaries, starts, write_final=kl.FINAL_NONE, addend=addend[:1], add_mode=kl.ADD_TRAILING,
                  incoming=plain.clone(), **backward)
    assert torch.equal(got[:real], want[:real])
    assert not torch.equal(want[:real], plain[:real])  # the addend mattered
    alone, _ = fold(summaries, starts, write_final=kl.FINAL_NONE, addend=addend[:1], add_mode=kl.ADD_TRAILING,
                    **backward)
    trailing_rows = slice(int(starts[3]), real)
    assert torch.isnan(alone[:trailing_rows.start]).all() and torch.equal(alone[trailing_rows], want[trailing_rows])
    every_shift, _ = fold(summaries, starts, write_final=kl.FINAL_NONE,
                          **{**backward, "init": ends + addend.transpose(-1, -2)})
    every_add, _ = fold(summaries, starts, write_final=kl.FINAL_NONE, addend=addend, add_mode=kl.ADD_EVERY, **backward)
    assert torch.equal(every_add[:real], every_shift[:real])
    # the prefix fold with transition rows for sequence 0 only (and the trailing one's final rows)
    full, full_final = prefix_fold(summaries, starts, dim, kl.FINAL_TRAILING)
    lean, lean_final = prefix_fold(summaries, starts, dim, kl.FINAL_TRAILING, transition_count=1)
    assert torch.equal(lean[:real, :, :dim], full[:real, :, :dim])
    kept = torch.zeros(real, dtype=torch.bool, device=device)
    kept[:int(starts[1])] = True  # sequence 0's segments
    kept[int(starts[3]):real] = True  # the trailing sequence writes its final rows: every row folded
    assert torch.equal(lean[:real][kept], full[:real][kept]) and torch.isnan(lean[:real][~kept][:, :, dim:]).all()
    assert torch.equal(lean_final[3:], full_final[3:])


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
