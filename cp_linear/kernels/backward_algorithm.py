"""The blocked GDP backward the backward kernels will implement, chunk by chunk, in torch.

Same notation as ``emulation.py`` (the forward): per chunk and head, with the state held
transposed as value rows X = S^T [V, K],

    prep:   Ta, Tb, P, b, c, d   from (q, k, g, beta)            (no state)
    scan:   Y = X k^T;  D = v^T Tb^T - Y Ta^T;  O = (X q^T) diag(c) + D P^T;  X' = d X + (D diag(b)) k

The backward runs the chunks in reverse with the state gradient dX (transposed like X):

    scan:   M1 = dX' k^T            dD = M1 diag(b) + dO P        dX = d dX' + (dO diag(c)) q - (dD Ta) k
            db = colsum(D * M1)     dc = colsum(dO * X q^T)      dd = sum(X * dX')
            dk = (D diag(b))^T dX' - (dD Ta)^T X                 dq = (dO diag(c))^T X
            dv = (dD Tb)^T          dTb = dD^T v^T               dTa = -dD^T Y        dP = dO^T D
    prep:   (dTa, dTb, dP, db, dc, dd) -> dq, dk, dg, dbeta through T = (I + A)^-1
            (dA = -T^T dT T^T), the gates (a reverse cumulative sum) and the l2norm factors.

The state-gradient recurrence is affine in dX': dX = dX' N^T + gamma(dO) with the chunk's forward
transition N = d I - k^T Ta^T diag(b) k (X' = X N + const). So the backward cuts into segments
the way the forward does: each segment's gamma from a zero outgoing gradient in parallel, a
descending fold with the transitions the forward summaries already hold (dX_in = dX_out M + gamma
for the forward's X_out = X_in M^T + E^T), then every segment's full reverse pass from its folded
outgoing gradient, recomputing its chunk states from the saved incoming state.

Everything here is explicit (no autograd) and runs in any float dtype; the tests check it against
torch autograd of the forward in float64 and against the float64 reference recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

from cp_linear.gdp import L2NORM_EPS


@dataclass
class ChunkInputs:
    """One chunk of one sequence, heads leading: q [H, t, K], k [H, C, K], v [H, C, V], g [H, t],
    beta [H, C] (C = t n_h steps, whole tokens)."""

    q: object
    k: object
    v: object
    g: object
    beta: object


def prep_forward(chunk: ChunkInputs, *, num_householder: int, scale: float, use_l2: bool) -> dict:
    """Ta, Tb [H, C, C], P [H, t, C], b [H, C], c [H, t], d [H] and the intermediates the backward reads."""
    import torch

    q, k, g, beta = chunk.q, chunk.k, chunk.g, chunk.beta
    heads, steps, _ = k.shape
    tokens = q.shape[1]
    dtype = k.dtype
    f = torch.rsqrt((k * k).sum(-1) + L2NORM_EPS) if use_l2 else torch.ones(heads, steps, dtype=dtype)
    fq = torch.rsqrt((q * q).sum(-1) + L2NORM_EPS) if use_l2 else torch.ones(heads, tokens, dtype=dtype)
    step_gate = torch.zeros(heads, steps, dtype=dtype)
    step_gate[:, ::num_householder] = g
    G = torch.cumsum(step_gate, 1)
    lower = torch.tril(torch.ones(steps, steps, dtype=dtype), -1)
    E = torch.exp(torch.tril(G[:, :, None] - G[:, None, :]))  # only i >= j is used
    gram = k @ k.transpose(1, 2)
    A = (beta * f)[:, :, None] * f[:, None, :] * E * gram * lower
    eye = torch.eye(steps, dtype=dtype)
    T = torch.linalg.solve_triangular(eye + A, eye.expand(heads, steps, steps), upper=False, unitriangular=True)
    a = beta * f * torch.exp(G)
    last = torch.arange(tokens) * num_householder + num_householder - 1
    causal = (torch.arange(steps)[None, :] <= last[:, None]).to(dtype)
    EP = torch.exp(torch.clamp(G[:, last, None] - G[:, None, :], max=0.0)) * causal
    qk = q @ k.transpose(1, 2)
    P = scale * fq[:, :, None] * f[:, None, :] * EP * qk
    G_last = G[:, -1]
    return dict(Ta=T * a[:, None, :], Tb=T * beta[:, None, :], P=P, b=f * torch.exp(G_last[:, None] - G),
                c=scale * fq * torch.exp(G[:, last]), d=torch.exp(G_last),
                # intermediates
                f=f, fq=fq, G=G, E=E, gram=gram, A=A, T=T, a=a, last=last, EP=EP, qk=qk, lower=lower)


def prep_backward(chunk: ChunkInputs, prep: dict, grads: dict, *, num_householder: int, scale: float,
                  use_l2: bool) -> tuple:
    """(dTa, dTb, dP, db, dc, dd) -> (dq [H, t, K], dk [H, C, K], dg [H, t], dbeta [H, C])."""
    import torch

    q, k, beta = chunk.q, chunk.k, chunk.beta
    T, a, f, fq, G, E, gram = (prep[name] for name in ("T", "a", "f", "fq", "G", "E", "gram"))
    last, EP, qk, lower = prep["last"], prep["EP"], prep["qk"], prep["lower"]
    dTa, dTb, dP, db, dc, dd = (grads[name] for name in ("dTa", "dTb", "dP", "db", "dc", "dd"))
    # Ta = T diag(a), Tb = T diag(beta)
    dT = dTa * a[:, None, :] + dTb * beta[:, None, :]
    da = (dTa * T).sum(1)
    dbeta = (dTb * T).sum(1) + da * f * torch.exp(G)
    df = da * beta * torch.exp(G)
    dG = da * a
    # T = (I + A)^-1  ->  dA = -T^T dT T^T on the strictly lower part
    dA = -(T.transpose(1, 2) @ dT @ T.transpose(1, 2)) * lower
    # A_ij = beta_i f_i f_j E_ij gram_ij (i > j)
    S = dA * E * gram
    row_s, col_s = (S * f[:, None, :]).sum(2), (S * (beta * f)[:, :, None]).sum(1)
    dbeta = dbeta + f * row_s
    df = df + beta * row_s + col_s
    # W = dA * A = S diag-scaled: its row sums are beta f row_s, its column sums f col_s (no pass of its own)
    dG = dG + beta * f * row_s - f * col_s
    dgram = dA * (beta * f)[:, :, None] * f[:, None, :] * E
    dk = (dgram + dgram.transpose(1, 2)) @ k
    # P_tj = scale fq_t f_j EP_tj qk_tj
    base = scale * EP * qk
    dfq = (dP * base * f[:, None, :]).sum(2)
    col_p = (dP * base * fq[:, :, None]).sum(1)
    df = df + col_p
    # U = dP * P: row sums fq dfq, column sums f col_p
    dG = dG.index_add(1, last, fq * dfq) - f * col_p
    dqk = dP * scale * fq[:, :, None] * f[:, None, :] * EP
    dq = dqk @ k
    dk = dk + dqk.transpose(1, 2) @ q
    # b_j = f_j exp(G_last - G_j); c_t = scale fq_t exp(G_{i_t}); d = exp(G_last)
    b, c, d = prep["b"], prep["c"], prep["d"]
    df = df + db * torch.exp(G[:, -1:] - G)
    dG = dG - db * b
    dG[:, -1] += (db * b).sum(1) + dd * d
    dfq = dfq + dc * scale * torch.exp(G[:, last])
    dG = dG.index_add(1, last, dc * c)
    # G = cumsum(step gates); a token's gate sits on its first step
    dgate = torch.flip(torch.cumsum(torch.flip(dG, [1]), 1), [1])
    dg = dgate[:, ::num_householder]
    if use_l2:  # f = (|k|^2 + eps)^(-1/2): df/dk = -f^3 k
        dk = dk - (df * f ** 3)[:, :, None] * k
        dq = dq - (dfq * fq ** 3)[:, :, None] * q
    return dq, dk, dg, dbeta


def scan_forward(X, chunk: ChunkInputs, prep: dict):
    """(X [H, V, K]) -> (X' [H, V, K], O [H, V, t], Y, D)."""
    Y = X @ chunk.k.transpose(1, 2)
    D = chunk.v.transpose(1, 2) @ prep["Tb"].transpose(1, 2) - Y @ prep["Ta"].transpose(1, 2)
    O = (X @ chunk.q.transpose(1, 2)) * prep["c"][:, None, :] + D @ prep["P"].transpose(1, 2)
    X_next = prep["d"][:, None, None] * X + (D * prep["b"][:, None, :]) @ chunk.k
    return X_next, O, Y, D


def scan_backward(X, chunk: ChunkInputs, prep: dict, dX_next, dO) -> tuple:
    """Reverse of ``scan_forward`` for one chunk -> (dX, dk, dv, dq, prep gradients)."""
    k, v, q = chunk.k, chunk.v, chunk.q
    Ta, Tb, P, b, c, d = (prep[name] for name in ("Ta", "Tb", "P", "b", "c", "d"))
    Y = X @ k.transpose(1, 2)
    D = v.transpose(1, 2) @ Tb.transpose(1, 2) - Y @ Ta.transpose(1, 2)
    M1 = dX_next @ k.transpose(1, 2)
    dD = M1 * b[:, None, :] + dO @ P
    dOc = dO * c[:, None, :]
    dDTa = dD @ Ta
    dX = d[:, None, None] * dX_next + dOc @ q - dDTa @ k
    grads = dict(db=(D * M1).sum(1), dc=(dO * (X @ q.transpose(1, 2))).sum(1), dd=(X * dX_next).sum((1, 2)),
                 dTb=dD.transpose(1, 2) @ v.transpose(1, 2), dTa=-(dD.transpose(1, 2) @ Y),
                 dP=dO.transpose(1, 2) @ D)
    dk = (D * b[:, None, :]).transpose(1, 2) @ dX_next - dDTa.transpose(1, 2) @ X
    dq = dOc.transpose(1, 2) @ X
    dv = (dD @ Tb).transpose(1, 2)
    return dX, dk, dv, dq, grads


def scan_gamma(chunk: ChunkInputs, prep: dict, dX_next, dO):
    """The state-gradient step alone (no state needed): dX = dX' N^T + (dO diag(c)) q - (dO P Ta) k."""
    dD = (dX_next @ chunk.k.transpose(1, 2)) * prep["b"][:, None, :] + dO @ prep["P"]
    return (prep["d"][:, None, None] * dX_next + (dO * prep["c"][:, None, :]) @ chunk.q
            - (dD @ prep["Ta"]) @ chunk.k)


def _chunks(q, k, v, g, beta, num_householder):
    """One sequence [t, H, ...] -> ChunkInputs of 64 // n_h whole tokens each."""
    tokens = q.shape[0]
    per_chunk = 64 // num_householder
    out = []
    for t0 in range(0, tokens, per_chunk):
        t1 = min(t0 + per_chunk, tokens)
        s0, s1 = t0 * num_householder, t1 * num_householder
        out.append(ChunkInputs(q[t0:t1].transpose(0, 1), k[s0:s1].transpose(0, 1), v[s0:s1].transpose(0, 1),
                               g[t0:t1].transpose(0, 1), beta[s0:s1].transpose(0, 1)))
    return out


def sequence_forward(q, k, v, g, beta, *, num_householder: int, scale: float, use_l2: bool, initial_state=None):
    """One sequence (q [t, H, K], k [t n_h, H, K], ...) -> (o [t, H, V], final state [H, K, V])."""
    import torch

    chunks = _chunks(q, k, v, g, beta, num_householder)
    heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    X = torch.zeros(heads, value_dim, key_dim, dtype=q.dtype) if initial_state is None \
        else initial_state.transpose(1, 2)
    outputs = []
    for chunk in chunks:
        prep = prep_forward(chunk, num_householder=num_householder, scale=scale, use_l2=use_l2)
        X, O, _, _ = scan_forward(X, chunk, prep)
        outputs.append(O.permute(2, 0, 1))
    return torch.cat(outputs, 0), X.transpose(1, 2)


def sequence_backward(q, k, v, g, beta, do, dfinal, *, num_householder: int, scale: float, use_l2: bool,
                      initial_state=None, segment_chunks: int | None = None):
    """Gradients of one sequence -> (dq, dk, dv, dg, dbeta, d initial state), by the segmented scheme.

    do [t, H, V] and dfinal [H, K, V] are the incoming gradients. With ``segment_chunks``, each
    segment's gamma is built from a zero outgoing gradient, the segments are folded with the
    forward transitions, and each segment then runs its full reverse pass (exactly as the kernels
    will); without, one reverse pass over all chunks.
    """
    import torch

    n_h = num_householder
    chunks = _chunks(q, k, v, g, beta, n_h)
    per_chunk = 64 // n_h
    heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
    preps = [prep_forward(c, num_householder=n_h, scale=scale, use_l2=use_l2) for c in chunks]
    dOs = [do[t0:t0 + per_chunk].permute(1, 2, 0) for t0 in range(0, q.shape[0], per_chunk)]
    # forward states at every chunk start (the kernels recompute them per segment from its incoming state)
    X = torch.zeros(heads, value_dim, key_dim, dtype=q.dtype) if initial_state is None \
        else initial_state.transpose(1, 2)
    starts = []
    for chunk, prep in zip(chunks, preps):
        starts.append(X)
        X, _, _, _ = scan_forward(X, chunk, prep)
    count = len(chunks)
    segment_chunks = segment_chunks or count
    segments = [range(s, min(s + segment_chunks, count)) for s in range(0, count, segment_chunks)]
    # outgoing state gradient of every segment: gamma per segment, then a descending fold with M
    outgoing = [None] * len(segments)
    dX_out = dfinal.transpose(1, 2)
    for index in range(len(segments) - 1, -1, -1):
        outgoing[index] = dX_out
        gamma = torch.zeros_like(dX_out)
        for c in reversed(segments[index]):
            gamma = scan_gamma(chunks[c], preps[c], gamma, dOs[c])
        dX_out = dX_out @ _segment_transition(chunks, preps, segments[index], heads, key_dim, q.dtype) + gamma
    d_initial = dX_out.transpose(1, 2)
    dq_parts, dk_parts, dv_parts, dg_parts, dbeta_parts = [], [], [], [], []
    for index, segment in enumerate(segments):
        dX = outgoing[index]
        results = {}
        for c in reversed(segment):
            dX, dk_c, dv_c, dq_c, grads = scan_backward(starts[c], chunks[c], preps[c], dX, dOs[c])
            dq_p, dk_p, dg_p, dbeta_p = prep_backward(chunks[c], preps[c], grads, num_householder=n_h,
                                                      scale=scale, use_l2=use_l2)
            results[c] = (dq_c + dq_p, dk_c + dk_p, dv_c, dg_p, dbeta_p)
        for c in segment:
            dq_c, dk_c, dv_c, dg_c, dbeta_c = results[c]
            dq_parts.append(dq_c)
            dk_parts.append(dk_c)
            dv_parts.append(dv_c)
            dg_parts.append(dg_c)
            dbeta_parts.append(dbeta_c)
    cat = lambda parts: torch.cat(parts, 1).transpose(0, 1)  # noqa: E731
    return cat(dq_parts), cat(dk_parts), cat(dv_parts), cat(dg_parts), cat(dbeta_parts), d_initial


def _segment_transition(chunks, preps, segment, heads, key_dim, dtype):
    """M of a segment in the backward orientation: dX_in = dX_out M + gamma, i.e. the product of the
    chunks' N^T in reverse order (the forward summary's transition, transposed)."""
    import torch

    M = torch.eye(key_dim, dtype=dtype).expand(heads, key_dim, key_dim).clone()
    for c in reversed(segment):
        chunk, prep = chunks[c], preps[c]
        zero_do = torch.zeros(heads, key_dim, chunk.q.shape[1], dtype=dtype)
        M = scan_gamma(chunk, prep, M, zero_do)
    return M
