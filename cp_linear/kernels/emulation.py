"""The tensor-core GDP kernels, emulated launch by launch in torch (any device, the CPU here).

``run_emulated(launch)`` does what ``launch.run()`` does on the GPU, on the same buffers, with
float32 arithmetic and rounding to the input dtype exactly where a kernel feeds a tensor-core
operand. It checks the algebra, the work layout, the segment folds and the precision budget
without a GPU, and is the oracle the GPU tests compare the kernels against. Slow and explicit.

Notation (per chunk and head; the kernels' module docs use the same letters). A chunk holds
whole tokens, C <= 64 steps; step i carries its token's gate on the token's first step, G is the
inclusive cumulative gate inside the chunk, f_i = 1/||k_i|| and fq_t = 1/||q_t|| (1 without
l2norm), i_t is token t's last step:

    A  = strictly lower beta_i f_i f_j exp(G_i - G_j) (k_i . k_j);   T = (I + A)^-1
    Ta = T diag(beta f exp(G)),  Tb = T diag(beta),  P[t, j] = [j <= i_t] scale fq_t f_j exp(G_{i_t} - G_j) (q_t . k_j)
    b_j = f_j exp(G_last - G_j),  c_t = scale fq_t exp(G_{i_t}),  d = exp(G_last)

and, with the state held transposed as rows X = S^T [R, K] (value rows see v, transition rows 0):

    Y = X k^T;   D = v^T Tb^T - Y Ta^T;   O^T = (X q^T) diag(c) + D P^T;   X <- d X + (D diag(b)) k
"""

from __future__ import annotations

from cp_linear.gdp import L2NORM_EPS
from cp_linear.kernels import configs as cfg


def _rounder(dtype):
    return lambda x: x.to(dtype).float()


def emulate_chunk_prep(launch) -> None:
    import torch

    n_h = int(launch.num_householder)
    rnd = _rounder(launch.ta.dtype)
    q, k = launch.q.float(), launch.k.float()
    heads = k.shape[1]
    tile = launch.p.shape[2]
    for chunk in range(int(launch.num_chunks[0])):
        first, steps = int(launch.chunk_first_step[chunk]), int(launch.chunk_steps[chunk])
        tokens = steps // n_h
        kc = k[first:first + steps].permute(1, 0, 2)  # [H, C, K]
        qc = q[first // n_h:first // n_h + tokens].permute(1, 0, 2)
        gc = launch.g[first // n_h:first // n_h + tokens].float().T
        bc = launch.beta[first:first + steps].float().T
        use_l2 = bool(launch.use_l2)
        f = torch.rsqrt((kc * kc).sum(-1) + L2NORM_EPS) if use_l2 else torch.ones(heads, steps)
        fq = torch.rsqrt((qc * qc).sum(-1) + L2NORM_EPS) if use_l2 else torch.ones(heads, tokens)
        step_gate = torch.zeros(heads, steps)
        step_gate[:, ::n_h] = gc
        G = torch.cumsum(step_gate, 1)
        lower = torch.tril(torch.ones(steps, steps), -1)
        A = bc[:, :, None] * f[:, :, None] * f[:, None, :] * torch.exp(torch.tril(G[:, :, None] - G[:, None, :]))
        A = A * (kc @ kc.transpose(1, 2)) * lower
        T = torch.linalg.solve_triangular(torch.eye(steps) + A, torch.eye(steps).expand(heads, steps, steps),
                                          upper=False, unitriangular=True)
        last = torch.arange(tokens) * n_h + n_h - 1
        causal = (torch.arange(steps)[None, :] <= last[:, None]).float()
        decay = torch.exp(torch.clamp(G[:, last, None] - G[:, None, :], max=0.0))
        P = float(launch.scale) * fq[:, :, None] * f[:, None, :] * decay * (qc @ kc.transpose(1, 2)) * causal
        ta = torch.zeros(heads, 64, 64)
        tb = torch.zeros(heads, 64, 64)
        ta[:, :steps, :steps] = T * (bc * f * torch.exp(G))[:, None, :]
        tb[:, :steps, :steps] = T * bc[:, None, :]
        p = torch.zeros(heads, tile, 64)
        p[:, :tokens, :steps] = P
        scalars = torch.zeros(heads, 4, 64)
        g_last = G[:, steps - 1:steps]
        scalars[:, 0, :steps] = f * torch.exp(g_last - G)
        scalars[:, 1, :tokens] = float(launch.scale) * fq * torch.exp(G[:, last])
        scalars[:, 2, :] = torch.exp(g_last)
        launch.ta[chunk] = rnd(ta).to(launch.ta.dtype)
        launch.tb[chunk] = rnd(tb).to(launch.tb.dtype)
        launch.p[chunk] = rnd(p).to(launch.p.dtype)
        launch.scalars[chunk] = scalars


def emulate_chunk_scan(launch) -> None:
    import torch

    config = launch.config
    rnd = _rounder(launch.k.dtype)
    n_h = int(launch.num_householder)
    K, V = config.key_dim, config.value_dim
    summary = config.mode == "summary"
    rows = V + K if summary else V
    k, v, q = launch.k.float(), launch.v.float(), launch.q.float()
    heads = k.shape[1]
    if summary and int(launch.clear_unsummarised):  # the segments not summarised, and unused slots: zero rows
        for segment in range(launch.state_out.shape[0]):
            if segment >= int(launch.num_segments[0]) or not int(launch.seg_flags[segment]) & 1:
                launch.state_out[segment] = 0.0
    for segment in range(int(launch.num_segments[0])):
        if summary and not int(launch.seg_flags[segment]) & 1:
            continue
        if summary:
            X = torch.cat([torch.zeros(heads, V, K), torch.eye(K).expand(heads, K, K)], 1)
        else:
            X = launch.state_in[segment].float().clone()
        first_chunk = int(launch.seg_first_chunk[segment])
        for chunk in range(first_chunk, first_chunk + int(launch.seg_chunks[segment])):
            first, steps = int(launch.chunk_first_step[chunk]), int(launch.chunk_steps[chunk])
            kc = torch.zeros(heads, 64, K)
            kc[:, :steps] = k[first:first + steps].permute(1, 0, 2)
            vin = torch.zeros(heads, 64, rows)
            vin[:, :steps, :V] = v[first:first + steps].permute(1, 0, 2)
            ta, tb = launch.ta[chunk].float(), launch.tb[chunk].float()
            sc = launch.scalars[chunk].float()
            Xb = rnd(X)
            if config.mode in ("states", "output_states"):
                launch.chunk_states[chunk] = Xb.reshape(heads, V * K).to(launch.chunk_states.dtype)
            Y = Xb @ kc.transpose(1, 2)
            D = vin.transpose(1, 2) @ tb.transpose(1, 2) - rnd(Y) @ ta.transpose(1, 2)
            if config.mode in ("output", "output_states"):
                tokens = steps // n_h
                tile = launch.p.shape[2]
                qc = torch.zeros(heads, tile, K)
                qc[:, :tokens] = q[first // n_h:first // n_h + tokens].permute(1, 0, 2)
                out = (Xb @ qc.transpose(1, 2)) * sc[:, 1, None, :tile]
                out = out + rnd(D) @ launch.p[chunk].float().transpose(1, 2)
                launch.o[first // n_h:first // n_h + tokens] = out[:, :, :tokens].permute(2, 0, 1).to(launch.o.dtype)
            X = sc[:, 2, 0, None, None] * X + rnd(D * sc[:, 0, None, :]) @ kc
        if summary:
            if int(launch.seg_flags[segment]) & cfg.VALUES_ONLY_FLAG:
                # the kernel writes zeros for its row blocks of transition rows only (not scanned)
                R = config.rows_per_cta
                first_zero_row = -(-V // R) * R
                X[:, first_zero_row:] = 0.0
            launch.state_out[segment] = X
        elif config.mode != "states":  # a sequence's last segment: its final state S = X^T
            bounds = [int(b) for b in launch.seq_first_segment]
            for sequence in range(len(bounds) - 1):
                if bounds[sequence] <= segment == bounds[sequence + 1] - 1:
                    launch.state_out[sequence] = X.transpose(-1, -2)


def emulate_segment_fold(launch) -> None:
    import torch

    from cp_linear.kernels import launch as kl

    if launch.config.mode == "apply_affine":
        return emulate_apply_affine(launch)
    rows = launch.incoming.shape[2]
    value_rows, identity_row = int(launch.value_rows), int(launch.identity_row)
    heads, K = launch.summaries.shape[1], launch.summaries.shape[3]
    sequences = launch.seq_first_segment.shape[0] - 1
    add_mode = int(launch.add_mode)
    for sequence in range(sequences):
        order = range(int(launch.seq_first_segment[sequence]), int(launch.seq_first_segment[sequence + 1]))
        trailing = int(launch.seq_first_segment[sequence + 1]) == int(launch.seq_first_segment[-1])
        if add_mode == kl.ADD_TRAILING and not (trailing and len(order)):
            continue  # only the trailing sequence with segments runs; the others write nothing
        if sequence < int(launch.init_count):
            X = launch.init[sequence].float().clone()
        else:
            X = torch.zeros(heads, rows, K)
            eye_rows = rows - identity_row
            if eye_rows > 0:
                X[:, identity_row:] = torch.eye(eye_rows, K)
        if add_mode != kl.ADD_NONE:  # start rows + addend^T (torch's end + outgoing)
            X = X + launch.addend[sequence if add_mode == kl.ADD_EVERY else 0].float().transpose(-1, -2)[:, :rows]
        write_final = int(launch.write_final)
        writes_final = (write_final == kl.FINAL_EVERY or (write_final == kl.FINAL_TRAILING and trailing)
                        or (write_final == kl.FINAL_LEADING and sequence == 0))
        # the transition rows only where needed; the kernel's CTAs of the other row tiles write nothing
        written = rows if writes_final or sequence < int(launch.transition_count) else min(rows, value_rows)
        for position, segment in enumerate(reversed(order) if int(launch.descending) else order):
            launch.incoming[segment, :, :written] = X[:, :written]
            if position == len(order) - 1 and not writes_final:
                break  # as the kernel: the map of the segment taken last is not read (it may have no summary)
            summary = launch.summaries[segment]
            E = torch.zeros(heads, rows, K)
            E[:, :min(rows, value_rows)] = summary[:, :min(rows, value_rows)]
            X = X @ summary[:, value_rows:] + E
        if writes_final:
            launch.final[sequence] = X


def emulate_apply_affine(launch) -> None:
    """segment_fold mode "apply_affine": incoming[s] = E_pre_s + X0[n(s)] M_pre_s (n(s) < init_count),
    E_pre_s for the other sequences' segments, zero for s >= the real segment count."""
    value_rows = int(launch.value_rows)
    affine = launch.summaries.float()
    starts = launch.seq_first_segment.long()
    launch.incoming.zero_()
    for sequence in range(starts.shape[0] - 1):
        for segment in range(int(starts[sequence]), int(starts[sequence + 1])):
            state = affine[segment, :, :value_rows].clone()
            if sequence < int(launch.init_count):
                state = state + launch.init[sequence].float() @ affine[segment, :, value_rows:]
            launch.incoming[segment] = state


def emulate_forward_layout(launch) -> None:
    """The layout kernel through its reference, the array-API ``forward_layout`` (sizes from the tables')."""
    import torch

    from cp_linear.kernels import launch as kl

    cu = launch.cu_seqlens
    sequences = cu.shape[0] - 1
    nonempty = torch.nonzero(cu[1:] > cu[:-1]).flatten()
    last_nonempty = int(nonempty[-1]) if nonempty.numel() else 0
    summary = int(launch.summary_sequence)
    summary = None if summary == -1 else last_nonempty if summary == cfg.TRAILING_SEQUENCE else summary
    grad = int(launch.grad_summary_sequence)
    per_chunk, segment_chunks = int(launch.tokens_per_chunk), int(launch.segment_chunks)
    max_chunks = launch.chunk_first_step.shape[0]
    n_h = int(launch.num_householder)
    if cfg.tokens_per_chunk(n_h) != per_chunk:
        raise ValueError(f"tokens_per_chunk {per_chunk} is not that of num_householder {n_h}")
    layout = kl.forward_layout(cu, total_tokens=(max_chunks - sequences) * per_chunk, num_householder=n_h, heads=1,
                               row_blocks=1, sm_count=1, segment_chunks=segment_chunks, summary_sequence=summary,
                               grad_summary_sequence=None if grad < 0 else grad,
                               every_segment_summary=bool(int(launch.every_segment_summary)),
                               every_segment_grad_summary=bool(int(launch.every_segment_grad_summary)),
                               values_only_from=None if int(launch.values_only_from) < 0
                               else int(launch.values_only_from))
    for name in kl.LAYOUT_TABLES:
        out, table = getattr(launch, name), getattr(layout, name)
        if out.shape != table.shape:
            raise ValueError(f"{name}: the launch's table has shape {tuple(out.shape)}, the layout's "
                             f"{tuple(table.shape)}")
        out.copy_(table)
    launch.trailing.fill_(last_nonempty)


def run_emulated(launch) -> None:
    """Carry out ``launch`` (a ``cp_linear.kernels.launch`` dataclass) in torch, in place."""
    from cp_linear.kernels import emulation_backward as eb
    from cp_linear.kernels import launch as kl

    emulations = {kl.ChunkPrepLaunch: emulate_chunk_prep, kl.ChunkScanLaunch: emulate_chunk_scan,
                  kl.SegmentFoldLaunch: emulate_segment_fold, kl.ChunkGammaLaunch: eb.emulate_chunk_gamma,
                  kl.ChunkReverseScanLaunch: eb.emulate_chunk_reverse_scan,
                  kl.ChunkReverseLaunch: eb.emulate_chunk_reverse,
                  kl.ChunkPrepBackwardLaunch: eb.emulate_chunk_prep_backward,
                  kl.ValueChecksLaunch: emulate_value_checks, kl.TokenChecksLaunch: emulate_token_checks,
                  kl.ShortConvLaunch: emulate_short_conv,
                  kl.ShortConvBackwardLaunch: emulate_short_conv_backward, kl.ColumnSumLaunch: emulate_column_sum,
                  kl.GatedRMSNormLaunch: emulate_gated_rms_norm,
                  kl.GatedRMSNormBackwardLaunch: emulate_gated_rms_norm_backward,
                  kl.ForwardLayoutLaunch: emulate_forward_layout}
    if type(launch) not in emulations:
        raise TypeError(f"no emulation for {type(launch).__name__}")
    # a contained kernel reads the token flags only when any_flagged says one is set (as the kernels do)
    flagged = getattr(launch.config, "contained", False) and bool(launch.any_flagged[0] != 0)
    if getattr(launch.config, "contained", False):
        launch = contained_launch(launch, flagged)
    emulations[type(launch)](launch)
    if flagged and getattr(launch.config, "mode", None) in ("output", "output_states"):
        # the contained output scan stores the outputs of read_bad tokens as NaN (poisoned)
        launch.o.masked_fill_((launch.read_bad != 0)[..., None], float("nan"))


def contained_launch(launch, flagged: bool):
    """The inputs a contained kernel computes with, as ``launch`` with them replaced (its outputs are the same
    tensors): ``validation.zero_flagged_inputs`` on the flat rows, and the output gradient's rows of read_bad
    tokens zero (the kernels zero these rows as they load them); without ``flagged`` (``any_flagged`` zero)
    only the non-finite g and beta read 0."""
    import dataclasses

    from cp_linear.validation import sanitize, zero_flagged_rows

    n_h = int(launch.num_householder)
    names = {f.name for f in dataclasses.fields(launch)}
    changes = {name: sanitize(getattr(launch, name)) for name in ("g", "beta") if name in names}
    if not flagged:
        return dataclasses.replace(launch, **changes)
    changes["k"] = zero_flagged_rows(launch.k, launch.state_bad, n_h)
    if launch.q.shape[0] == launch.read_bad.shape[0]:  # a mode that reads no queries may pass a placeholder
        changes["q"] = zero_flagged_rows(launch.q, launch.read_bad, 1)
        if "do" in names:  # a poisoned output passes no gradient
            changes["do"] = zero_flagged_rows(launch.do, launch.read_bad, 1)
    if "v" in names:
        changes["v"] = zero_flagged_rows(launch.v, launch.state_bad, n_h)
    return dataclasses.replace(launch, **changes)


def emulate_value_checks(launch) -> None:
    """``value_checks``: ORs 1 into ``flags`` at each failed check (GDP_VALUE_CHECKS order), as the kernel
    does; NaN sets only its tensor's non-finite flag (it fails the range comparisons)."""
    import torch

    from cp_linear.validation import BETA_MAX

    tensors = [x.float() for x in (launch.q, launch.k, launch.v, launch.g, launch.beta)]
    nonfinite = [~torch.isfinite(x).all() for x in tensors]
    g, beta = tensors[3], tensors[4]
    failed = torch.stack(nonfinite + [(g > 0).any(), ((beta < 0) | (beta > BETA_MAX)).any()])
    launch.flags |= failed.to(launch.flags.dtype)


def emulate_token_checks(launch) -> None:
    """``token_checks``: per (token, head) the state / read flags (bool as uint8 [B·T, H]) and the inputs
    with every non-finite value replaced by +0 (the rest bit for bit), by rows as the kernel owns them."""
    import torch

    n_h = launch.config.num_householder
    heads = launch.g.shape[1]

    def rows_bad(x):  # [rows, D/8, 8] -> bool [rows]
        return ~torch.isfinite(x.float()).flatten(1).all(1)

    steps = (rows_bad(launch.k) | rows_bad(launch.v)).reshape(-1, heads) | ~torch.isfinite(launch.beta)
    state = steps.reshape(-1, n_h, heads).any(1) | ~torch.isfinite(launch.g)
    launch.state_bad.copy_(state.to(launch.state_bad.dtype))
    launch.read_bad.copy_(rows_bad(launch.q).reshape(-1, heads).to(launch.read_bad.dtype))
    if not launch.config.copies:  # flags only
        return
    for name in ("q", "k", "v", "g", "beta"):
        x = getattr(launch, name)
        getattr(launch, name + "_out").copy_(torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype)))


def _short_conv_pre(launch):
    """The short conv's pre-activation as the kernels sum it (bias, then taps oldest first), float32
    -> (pre [B, P, Lp, C], windows [B, P, W - 1 + Lp, C], reach [W, P, Lp] (tap s usable), weight [W, C])."""
    import torch

    width, pieces = launch.config.width, int(launch.pieces)
    channels = launch.x.shape[1] * launch.x.shape[2]
    length = launch.positions.shape[0]
    batch, piece = launch.x.shape[0] // length, length // pieces
    x = launch.x.float().reshape(batch, pieces, piece, channels)
    halo = launch.halo.float().reshape(batch, pieces, width - 1, channels)
    windows = torch.cat([halo, x], dim=2)
    positions = launch.positions.reshape(pieces, piece)
    reach = torch.stack([positions >= s for s in range(width)])
    weight = launch.weight.float().reshape(width, channels)
    pre = launch.bias.float().reshape(channels).expand(batch, pieces, piece, channels)
    for tap in range(width):
        shift = width - 1 - tap  # tap `tap` reads token t - shift
        shifted = windows[:, :, tap:tap + piece]
        pre = pre + torch.where(reach[shift][None, :, :, None], shifted, 0.0) * weight[tap]
    return pre, windows, reach, weight


def emulate_short_conv(launch) -> None:
    """``short_conv`` forward: y = silu(pre) in the input dtype."""
    import torch

    pre, _, _, _ = _short_conv_pre(launch)
    launch.y.copy_((pre * torch.sigmoid(pre)).reshape(launch.y.shape))


def emulate_short_conv_backward(launch) -> None:
    """``short_conv`` backward: dx, dhalo and the per-run partial sums of the weight and bias gradients."""
    import torch

    from cp_linear.kernels.configs import SHORT_CONV_BACKWARD_TOKENS

    pre, windows, reach, weight = _short_conv_pre(launch)
    width = launch.config.width
    batch, pieces, piece, channels = pre.shape
    sig = torch.sigmoid(pre)
    dpre = launch.dy.float().reshape(pre.shape) * sig * (1.0 + pre * (1.0 - sig))
    dwindows = torch.zeros_like(windows)
    runs = -(-piece // SHORT_CONV_BACKWARD_TOKENS)
    pad = runs * SHORT_CONV_BACKWARD_TOKENS - piece
    partials = torch.zeros(batch, pieces, runs, width + 1, channels)
    for tap in range(width):
        masked = torch.where(reach[width - 1 - tap][None, :, :, None], dpre, 0.0)
        dwindows[:, :, tap:tap + piece] += masked * weight[tap]
        products = torch.nn.functional.pad(masked * windows[:, :, tap:tap + piece], (0, 0, 0, pad))
        partials[:, :, :, tap] = products.reshape(batch, pieces, runs, -1, channels).sum(3)
    bias_terms = torch.nn.functional.pad(dpre, (0, 0, 0, pad)).reshape(batch, pieces, runs, -1, channels)
    partials[:, :, :, width] = bias_terms.sum(3)
    launch.dx.copy_(dwindows[:, :, width - 1:].reshape(launch.dx.shape))
    launch.dhalo.copy_(dwindows[:, :, :width - 1].reshape(launch.dhalo.shape))
    launch.partials.copy_(partials.reshape(launch.partials.shape))


def emulate_column_sum(launch) -> None:
    launch.sums.copy_(launch.rows.sum(0))


def _gated_norm_parts(launch):
    """(x, gate, weight, rstd) as the kernels use them, float32, rows [R, D]."""
    import torch

    rows = launch.x.shape[0]
    x, gate = launch.x.float().reshape(rows, -1), launch.gate.float().reshape(rows, -1)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(launch.eps))
    return x, gate, launch.weight.float().reshape(-1), rstd


def emulate_gated_rms_norm(launch) -> None:
    """``gated_rms_norm`` forward: x · rstd · weight · silu(gate) in the input dtype."""
    import torch

    x, gate, weight, rstd = _gated_norm_parts(launch)
    launch.out.copy_((x * rstd * weight * torch.nn.functional.silu(gate)).reshape(launch.out.shape))


def emulate_gated_rms_norm_backward(launch) -> None:
    """``gated_rms_norm`` backward: dx, dgate and per-CTA rows of the weight gradient's sums."""
    import torch

    from cp_linear.kernels.configs import GATED_NORM_ROWS

    x, gate, weight, rstd = _gated_norm_parts(launch)
    dout = launch.dout.float().reshape(x.shape)
    sig = torch.sigmoid(gate)
    normed = x * rstd
    dgate = dout * normed * weight * sig * (1.0 + gate * (1.0 - sig))
    da = dout * gate * sig
    dweighted = da * weight
    dx = rstd * (dweighted - normed * (dweighted * normed).mean(-1, keepdim=True))
    blocks = launch.partials.shape[0]
    terms = torch.nn.functional.pad(da * normed, (0, 0, 0, blocks * GATED_NORM_ROWS - x.shape[0]))
    launch.dx.copy_(dx.reshape(launch.dx.shape))
    launch.dgate.copy_(dgate.reshape(launch.dgate.shape))
    launch.partials.copy_(terms.reshape(blocks, GATED_NORM_ROWS, -1).sum(1).reshape(launch.partials.shape))


def run_three_ways(make_launches, outputs: tuple[str, ...]) -> dict:
    """GPU check of a kernel sequence: fresh launches from ``make_launches()`` run twice on the GPU and once
    emulated -> {name: (first run, second run, emulated)} for each output named "index.field" (field of
    the index-th launch). The callers compare (tests/cp_linear/test_layer_kernels.py,
    benchmarks/bench_layer_kernels.py)."""
    import torch

    kernel, again, emulated = make_launches(), make_launches(), make_launches()
    for launch in (*kernel, *again):
        launch.run()
    for launch in emulated:
        run_emulated(launch)
    torch.cuda.synchronize()
    results = {}
    for name in outputs:
        index, field = name.split(".")
        results[name] = tuple(getattr(launches[int(index)], field) for launches in (kernel, again, emulated))
    return results
