"""Pieces both training examples share: flags, the loss plot, the history file, the summary lines."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
from pathlib import Path

from cp_linear.model_config import DecoderConfig
from cp_linear.plan import MODE_CHOICES
from cp_linear.rounding import decoder_length, rounding_tolerance


def base_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda", "gpu"), default="cpu", help="cpu, or one GPU per CP rank")
    add("--cp", type=int, default=2, help="context-parallel ranks the sequence is split over")
    add("--steps", type=int, default=200, help="optimizer steps (one packed row of --seq-len tokens each)")
    add("--seq-len", type=int, default=512, help="global packed tokens per step (split over the ranks)")
    add("--layers", type=int, default=4, help="blocks, alternating GDP and attention")
    add("--hidden", type=int, default=64, help="model width (hidden_size)")
    add("--heads", type=int, default=2, help="GDP heads and attention query heads")
    add("--head-dim", type=int, default=32, help="key head dim of GDP, head dim of attention")
    add("--kv-heads", type=int, default=1, help="attention key/value heads (GQA; divides --heads)")
    add("--householder", type=int, default=2, help="num_householder of the GDP layers")
    add("--lr", type=float, default=5e-3, help="AdamW learning rate (no weight decay)")
    add("--clip", type=float, default=0.0, help="global gradient-norm clip (0: off)")
    add("--num-keys", type=int, default=8, help="keys (and values) of the recall task")
    add("--max-pairs", type=int, default=6, help="most key-value pairs in one document")
    add("--queries", type=int, default=4, help="questions per document")
    add("--attention-mode", default="auto", choices=MODE_CHOICES,
        help="K/V exchange of the attention layers under CP (cp_linear.plan.resolve_exchange_mode)")
    add("--dtype", default="float32", choices=("float32", "bfloat16"),
        help="compute dtype: the residual stream and activations (the models' compute_dtype; torch adds "
             "autocast); weights and optimizer stay float32")
    add("--seed", type=int, default=0,
        help="seeds the initial weights (cp_linear.weights.initial_table: the same in torch and JAX) and the data")
    add("--timeout", type=float, default=1800, help="seconds before the run is stopped")
    add("--out", default=default_out, help="directory for loss.png and history.json")
    return parser


def check_args(args) -> None:
    if args.cp < 1 or args.seq_len % args.cp:
        raise SystemExit(f"--seq-len ({args.seq_len}) must be a positive multiple of --cp ({args.cp})")
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parity_line(cp_loss: float, single_loss: float, grad_rel: float, cp: int) -> str:
    return (f"parity (step 0): loss with CP over {cp} ranks {cp_loss:.7f}, on one device {single_loss:.7f}, "
            f"|diff| {abs(cp_loss - single_loss):.2e}; gradient rel. diff {grad_rel:.2e}")


def recall_task(args):
    """The associative-recall task of the flags (examples/data.py)."""
    from examples.data import RecallTask

    return RecallTask(num_keys=args.num_keys, num_values=args.num_keys, max_pairs=args.max_pairs, queries=args.queries)


def decoder_config(args, vocab_size: int) -> DecoderConfig:
    """The model both examples train, from the flags."""
    return DecoderConfig(vocab_size=vocab_size, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                         head_dim=args.head_dim, num_kv_heads=args.kv_heads, num_householder=args.householder)


def parity_tolerance(config: DecoderConfig, seq_len: int, dtype: str) -> float:
    """How far the step-0 loss and gradients with and without CP may differ from rounding alone: two runs
    of the model, each the chain of ``cp_linear.rounding.decoder_length`` plus the loss's sum over the
    logits; in bfloat16 only the activations' roundings chain (every sum accumulates in float32), one
    per block and projection."""
    if dtype == "float32":
        return rounding_tolerance(decoder_length(config, seq_len) + seq_len * config.vocab_size,
                                  compared_with="rounded")
    return rounding_tolerance(4 * config.num_layers + 2, dtype="bfloat16", compared_with="rounded")


def parity_ok(history: dict, tolerance: float) -> bool:
    """CP and one device agree at step 0 within ``tolerance`` (``parity_tolerance``)."""
    parity = history["parity"]
    loss_rel = abs(parity["cp_loss"] - parity["single_device_loss"]) / max(abs(parity["single_device_loss"]), 1e-30)
    return loss_rel <= tolerance and parity["grad_rel"] <= tolerance


def write_outputs(out_dir: str, history: dict, title: str) -> Path:
    """history.json and loss.png (training loss, its moving average, the chance level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    losses = history["loss"]
    smooth, average = [], None
    for value in losses:
        average = value if average is None else 0.9 * average + 0.1 * value
        smooth.append(average)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, color="tab:blue", alpha=0.35, label=f"loss, CP over {history['cp']} ranks")
    ax.plot(smooth, color="tab:blue", label="moving average")
    ax.axhline(math.log(history["num_values"]), color="gray", ls="--", label="chance: log(values)")
    ax.scatter([0], [history["parity"]["single_device_loss"]], color="tab:red", zorder=3,
               label="step 0 on one device")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answers")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_lines(history: dict, png: Path) -> list[str]:
    losses = history["loss"]
    tail = losses[-min(10, len(losses)):]
    return [
        history["parity"]["line"],
        f"loss: first {losses[0]:.4f}, last-10 mean {sum(tail) / len(tail):.4f} "
        f"(chance {math.log(history['num_values']):.4f}) after {len(losses)} steps",
        f"throughput: {history['tokens_per_s']:.0f} tokens/s over {history['cp']} ranks",
        f"plot: {os.path.relpath(png)}",
    ]


__all__ = ["base_parser", "check_args", "decoder_config", "finish", "free_port", "parity_line", "parity_ok",
           "parity_tolerance", "recall_task", "summary_lines", "write_outputs"]


def finish(args, history: dict, title: str, config: DecoderConfig) -> int:
    """Write the plot and history, print the summary; exit status 1 when the step-0 parity failed."""
    import sys

    png = write_outputs(args.out, history, title)
    for line in summary_lines(history, png):
        print(line)
    if not parity_ok(history, parity_tolerance(config, args.seq_len, args.dtype)):
        print("FAILED: CP and one-device step 0 disagree beyond rounding", file=sys.stderr)
        return 1
    return 0
