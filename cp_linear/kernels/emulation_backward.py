"""The backward kernels, emulated launch by launch in torch (the CPU oracle of ``chunk_reverse`` and
``chunk_prep_backward``; the chunk-state recompute is ``chunk_scan`` mode "states", in ``emulation``),
rounding to the input dtype where the kernels feed a tensor-core operand.

The per-chunk algebra is ``backward_algorithm`` (checked against autograd); this module applies it
to the launches' buffers and layouts: value rows transposed (dX = dS^T), chunk tables, segments.
"""

from __future__ import annotations

from cp_linear.kernels.emulation import _rounder


def _chunk_tiles(launch, chunk: int, *, with_values: bool):
    """The chunk's inputs as float32 tiles padded to 64 steps / the query tile (as the kernels load them)."""
    import torch

    n_h = int(launch.num_householder)
    first, steps = int(launch.chunk_first_step[chunk]), int(launch.chunk_steps[chunk])
    tokens = steps // n_h
    heads, key_dim = launch.k.shape[1], launch.k.shape[2]
    tile = launch.p.shape[2]
    k = torch.zeros(heads, 64, key_dim)
    k[:, :steps] = launch.k[first:first + steps].float().permute(1, 0, 2)
    q = torch.zeros(heads, tile, key_dim)
    q[:, :tokens] = launch.q[first // n_h:first // n_h + tokens].float().permute(1, 0, 2)
    value_dim = launch.do.shape[2]
    do = torch.zeros(heads, value_dim, tile)  # dO^T: value rows x tokens
    do[:, :, :tokens] = launch.do[first // n_h:first // n_h + tokens].float().permute(1, 2, 0)
    v = None
    if with_values:
        v = torch.zeros(heads, 64, value_dim)
        v[:, :steps] = launch.v[first:first + steps].float().permute(1, 0, 2)
    return dict(first=first, steps=steps, tokens=tokens, k=k, q=q, do=do, v=v,
                ta=launch.ta[chunk].float(), p=launch.p[chunk].float(), sc=launch.scalars[chunk].float(),
                tb=None if not with_values else launch.tb[chunk].float())


def _gamma_step(X, t: dict, do, rnd):
    """One chunk of the state-gradient recurrence on rows X (``chunk_reverse.gamma_step``): dD = rnd(X) k^T
    diag(b) + dO^T P, Z = rnd(dD) Ta, X <- d X + dO^T rnd(diag(c) q) - rnd(Z) k; ``do`` holds dO^T rows."""
    b, c, d = t["sc"][:, 0], t["sc"][:, 1, :t["q"].shape[1]], t["sc"][:, 2, 0]
    dD = (rnd(X) @ t["k"].transpose(1, 2)) * b[:, None, :] + do @ t["p"]
    Z = rnd(dD) @ t["ta"]
    qc = rnd(c[:, :, None] * t["q"])
    return d[:, None, None] * X + do @ qc - rnd(Z) @ t["k"]


def emulate_chunk_gamma(launch) -> None:
    import torch

    from cp_linear.kernels.launch import FORWARD_TRANSITION_FLAG, SUMMARY_FLAG

    rnd = _rounder(launch.k.dtype)
    value_dim, key_dim = launch.config.value_dim, launch.config.key_dim
    heads = launch.k.shape[1]
    for segment in range(int(launch.num_segments[0])):
        flags = int(launch.seg_flags[segment])
        if not flags & SUMMARY_FLAG:
            continue
        # rows evolve independently: the forward-summarised segments' transition rows are the forward's, copied
        rows = value_dim if flags & FORWARD_TRANSITION_FLAG else value_dim + key_dim
        if flags & FORWARD_TRANSITION_FLAG:
            forward_transitions = launch.forward_summaries[segment, :, value_dim:]  # M^T rows
            launch.summaries[segment, :, value_dim:] = forward_transitions.transpose(-1, -2)
        X = torch.cat([torch.zeros(heads, value_dim, key_dim),
                       torch.eye(key_dim).expand(heads, key_dim, key_dim)], 1)[:, :rows]
        first_chunk = int(launch.seg_first_chunk[segment])
        for chunk in reversed(range(first_chunk, first_chunk + int(launch.seg_chunks[segment]))):
            t = _chunk_tiles(launch, chunk, with_values=False)
            do = torch.cat([t["do"], torch.zeros(heads, key_dim, t["do"].shape[2])], 1)[:, :rows]  # transition: no dO
            X = _gamma_step(X, t, do, rnd)
        launch.summaries[segment, :, :rows] = X


def emulate_chunk_reverse_scan(launch) -> None:
    rnd = _rounder(launch.k.dtype)
    for segment in range(int(launch.num_segments[0])):
        first_chunk = int(launch.seg_first_chunk[segment])
        dX = launch.grad_out[segment].float().clone()
        for chunk in reversed(range(first_chunk, first_chunk + int(launch.seg_chunks[segment]))):
            t = _chunk_tiles(launch, chunk, with_values=False)
            launch.chunk_grads[chunk] = dX.to(launch.chunk_grads.dtype)
            dX = _gamma_step(dX, t, t["do"], rnd)
        launch.grad_in[segment] = dX


def emulate_chunk_reverse(launch) -> None:
    import torch

    rnd = _rounder(launch.k.dtype)
    n_h = int(launch.num_householder)
    for chunk in range(int(launch.num_chunks[0])):
        t = _chunk_tiles(launch, chunk, with_values=True)
        k, v, q, do, ta, tb, p, sc = (t[name] for name in ("k", "v", "q", "do", "ta", "tb", "p", "sc"))
        b, c = sc[:, 0], sc[:, 1, :q.shape[1]]
        Xb = launch.chunk_states[chunk].float()
        dXb = launch.chunk_grads[chunk].float()
        Yb = rnd(Xb @ k.transpose(1, 2))
        D = v.transpose(1, 2) @ tb.transpose(1, 2) - Yb @ ta.transpose(1, 2)
        M1 = dXb @ k.transpose(1, 2)
        dD = M1 * b[:, None, :] + do @ p
        dDb = rnd(dD)
        Zb = rnd(dDb @ ta)
        Db = rnd(D)
        R = do.transpose(1, 2) @ Xb
        steps, tokens, first = t["steps"], t["tokens"], t["first"]
        launch.dv[first:first + steps] = (dDb @ tb).permute(2, 0, 1)[:steps]
        dk = b[:, :, None] * (Db.transpose(1, 2) @ dXb) - Zb.transpose(1, 2) @ Xb
        launch.dk_scan[first:first + steps] = dk.permute(1, 0, 2)[:steps]
        launch.dq_scan[first // n_h:first // n_h + tokens] = (c[:, :, None] * R).permute(1, 0, 2)[:tokens]
        launch.d_tb[chunk] = dDb.transpose(1, 2) @ v.transpose(1, 2)
        launch.d_ta[chunk] = -(rnd(dDb.transpose(1, 2) @ Xb) @ k.transpose(1, 2))  # -(dD^T X) k^T
        launch.d_p[chunk] = do.transpose(1, 2) @ Db
        scalars = torch.zeros_like(sc)
        scalars[:, 0] = (D * M1).sum(1)
        scalars[:, 1, :q.shape[1]] = (R * q).sum(2)
        scalars[:, 2, 0] = (Xb * dXb).sum((1, 2))
        launch.d_scalars[chunk] = scalars


def emulate_chunk_prep_backward(launch) -> None:
    from cp_linear.kernels import backward_algorithm as ba

    n_h = int(launch.num_householder)
    scale, use_l2 = float(launch.scale), bool(launch.use_l2)
    for chunk in range(int(launch.num_chunks[0])):
        first, steps = int(launch.chunk_first_step[chunk]), int(launch.chunk_steps[chunk])
        tokens = steps // n_h
        t0 = first // n_h
        chunk_inputs = ba.ChunkInputs(q=launch.q[t0:t0 + tokens].float().permute(1, 0, 2),
                                      k=launch.k[first:first + steps].float().permute(1, 0, 2), v=None,
                                      g=launch.g[t0:t0 + tokens].float().T, beta=launch.beta[first:first + steps].float().T)
        prep = ba.prep_forward(chunk_inputs, num_householder=n_h, scale=scale, use_l2=use_l2)
        sc = launch.d_scalars[chunk]
        grads = dict(dTa=launch.d_ta[chunk, :, :steps, :steps], dTb=launch.d_tb[chunk, :, :steps, :steps],
                     dP=launch.d_p[chunk, :, :tokens, :steps], db=sc[:, 0, :steps], dc=sc[:, 1, :tokens],
                     dd=sc[:, 2, 0])
        dq, dk, dg, dbeta = ba.prep_backward(chunk_inputs, prep, grads, num_householder=n_h, scale=scale,
                                             use_l2=use_l2)
        launch.dq[t0:t0 + tokens] = launch.dq_scan[t0:t0 + tokens] + dq.permute(1, 0, 2)
        launch.dk[first:first + steps] = launch.dk_scan[first:first + steps] + dk.permute(1, 0, 2)
        launch.dg[t0:t0 + tokens] = dg.T
        launch.dbeta[first:first + steps] = dbeta.T
