"""One training step of the hybrid decoder: tokens/s, MFU and peak memory, torch (1 GPU, CP on 2 GPUs)
and, when flash-linear-attention is importable, the same model built from FLA's GatedDeltaProduct layer;
the same model in JAX on 1 GPU.

    python benchmarks/bench_train.py [--out DIR] [--tokens 32768] [--gpus 1 2] [--repeat 5] [--no-fla]
                                     [--frameworks torch jax] [--residual {float32,bf16}]
    python benchmarks/bench_train.py --dry-run [--frameworks torch jax]   # tiny model on the CPU (what CI runs)

Model: hidden 2048, 8 layers alternating GDP (16 heads x 128, n_h = 2) and attention (GQA 16 / 4,
head 128), bf16 autocast over float32 weights with a bf16 residual stream (``--residual``, below), T tokens
per GPU in packed documents. CP runs are
spawned here (no torchrun) with NCCL, NCCL_NVLS_ENABLE=0 and a collective timeout, so one call stays
well inside 9 minutes. MFU = model FLOPs per step (6 x parameters x tokens + the GDP and attention
matmul FLOPs, forward x 3) / (time x peak bf16 FLOP/s, 989e12 for an H100/H200). Writes a table, a
CSV and a PNG (when matplotlib is importable). Every row runs on the same documents and tokens, and
the torch step updates nothing (forward, then backward into ``.grad``).

JAX, "jax-1gpu" (``--frameworks``; by default when jax is importable and not --dry-run, then only when
JAX sees a GPU; ``jax_train_step.py``): the same decoder from ``jax_api.layers`` with the torch rows'
initial weights (so the loss printed under the table matches), one ``jax.jit(jax.value_and_grad)``
step, no update, timed alike after an untimed ahead-of-time compile. bf16 through the model's
``compute_dtype`` (JAX has no autocast): its residual stream is bf16, as torch's with the default
``--residual bf16``; its attention is cuDNN's packed flash attention (``jax_api.attention.cudnn``) where
torch runs flex_attention in bf16; the printout lists what still differs and which kernels (GDP, short
conv, gated norm, cuDNN attention) the compiled step calls. Peak memory: JAX's ``peak_bytes_in_use`` since
the process started (XLA has no reset). A ``jax / torch`` line compares jax-1gpu with cp_linear-1gpu
tokens/s (issue 15: within 3%).
--dry-run runs it on the CPU in float32, as the torch dry run.

Residual stream, ``--residual`` (default bf16 on a GPU, float32 for --dry-run): bf16 builds every torch
model (ours and the FLA baseline's) with ``HybridDecoder(compute_dtype=torch.bfloat16)``, the JAX model's
policy (embeddings' output cast to bf16, float32 weights cast at each matmul; norms and gates in float32),
which spares torch the float32 residual's traffic and autocast's per-linear casts of float32 activations;
float32 keeps torch's residual stream in float32 under autocast (the earlier rows; JAX still runs bf16
there, it has no float32-residual bf16 mode). Every row and the CSV record the policy (``residual``).

FLA baseline, "fla-1gpu" (one GPU, no CP; run when ``fla`` is importable, unless --no-fla or --dry-run;
``fla_baseline.py``): the same HybridDecoder, same weights and documents, with its GDP mixers
FLA's ``fla.layers.GatedDeltaProduct`` configured as ours (loaded with our layers' weights, fed FLA's
varlen cu_seqlens) and its attention mixers our projections and RoPE followed by torch's compiled
``flex_attention`` under a document-causal BlockMask built once per batch from the document ids.
Embedding, norms, MLPs and head are our modules, so FLOPs and MFU are counted alike. The work differs
in the kernels (FLA's Triton GDP and short conv against our CuTeDSL kernels and torch conv; our
attention builds its BlockMask on the host) and in our value containment (checks off here: non-finite
values are sanitised in our GDP and attention layers; FLA and flex do no such work). FLA's gated backward
refuses Triton 3.4 to 3.7.0 on Hopper (FLA#640); the guard is switched off, so that row is *timing
only* (its gradients are not checked) and the printout says so. A ``speedup`` line compares
cp_linear-1gpu with fla-1gpu tokens/s (issue 15's target: >= 1.5x). Budget the first FLA step: on a
fresh H200 (empty Triton and Inductor caches, T = 32k) it took 265 s, FLA's Triton autotuning and the
flex_attention / create_block_mask compiles; each later step 0.36 s.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import time
from datetime import timedelta

PEAK_BF16 = 989e12
FULL = dict(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, head_dim=128, num_kv_heads=4,
            num_householder=2, expand_v=1.0)
TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, head_dim=16, num_kv_heads=1,
            num_householder=2, expand_v=1.0)


def model_flops(config, tokens: int) -> float:
    """Training FLOPs of one step: 6 N T for the weights plus 3x the forward's token-mixing matmuls
    (GDP chunked form ~ 4 T n_h H K (K + V) per layer; causal attention ~ 2 T^2 Hq D per layer, an upper
    bound for packed documents)."""
    params = sum(p.numel() for p in _model_parameters(config))
    gdp_layers = sum(kind == "gdp" for kind in config.layer_types)
    attn_layers = config.num_layers - gdp_layers
    k = v = config.head_dim
    mixing = (gdp_layers * 4 * tokens * config.num_householder * config.num_heads * k * (k + v)
              + attn_layers * 2 * tokens * tokens * config.num_heads * config.head_dim)
    return 6 * params * tokens + 3 * mixing


def _model_parameters(config):
    from torch_api.layers import HybridDecoder

    import torch

    with torch.device("meta"):
        return list(HybridDecoder(config).parameters())


def _doc_ids(total: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(total // 16 + 1, total // 2 + 2)))
    lengths[-1] -= sum(lengths) - total
    return np.repeat(np.arange(1, len(lengths) + 1), lengths)


def _token_ids(vocab_size: int, total: int, seed: int):
    """int64 [total]: the whole row's tokens, drawn on the host so that every framework and rank reads
    the same ones (rank r takes its slice)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, total)


def residual_dtype(args):
    """The torch models' ``compute_dtype`` for ``args.residual``: bf16, or None (the float32 stream)."""
    import torch

    return torch.bfloat16 if getattr(args, "residual", "float32") == "bf16" else None


def _step_fn(model, tokens, layout, device):
    import torch

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(tokens, layout=layout)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        return loss

    return step


def run_rank(rank: int, world: int, args, port: int, results) -> None:
    """One spawned rank: its process group (NCCL on GPUs, gloo for --dry-run), then ``measure``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.dry_run
    if cuda:
        torch.cuda.set_device(torch.device("cuda", rank))
    group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout))
        group = dist.group.WORLD
    row = measure(rank, world, group, args)
    if row is not None:
        results.append(row)
    if world > 1:
        dist.destroy_process_group()


def measure(rank: int, world: int, group, args, fla: bool = False) -> dict | None:
    """Time ``args.repeat`` training steps (after ``args.warmup``) of this rank in ``group`` (None for
    one device; any initialised process group otherwise). Returns rank 0's row, None elsewhere.
    ``fla``: the FLA baseline (``fla_baseline.fla_decoder``, one device only) instead of our decoder."""
    import torch

    from cp_linear.model_config import DecoderConfig
    from torch_api.layers import HybridDecoder, build_shard_layout

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    config = DecoderConfig(**(TINY if args.dry_run else FULL))
    torch.manual_seed(0)
    # the layers' value checks read the host and add headers per op (docs/failure_modes.md): off unless asked
    checks = bool(getattr(args, "check_inputs", False))
    note = ""
    if fla:
        from fla_baseline import FlexLayout, bypass_fla_hopper_guard, fla_decoder  # benchmarks/, beside this file

        if bypass_fla_hopper_guard():
            note = "FLA's gated backward ran with its Triton/Hopper guard (FLA#640) switched off: timing only"
        # the same initial weights as ours (same seed) and the same residual stream
        model = fla_decoder(config, compute_dtype=residual_dtype(args)).to(device)
    else:
        model = HybridDecoder(config, gdp_options={"cp_check_inputs": checks},
                              attention_options={"check_inputs": checks}, compute_dtype=residual_dtype(args)).to(device)
    total = args.tokens * world
    ids = _doc_ids(total, 0)
    compiled = bool(getattr(args, "compile", False))
    # compiled: the graph-ready layout (ids as a device tensor, static shapes; the one torch.compile
    # traces on one device), bounded to 16 sequences per shard
    layout = build_shard_layout(total_len=total, doc_ids=ids, cp_group=group,
                                max_sequences=16 if compiled else None).materialize(device)
    if fla:  # the same documents: FLA's cu_seqlens, RoPE positions and the flex BlockMask, built once
        layout = FlexLayout(layout, device)
    local = slice(rank * args.tokens, (rank + 1) * args.tokens)
    tokens = torch.from_numpy(_token_ids(config.vocab_size, total, 1)[local]).reshape(1, -1).to(device)
    # torch.compile (Inductor) fuses the decoder's elementwise work, as XLA does for the JAX row;
    # the warmup steps compile (untimed)
    step = _step_fn(torch.compile(model) if compiled else model, tokens, layout, device)
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeat):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    if cuda and rank == 0 and getattr(args, "profile", 0):
        print_profile(step, model, args.profile)
    if rank != 0:
        return None
    row = dict(framework="torch", variant=f"{'fla' if fla else 'cp_linear'}-{world}gpu", gpus=world,
               residual=getattr(args, "residual", "float32"), tokens_per_gpu=args.tokens, step_ms=1e3 * seconds,
               tokens_per_s=total / seconds,
               mfu=model_flops(config, args.tokens) / (seconds * PEAK_BF16) if cuda else float("nan"),
               peak_gib=peak, loss=float(loss.detach()))  # every step's loss (nothing is updated), printed
    if compiled:
        note = "; ".join(filter(None, [note, "torch.compile(model): compiled in the warmup steps"]))
    if note:
        row["note"] = note  # printed under the table, not a CSV column
    return row


def print_profile(step, model, rows: int) -> None:
    """One more step under torch.profiler: the ``rows`` kernels with the most device time (where a step's
    time goes, by kernel name)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))


def _spawned(rank, world, args, port, queue):
    rows: list = []
    run_rank(rank, world, args, port, rows)
    queue.put(rows)


def run_world(world: int, args) -> list[dict]:
    if world == 1:
        rows: list = []
        run_rank(0, 1, args, 0, rows)
        return rows
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_spawned, args=(r, world, args, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows = []
    for _ in procs:
        rows += queue.get(timeout=args.timeout)
    for proc in procs:
        proc.join(timeout=args.timeout)
        if proc.is_alive():
            proc.kill()
    return rows


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def run_fla(args) -> list[dict]:
    """The FLA baseline's row, measured in this process on GPU 0. A failure is printed, not raised, so
    that the other rows are still written."""
    import traceback

    try:
        return [measure(0, 1, None, args, fla=True)]
    except Exception:
        traceback.print_exc()
        print("fla-1gpu failed (traceback above): no FLA row")
        return []


def wants_jax(args) -> bool:
    """The JAX row: as --frameworks says; by default when jax is importable and this is no --dry-run
    (``run_jax`` then skips it unless JAX sees a GPU)."""
    if args.frameworks is not None:
        return "jax" in args.frameworks
    return not args.dry_run and importlib.util.find_spec("jax") is not None


def run_jax(args) -> list[dict]:
    """The JAX row, measured in this process on JAX's first device after the torch rows. A failure is
    printed, not raised, so that the other rows are still written."""
    import traceback

    try:
        import jax_train_step  # benchmarks/, beside this file

        if not args.dry_run and jax_train_step.backend() != "gpu":
            print(f"jax-1gpu skipped: JAX's default backend is {jax_train_step.backend()}, not a GPU")
            return []
        return [jax_row(args)]
    except Exception:
        traceback.print_exc()
        print("jax-1gpu failed (traceback above): no JAX row")
        return []


def jax_row(args) -> dict:
    """jax-1gpu's row: the torch rows' model (config, seed-0 initial weights), documents and tokens,
    in bf16 on a GPU and float32 for --dry-run (where torch's autocast is off too) unless ``--residual
    bf16`` asks for the bf16 model there too."""
    import jax_train_step
    import torch

    from cp_linear.model_config import DecoderConfig
    from torch_api.layers import HybridDecoder

    config = DecoderConfig(**(TINY if args.dry_run else FULL))
    torch.manual_seed(0)
    weights = HybridDecoder(config).state_table()  # built on the CPU, as ``measure`` builds it before .to()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the torch rows' cached blocks, back to the device for JAX
    gpu = not args.dry_run
    bf16 = gpu or getattr(args, "residual", "float32") == "bf16"
    result = jax_train_step.measure_jax(
        config, weights, _doc_ids(args.tokens, 0), _token_ids(config.vocab_size, args.tokens, 1).reshape(1, -1),
        bf16=bf16, on_cpu=not gpu, warmup=args.warmup, repeat=args.repeat)
    seconds, peak = result["seconds"], result["peak_bytes"]
    if not bf16:
        precision = "float32 throughout, as torch's dry run"
    elif getattr(args, "residual", "float32") == "bf16":
        precision = (f"bf16 compute_dtype over float32 weights, as torch's rows (--residual bf16); still different: "
                     f"{jax_train_step.PRECISION_DIFFERENCES}")
    else:
        precision = (f"bf16 compute_dtype over float32 weights; unlike torch's rows (--residual float32): a bf16 "
                     f"residual stream against torch's float32 one; also {jax_train_step.PRECISION_DIFFERENCES}")
    memory = ("JAX's peak_bytes_in_use since the process started" if peak is not None
              else f"not reported (memory_stats() is None on {result['device']}): NaN")
    note = "\n  ".join([f"precision: {precision}",
                        f"kernels in the step: {jax_train_step.kernel_summary(result['kernels'])}",
                        f"step: jit(value_and_grad), no update; compiled ahead in {result['compile_s']:.1f} s "
                        "(untimed)",
                        f"peak memory: {memory}"])
    return dict(framework="jax", variant="jax-1gpu", gpus=1, residual="bf16" if bf16 else "float32",
                tokens_per_gpu=args.tokens, step_ms=1e3 * seconds,
                tokens_per_s=args.tokens / seconds,
                mfu=model_flops(config, args.tokens) / (seconds * PEAK_BF16) if gpu else float("nan"),
                peak_gib=peak / 2**30 if peak is not None else float("nan"), loss=result["loss"],
                kernels=result["kernels"], note=note)


def tokens_ratio(rows: list[dict], numerator: str, denominator: str) -> float | None:
    """``numerator``'s tokens/s over ``denominator``'s (variants), None unless both were measured."""
    by_variant = {row["variant"]: row for row in rows}
    if numerator not in by_variant or denominator not in by_variant:
        return None
    return by_variant[numerator]["tokens_per_s"] / by_variant[denominator]["tokens_per_s"]


def speedup(rows: list[dict]) -> float | None:
    """cp_linear-1gpu tokens/s over fla-1gpu tokens/s, None unless both were measured."""
    return tokens_ratio(rows, "cp_linear-1gpu", "fla-1gpu")


def write(rows: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    keys = ["framework", "variant", "gpus", "residual", "tokens_per_gpu", "step_ms", "tokens_per_s", "mfu", "peak_gib"]
    with open(os.path.join(out, "bench_train.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")  # a row's note is printed
        writer.writeheader()
        writer.writerows(rows)
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row.get(k):.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys))
    for row in rows:
        if row.get("note"):
            print(f"{row['variant']}: {row['note']}")
    ratio = speedup(rows)
    if ratio is not None:
        print(f"speedup: cp_linear-1gpu / fla-1gpu tokens/s = {ratio:.2f}x (issue 15's target: >= 1.5x)")
    jax_ratio = tokens_ratio(rows, "jax-1gpu", "cp_linear-1gpu")
    if jax_ratio is not None:
        print(f"jax / torch tokens/s: jax-1gpu / cp_linear-1gpu = {jax_ratio:.3f} "
              f"(issue 15's target: >= 0.97, JAX within 3% of torch)")
        losses = {row["variant"]: row["loss"] for row in rows}
        print(f"loss (every step's): cp_linear-1gpu {losses['cp_linear-1gpu']:.6f}, jax-1gpu {losses['jax-1gpu']:.6f} "
              f"(jax / torch - 1 = {losses['jax-1gpu'] / losses['cp_linear-1gpu'] - 1:.2e})")
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar([r["variant"] for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_ylabel("tokens / s")
        titles = ([f"cp_linear-1gpu / fla-1gpu: {ratio:.2f}x"] if ratio is not None else []) + (
            [f"jax / torch: {jax_ratio:.3f}"] if jax_ratio is not None else [])
        if titles:
            ax.set_title(", ".join(titles), fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bench_train.png"))


def main(argv=None, run=run_world) -> list[dict]:
    """Parse ``argv``, run every world size through ``run(world, args) -> rows`` (``run_world``:
    spawned ranks; tests pass a runner over their own process groups), print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bench_train")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per GPU")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per collective and per spawned run")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, profile one step and print the ROWS kernels with the most device time")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU (gloo for CP)")
    parser.add_argument("--compile", action="store_true",
                        help="torch rows: torch.compile(model) (Inductor) over the graph-ready layout; the warmup "
                             "steps compile, untimed. torch 2.11's Inductor failed on this model's flag-count cumsums "
                             "(NOTES, 2026-12-03 fourth, 2026-12-08), now a custom op it does not lower; torch 2.13's "
                             "compiles it on the CPU (--dry-run)")
    parser.add_argument("--check-inputs", action="store_true",
                        help="the layers' value checks on (NaN/Inf, g, beta; one more header per op)")
    parser.add_argument("--no-fla", action="store_true",
                        help="skip the flash-linear-attention baseline (fla-1gpu), run by default when importable")
    parser.add_argument("--frameworks", nargs="+", choices=["torch", "jax"], default=None,
                        help="torch: the cp_linear rows (and fla-1gpu); jax: the jax-1gpu row. Default: both, "
                             "jax only where it is importable and sees a GPU; torch only for --dry-run")
    parser.add_argument("--residual", choices=["float32", "bf16"], default=None,
                        help="the torch models' residual stream: bf16 (HybridDecoder(compute_dtype=torch.bfloat16), "
                             "the JAX row's policy) or float32 (under autocast). Default: bf16 on a GPU, float32 "
                             "for --dry-run")
    args = parser.parse_args(argv)
    if args.residual is None:
        args.residual = "float32" if args.dry_run else "bf16"
    if args.dry_run:
        args.tokens, args.repeat, args.warmup = min(args.tokens, 32), 1, 0
    torch_rows = args.frameworks is None or "torch" in args.frameworks
    rows = []
    for world in args.gpus if torch_rows else []:
        rows += run(world, args)
    if torch_rows and fla_available() and not args.dry_run and not args.no_fla:
        rows += run_fla(args)
    if wants_jax(args):  # last: JAX's memory then stays out of the torch rows' way
        rows += run_jax(args)
    write(rows, args.out)
    return rows


if __name__ == "__main__":
    main()
