"""Train the hybrid GDP + attention decoder with context parallelism in JAX (optax, one process).

The sequence is split along T over a one-axis mesh ``("cp",)`` of ``--cp`` devices: host CPU
devices (``--xla_force_host_platform_device_count`` is set before JAX starts) or GPUs. The whole
model runs inside one ``jax.shard_map`` (``jax_api.layers.cp_apply``) with the weights
replicated; ``jax.grad`` of the loss returns weight gradients already summed over the ranks.
Batches are the same packed associative-recall rows as in examples/train_torch.py.

    python -m examples.train_jax                        # CPU, 2 host devices
    python -m examples.train_jax --device gpu --cp 2 --seq-len 65536 --layers 8 --hidden 1024 \\
        --heads 8 --head-dim 128 --kv-heads 2 --dtype bfloat16 --steps 1000 --lr 1e-3

Before training it runs step 0 once more on one device (the same weights, no CP) and prints
the parity line; at the end it writes out/train_jax/loss.png and history.json.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from examples.common import base_parser, check_args, decoder_config, finish, parity_line, recall_task
from examples.data import IGNORE, packed_batch


def _configure_host_devices(count: int) -> None:
    """Ask XLA for host devices before jax starts: at least 8 and twice ``count``.

    Only ``count`` of them form the mesh. With exactly as many host devices as a 2-core machine has
    cores, XLA:CPU was seen to deadlock in a GDP all-gather (every device thread parked in the
    rendezvous while work queued behind them); the spare devices enlarge its thread pool.
    """
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={max(8, 2 * count)}"])


def parser():
    """The flags of this example (examples/common.py's)."""
    return base_parser(__doc__.splitlines()[0], "out/train_jax")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    on_gpu = args.device in ("cuda", "gpu")
    if not on_gpu:
        _configure_host_devices(args.cp)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm import tqdm

    from cp_linear.weights import initial_table
    from jax_api.layers import HybridDecoder, build_layout, cp_apply, load_state_table

    platform = "gpu" if on_gpu else "cpu"
    devices = jax.devices(platform)
    if len(devices) < args.cp:
        raise SystemExit(f"--cp {args.cp} needs {args.cp} {platform} devices; JAX sees {len(devices)} (on CPU, "
                         "run this script in a fresh process so that it can set XLA_FLAGS first)")
    mesh = jax.make_mesh((args.cp,), ("cp",), devices=devices[:args.cp])
    task = recall_task(args)
    config = decoder_config(args, task.vocab_size)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None
    model = HybridDecoder(config, rngs=nnx.Rngs(args.seed), attention_options={"mode": args.attention_mode},
                          compute_dtype=dtype)
    # numpy-drawn weights: the same as examples/train_torch.py starts from for the same --seed
    load_state_table(model, initial_table(config, args.seed))
    tx = optax.adamw(args.lr, weight_decay=0.0)
    if args.clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(args.clip), tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def answer_loss(logits, targets):
        valid = targets != IGNORE
        log_probs = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(log_probs, jnp.where(valid, targets, 0)[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)) / jnp.maximum(jnp.sum(valid), 1)

    def cp_loss(model, ids, targets, layout):
        return answer_loss(cp_apply(model, ids, layout, mesh=mesh), targets)

    def single_device_loss(model, ids, targets, layout):
        return answer_loss(model(ids, layout=layout), targets)

    @nnx.jit
    def train_step(model, optimizer, ids, targets, layout):
        loss, grads = nnx.value_and_grad(cp_loss)(model, ids, targets, layout)
        optimizer.update(model, grads)
        return loss

    def flat(grads):
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(grads))])

    # every document fits in this many tokens: a halo of that size serves every packing, and no shard
    # holds more sequences than documents of the shortest length fit (plus a padding run and a partial
    # document), so the step compiles once instead of once per rounded halo length or sequence count
    halo_floor = 1 << (task.max_document_len - 1).bit_length()
    sequence_floor = args.seq_len // args.cp // task.min_document_len + 2
    rng = np.random.default_rng(args.seed)
    history = {"loss": [], "cp": args.cp, "num_values": task.num_values, "seq_len": args.seq_len}
    bar = tqdm(range(args.steps), desc=f"jax CP={args.cp}", unit="step", file=sys.stdout)
    start, tokens_done = None, 0
    for step in bar:
        ids, targets, doc_ids = packed_batch(task, rng, args.seq_len)
        ids_j, targets_j = jnp.asarray(ids[None]), jnp.asarray(targets)
        layout = build_layout(total_len=args.seq_len, doc_ids=doc_ids, cp_size=args.cp,
                              attention_mode=args.attention_mode, platform=platform, min_halo_len=halo_floor,
                              min_shard_sequences=sequence_floor)
        if step == 0:
            # step 0 with and without CP, before the update: the parity line compares the two
            cp_value, cp_grads = nnx.jit(nnx.value_and_grad(cp_loss))(model, ids_j, targets_j, layout)
            single_layout = build_layout(total_len=args.seq_len, doc_ids=doc_ids)
            single_value, single_grads = nnx.jit(nnx.value_and_grad(single_device_loss))(
                model, ids_j, targets_j, single_layout)
            difference = flat(cp_grads) - flat(single_grads)
            grad_rel = float(jnp.linalg.norm(difference) / jnp.maximum(jnp.linalg.norm(flat(single_grads)), 1e-30))
            line = parity_line(float(cp_value), float(single_value), grad_rel, args.cp)
            history["parity"] = {"cp_loss": float(cp_value), "single_device_loss": float(single_value),
                                 "grad_rel": grad_rel, "line": line}
            bar.write(line)
        loss_value = float(train_step(model, optimizer, ids_j, targets_j, layout))
        if step == 0:
            start = time.perf_counter()  # step 0 includes compilation: time the rest
        else:
            tokens_done += args.seq_len
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens_done / (time.perf_counter() - start):.0f}")
        history["loss"].append(loss_value)
    bar.close()
    history["tokens_per_s"] = tokens_done / (time.perf_counter() - start) if tokens_done else 0.0
    title = (f"jax: {args.layers} layers, hidden {args.hidden}, T = {args.seq_len}, CP {args.cp}, "
             f"{platform}, {args.dtype}")
    return finish(args, history, title, config)


if __name__ == "__main__":
    sys.exit(main())
