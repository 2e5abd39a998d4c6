"""Train the hybrid GDP + attention decoder with context parallelism in PyTorch (one command).

The script spawns its CP ranks itself (torch.multiprocessing, a free port, gloo on CPU / NCCL on
GPU, timeouts on every collective and on the whole run). Each step packs synthetic
associative-recall documents (examples/data.py) into one row of ``--seq-len`` tokens; rank r
owns tokens [r L, (r+1) L). Every rank holds the full weights; the layers exchange what they
need (GDP state summaries, attention K/V, the conv halo), each rank back-propagates its part of
the loss, and one all-reduce sums the weight gradients (and the loss).

    python -m examples.train_torch                    # CPU, 2 ranks (README: run time)
    python -m examples.train_torch --device cuda --cp 2 --seq-len 65536 --layers 8 --hidden 1024 \\
        --heads 8 --head-dim 128 --kv-heads 2 --dtype bfloat16 --steps 1000 --lr 1e-3

Before training, rank 0 also runs step 0 on one device (the same weights, no CP) and prints the
parity line; at the end it writes out/train_torch/loss.png and history.json.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import numpy as np

from examples.common import base_parser, check_args, decoder_config, finish, free_port, parity_line, recall_task
from examples.data import IGNORE, packed_batch


def build_model(args, task):
    import torch

    from cp_linear.weights import initial_table
    from torch_api.layers import HybridDecoder, load_state_table

    config = decoder_config(args, task.vocab_size)
    checks = not args.skip_cp_checks
    # --dtype bfloat16: a bf16 residual stream over float32 weights, as examples/train_jax.py's compute_dtype
    compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    model = HybridDecoder(config, attention_options={"mode": args.attention_mode, "check_inputs": checks},
                          gdp_options={"cp_check_inputs": checks}, compute_dtype=compute_dtype)
    # numpy-drawn weights: the same on every rank and in examples/train_jax.py for the same --seed
    return load_state_table(model, initial_table(config, args.seed))


def loss_pieces(model, ids, targets, doc_ids, *, layout=None, autocast=None):
    """(sum of the local answer losses, number of answers in the *global* row) -> local loss share."""
    import torch.nn.functional as F

    with autocast():
        logits = model(ids, layout=layout) if layout is not None else model(ids, doc_ids=doc_ids)
    return F.cross_entropy(logits[0].float(), targets, ignore_index=IGNORE, reduction="sum")


def _flat_grads(params):
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def worker(rank: int, args, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import contextlib
    import warnings

    # torch 2.13 renamed all_gather_into_tensor; the old name still works but warns on every call
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from torch_api.layers import build_shard_layout

    on_gpu = args.device in ("cuda", "gpu")
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cp))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=args.cp,
                            timeout=timedelta(seconds=120), **({"device_id": device} if on_gpu else {}))
    group = dist.group.WORLD
    task = recall_task(args)
    model = build_model(args, task).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None

    def autocast():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    rng = np.random.default_rng(args.seed)  # every rank draws the same batches and keeps its shard
    local_len = args.seq_len // args.cp
    shard = slice(rank * local_len, (rank + 1) * local_len)
    history = {"loss": [], "cp": args.cp, "num_values": task.num_values, "seq_len": args.seq_len}
    bar = tqdm(range(args.steps), disable=rank != 0, desc=f"torch CP={args.cp}", unit="step", file=sys.stdout)
    start, tokens_done = None, 0
    for step in bar:
        ids, targets, doc_ids = packed_batch(task, rng, args.seq_len)
        answers = max(1, int(np.sum(targets != IGNORE)))  # replicated: no communication needed
        local_ids = torch.from_numpy(ids[shard]).to(device)[None]
        local_targets = torch.from_numpy(targets[shard]).to(device)
        if step == 0 and rank == 0:
            # the same step on one device (no CP, whole row): the reference for the parity line
            full_loss = loss_pieces(model, torch.from_numpy(ids).to(device)[None], torch.from_numpy(targets).to(device),
                                    torch.from_numpy(doc_ids), autocast=autocast) / answers
            single_grads = torch.cat([g.reshape(-1) for g in torch.autograd.grad(full_loss, params)])
            single_loss = full_loss.item()
        layout = build_shard_layout(total_len=args.seq_len, doc_ids=doc_ids, cp_group=group)
        local = loss_pieces(model, local_ids, local_targets, None, layout=layout, autocast=autocast) / answers
        optimizer.zero_grad(set_to_none=True)
        local.backward()
        # one all-reduce for every weight gradient and the loss
        flat = torch.cat([_flat_grads(params), local.detach().reshape(1)])
        dist.all_reduce(flat, group=group)
        loss_value = float(flat[-1])
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if step == 0 and rank == 0:
            grad_rel = float((flat[:-1] - single_grads).norm() / single_grads.norm().clamp_min(1e-30))
            line = parity_line(loss_value, single_loss, grad_rel, args.cp)
            history["parity"] = {"cp_loss": loss_value, "single_device_loss": single_loss, "grad_rel": grad_rel,
                                 "line": line}
            bar.write(line)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        history["loss"].append(loss_value)
        if step == 0:
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()  # step 0 carries one-time costs: time the rest
        else:
            tokens_done += args.seq_len
            rate = tokens_done / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{rate:.0f}")
    elapsed = time.perf_counter() - start if start is not None else 0.0
    history["tokens_per_s"] = tokens_done / elapsed if tokens_done else 0.0
    bar.close()
    dist.barrier(group=group)
    dist.destroy_process_group()
    if rank == 0:
        results.put(history)


def run(args) -> dict:
    """Spawn ``args.cp`` ranks, wait (with a deadline) and return rank 0's history."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    context = mp.start_processes(worker, args=(args, free_port(), results), nprocs=args.cp, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + args.timeout
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"training did not finish within --timeout {args.timeout:.0f}s")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
    if results.empty():
        raise RuntimeError("rank 0 finished without reporting its history")
    return results.get()


def parser():
    """The flags of this example: examples/common.py's, plus --skip-cp-checks."""
    flags = base_parser(__doc__.splitlines()[0], "out/train_torch")
    flags.add_argument("--skip-cp-checks", action="store_true",
                       help="skip the layers' value checks (NaN/Inf, g > 0, beta range): one agreement per step "
                            "instead of one per layer; non-finite values are then contained instead of reported "
                            "(docs/failure_modes.md)")
    return flags


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    if args.device in ("cuda", "gpu"):
        import torch

        if torch.cuda.device_count() < args.cp:
            raise SystemExit(f"--device cuda needs {args.cp} GPUs; found {torch.cuda.device_count()}")
    history = run(args)
    title = (f"torch: {args.layers} layers, hidden {args.hidden}, T = {args.seq_len}, CP {args.cp}, "
             f"{args.device}, {args.dtype}")
    return finish(args, history, title, decoder_config(args, recall_task(args).vocab_size))


if __name__ == "__main__":
    sys.exit(main())
