"""Torch CP over NCCL on real GPUs: GDP chunkwise CP (TorchGDPBackend, autograd) and block-diagonal
attention in every exchange mode, each rank against one-device results on the same GPU.

    NCCL_NVLS_ENABLE=0 python benchmarks/gpu_torch_cp_check.py [--world 2] [--timeout 240]

The parent kills the ranks after ``--timeout`` seconds, so a hang cannot outlive the call.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cp_linear import build_blockdiag_plan, build_packed_sequence_cp_metadata  # noqa: E402

TOL_OUT, TOL_GRAD = 1e-4, 1e-3


def rel(out, ref):
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def gdp_inputs(tokens, n, heads, kd, vd, device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, heads, kd, generator=gen)
    k = torch.randn(1, tokens * n, heads, kd, generator=gen)
    v = torch.randn(1, tokens * n, heads, vd, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, tokens, heads, generator=gen) + 1)
    beta = torch.sigmoid(torch.randn(1, tokens * n, heads, generator=gen))
    do = torch.randn(1, tokens, heads, vd, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, do)]


def check_gdp(rank, world, device, lines):
    from torch_api import gated_delta_product, gdp_chunkwise_context_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    n, local = 2, 1024
    tokens = world * local
    lengths = [300, tokens - 600, 1, 299]  # one document spans every rank
    q, k, v, g, beta, do = gdp_inputs(tokens, n, 4, 64, 64, device)
    ids = np.repeat(np.arange(len(lengths)), lengths).reshape(1, -1)
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32, device=device)
    full = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_ref, _ = gated_delta_product(*full, num_householder=n, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    (o_ref * do).sum().backward()
    tok, step = slice(rank * local, (rank + 1) * local), slice(rank * local * n, (rank + 1) * local * n)
    leaves = [x[:, tok if i in (0, 3) else step].clone().requires_grad_() for i, x in enumerate((q, k, v, g, beta))]
    md = build_packed_sequence_cp_metadata(ids, rank, world)
    o = gdp_chunkwise_context_parallel(*leaves, cp_group=dist.group.WORLD, metadata=md, num_householder=n,
                                       use_qk_l2norm_in_kernel=True)
    (o * do[:, tok]).sum().backward()
    ok = rel(o, o_ref[:, tok]) <= TOL_OUT
    errs = [f"o {rel(o, o_ref[:, tok]):.1e}"]
    for name, leaf, ref, sl in zip("qkvgb", leaves, full, (tok, step, step, tok, step)):
        err = rel(leaf.grad, ref.grad[:, sl])
        ok &= err <= TOL_GRAD
        errs.append(f"d{name} {err:.1e}")
    lines.append(f"[{'ok' if ok else 'FAIL'}] rank {rank} GDP CP (NCCL, T={tokens}, n_h=2): " + ", ".join(errs))
    return ok


def check_blockdiag(rank, world, device, lines):
    from torch_api import blockdiag_attention
    from torch_api.attention.naive import naive_blockdiag_attention

    local = 512
    tokens = world * local
    layouts = {
        "straddle+padding": np.concatenate([np.full(400, 1), np.zeros(30, np.int64), np.full(tokens - 500, 2),
                                            np.zeros(70, np.int64)]),
        "one-doc-all-ranks": np.ones(tokens, np.int64),
    }
    ok = True
    gen = torch.Generator().manual_seed(1)
    for name, doc_ids in layouts.items():
        q = torch.randn(2, tokens, 8, 64, generator=gen).to(device)
        k = torch.randn(2, tokens, 2, 64, generator=gen).to(device)
        v = torch.randn(2, tokens, 2, 64, generator=gen).to(device)
        do = torch.randn(2, tokens, 8, 64, generator=gen).to(device)
        ids = torch.tensor(doc_ids, device=device)
        full = [x.double().requires_grad_() for x in (q, k, v)]
        out_ref = naive_blockdiag_attention(*full, ids)
        (out_ref * do.double()).sum().backward()
        tok = slice(rank * local, (rank + 1) * local)
        plan = build_blockdiag_plan(doc_ids, world)
        for mode in ["auto", "allgather", "a2a"] + (["halo"] if plan.use_halo else []):
            for kernel in ("sdpa", "flex") if device.type == "cuda" else ("sdpa",):  # flex: no CPU backward
                os.environ["CP_LINEAR_BLOCKDIAG_KERNEL"] = kernel
                leaves = [x[:, tok].clone().requires_grad_() for x in (q, k, v)]
                out = blockdiag_attention(*leaves, torch.tensor(doc_ids, device=device), cp_group=dist.group.WORLD,
                                          mode=mode)
                (out * do[:, tok]).sum().backward()
                errs = [rel(out, out_ref[:, tok])] + [rel(leaf.grad, ref.grad[:, tok]) for leaf, ref in zip(leaves, full)]
                good = max(errs) <= TOL_OUT
                ok &= good
                lines.append(f"[{'ok' if good else 'FAIL'}] rank {rank} blockdiag {name} mode={mode} kernel={kernel}: "
                             f"out {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e}")
    os.environ.pop("CP_LINEAR_BLOCKDIAG_KERNEL", None)
    return ok


def worker(rank, world, port, results, use_cpu):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cpu:  # gloo dry run of this script on a machine without GPUs
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60),
                                device_id=device)
    lines, ok = [], True
    for check in (check_gdp, check_blockdiag):
        try:
            ok &= check(rank, world, device, lines)
        except Exception as err:  # keep going: report every check
            import traceback

            ok = False
            lines.append(f"[FAIL] rank {rank} {check.__name__} raised {type(err).__name__}: {err}\n"
                         f"{traceback.format_exc()}")
    results.put((rank, ok, lines))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (a dry run of this script)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.world, port, results, args.cpu)) for r in range(args.world)]
    for p in procs:
        p.start()
    outcome = {}
    try:
        for _ in range(args.world):
            rank, ok, lines = results.get(timeout=args.timeout)
            outcome[rank] = ok
            print("\n".join(lines), flush=True)
    except Exception as err:
        print(f"[FAIL] ranks did not report within {args.timeout}s: {type(err).__name__}", flush=True)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    good = len(outcome) == args.world and all(outcome.values())
    print("ALL OK" if good else "SOME CHECKS FAILED", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
