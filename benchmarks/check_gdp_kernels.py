"""Kernel-by-kernel check of the CuTeDSL GDP forward on a GPU, against float64 mirrors.

Prints the relative error of every intermediate (chunk table, w, u, cumulative gates, chunk
states, new values, output, transition product, fold), so a wrong kernel is named at once.

    python benchmarks/check_gdp_kernels.py
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from cp_linear.reference import l2norm, naive_gated_delta_product, wy_chunk
from cp_linear.summary import compose_forward
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err
from torch_api import GDPInputs
from torch_api.gdp.cutedsl import CHUNK, CuTeDSLGatedDeltaProductCPBackend

failures: list[str] = []


def report(name: str, err: float, tol: float) -> None:
    status = "ok " if err <= tol else "BAD"
    if err > tol or not np.isfinite(err):
        failures.append(name)
    print(f"  {status} {name:<34} rel err {err:.2e}", flush=True)


def check(lengths, heads, key_dim, value_dim, nh, l2, dtype=torch.float32):
    print(f"case lengths={lengths} H={heads} K={key_dim} V={value_dim} n_h={nh} l2={l2} {dtype}", flush=True)
    rng = np.random.default_rng(0)
    arrays = random_gdp_inputs(rng, tokens=sum(lengths), heads=heads, key_dim=key_dim, value_dim=value_dim,
                               num_householder=nh)
    q, k, v, g, beta = (torch.tensor(x, dtype=torch.float32, device="cuda") for x in arrays)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    cu_host = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cu = torch.tensor(cu_host, dtype=torch.int32, device="cuda")
    inputs = GDPInputs(q, k, v, g, beta, key_dim ** -0.5, nh, l2, cu)
    backend = CuTeDSLGatedDeltaProductCPBackend()
    shard = backend._shard(inputs)
    backend._index_and_wy(shard)
    initial = torch.randn(len(lengths), heads, key_dim, value_dim, device="cuda") * 0.1
    final = torch.empty_like(initial)
    backend._state_pass(shard, seq_begin=0, seq_count=len(lengths), initial=initial, final=final, final_begin=0)
    output = backend._output(shard)
    torch.cuda.synchronize()

    qh, kh, vh, gh, bh = (x.detach().float().cpu().numpy()[0].astype(np.float64) for x in (q, k, v, g, beta))
    if l2:
        qh, kh = l2norm(qh), l2norm(kh)
    counts = [-(-n * nh // CHUNK) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    report("chunk_offsets", float(np.abs(shard.chunk_offsets.cpu().numpy() - offsets).max()), 0)
    starts = np.concatenate([np.arange(a * nh, b * nh, CHUNK) for a, b in zip(cu_host[:-1], cu_host[1:])])
    ends = np.concatenate([np.minimum(np.arange(a * nh, b * nh, CHUNK) + CHUNK, b * nh)
                           for a, b in zip(cu_host[:-1], cu_host[1:])])
    report("chunk_start", float(np.abs(shard.chunk_start.cpu().numpy()[: offsets[-1]] - starts).max()), 0)
    report("chunk_len", float(np.abs(shard.chunk_len.cpu().numpy()[: offsets[-1]] - (ends - starts)).max()), 0)

    w, u, gc = (x.cpu().numpy() for x in (shard.w, shard.u, shard.gate_cumsum))
    states, new_values = shard.chunk_states.cpu().numpy(), shard.new_values.cpu().numpy()
    ew, eu, egc, estates, evalues = [], [], [], [], []
    gw, gu, ggc, gstates, gvalues = [], [], [], [], []
    init_host = initial.cpu().numpy().astype(np.float64)
    finals = []
    for n, (a, b) in enumerate(zip(cu_host[:-1], cu_host[1:])):
        state = init_host[n]
        g_steps = np.zeros((int(b - a) * nh, heads))
        g_steps[::nh] = gh[a:b]
        for m, s in enumerate(range(a * nh, b * nh, CHUNK)):
            sl = slice(s, min(s + CHUNK, b * nh))
            c = wy_chunk(kh[sl], vh[sl], bh[sl], g_steps[s - a * nh: sl.stop - a * nh])
            chunk_id = offsets[n] + m
            ew.append(c["w"].transpose(1, 0, 2)); gw.append(w[sl])
            eu.append(c["u"].transpose(1, 0, 2)); gu.append(u[sl])
            egc.append(np.log(c["gate"]).T); ggc.append(gc[sl])
            estates.append(state); gstates.append(states[chunk_id])
            evalues.append((c["u"] - c["w"] @ state).transpose(1, 0, 2)); gvalues.append(new_values[sl])
            state = c["transition"] @ state + c["update"]
        finals.append(state)
    for name, e, got in (("w", ew, gw), ("u", eu, gu), ("gate_cumsum", egc, ggc), ("chunk_states", estates, gstates),
                         ("new_values", evalues, gvalues)):
        report(name, rel_err(np.concatenate([x.ravel() for x in got]), np.concatenate([x.ravel() for x in e])), 1e-4)
    report("final_state", rel_err(final.cpu().numpy(), np.stack(finals)), 1e-4)
    ref_o, _ = naive_gated_delta_product(*(x.detach().float().cpu().numpy() for x in (q, k, v, g, beta)),
                                         num_householder=nh, initial_state=init_host, cu_seqlens=cu_host,
                                         use_qk_l2norm_in_kernel=l2)
    report("output", rel_err(output.float().cpu().numpy(), ref_o), 2e-3 if dtype != torch.float32 else 1e-4)

    # transition product and fold, on a one-sequence shard
    one = GDPInputs(q, k, v, g, beta, key_dim ** -0.5, nh, l2, None)
    summary, context = backend.cp_forward_prepare(one)
    transition = np.broadcast_to(np.eye(key_dim), (heads, key_dim, key_dim)).copy()
    g_steps = np.zeros((sum(lengths) * nh, heads))
    g_steps[::nh] = gh
    for s in range(0, sum(lengths) * nh, CHUNK):
        c = wy_chunk(kh[s:s + CHUNK], vh[s:s + CHUNK], bh[s:s + CHUNK], g_steps[s:s + CHUNK])
        transition = c["transition"] @ transition
    report("transition product (M)", rel_err(summary.packed[0, :, :, value_dim:].cpu().numpy(), transition), 1e-4)
    stacked = torch.randn(3, 1, heads, key_dim, value_dim + key_dim, device="cuda") * 0.3
    incoming = torch.empty(1 * heads, key_dim, value_dim, device="cuda")
    backend._fold(stacked.view(3, heads, key_dim, -1), incoming, width=value_dim, m_col=value_dim, has_update=True,
                  init_identity=False, out_col=0)
    expected = compose_forward(stacked.double().cpu().numpy())
    report("affine fold (S_in)", rel_err(incoming.view(1, heads, key_dim, value_dim).cpu().numpy(), expected), 1e-5)


def main() -> int:
    cases = [((130,), 2, 64, 64, 1, False), ((17, 90, 1, 40), 2, 128, 64, 2, True),
             ((100, 29), 3, 64, 128, 3, False), ((200,), 2, 128, 128, 2, True)]
    for case in cases:
        try:
            check(*case)
        except Exception as err:  # keep going: the other cases still tell which kernel is wrong
            failures.append(f"{case}: {type(err).__name__}")
            print(f"  ERROR {type(err).__name__}: {err}", flush=True)
    print("all kernel checks passed" if not failures else f"FAILED: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
