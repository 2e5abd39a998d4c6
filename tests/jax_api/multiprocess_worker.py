"""One process of the multi-process JAX check (tests/jax_api/test_multiprocess.py).

Runs the CP ops on a 4-device global mesh the way a multi-node user does: every process builds the
same global inputs on its host, contributes its own devices' shards with
``jax.make_array_from_process_local_data``, calls the global entry points, and gathers the results
to every host (``multihost_utils.process_allgather``). Process 0 writes them as .npy files.

    python -m tests.jax_api.multiprocess_worker --out DIR --process-id I --num-processes P \
        --coordinator 127.0.0.1:PORT --local-devices D

With ``--num-processes 1`` it runs alone on D devices (the single-process reference); otherwise it
joins ``jax.distributed`` first. The device count must be set before JAX starts, so this is a
script run in a fresh interpreter, never imported by the test process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# T = 32 over cp = 4 (L = 8): sequence 1 spans ranks 0-3, document 2 spans three ranks (a2a
# attention), one-token sequences, padding inside the attention ids.
SEQUENCE_LENGTHS = (3, 22, 1, 6)
ATTENTION_RUNS = ((1, 3), (2, 19), (0, 2), (3, 1), (4, 5), (0, 2))  # (doc id, tokens); 0 = padding
TOKENS, HEADS, KEY_DIM, VALUE_DIM, NUM_HOUSEHOLDER = 32, 2, 8, 6, 2
ATTENTION_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--local-devices", type=int, required=True)
    return parser.parse_args(argv)


def start_jax(args):
    """Import JAX with ``--local-devices`` CPU devices, joined to the other processes when there are any."""
    # the parent's other XLA flags (tests/conftest.py: fast compilation) stay; the device count is ours
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in flag]
    os.environ["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={args.local_devices}", *kept])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.num_processes > 1:
        # CPU collectives across processes run over gloo (JAX's default for CPU; set explicitly so that
        # a changed default fails loudly here rather than as a hang)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                                   initialization_timeout=60)
    return jax


def global_inputs():
    """The same numpy inputs on every process (a fixed seed)."""
    import numpy as np

    from tests.cp_linear.gdp_cases import random_gdp_inputs, seq_idx_from_lengths

    rng = np.random.default_rng(1234)
    gdp = random_gdp_inputs(rng, tokens=TOKENS, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM,
                            num_householder=NUM_HOUSEHOLDER)
    gdp_output_grad = rng.normal(size=(1, TOKENS, HEADS, VALUE_DIM))
    seq_idx = seq_idx_from_lengths(SEQUENCE_LENGTHS).astype(np.int32)
    attention = (rng.normal(size=(1, TOKENS, ATTENTION_HEADS, HEAD_DIM)),
                 rng.normal(size=(1, TOKENS, KV_HEADS, HEAD_DIM)),
                 rng.normal(size=(1, TOKENS, KV_HEADS, HEAD_DIM)))
    attention_output_grad = rng.normal(size=(1, TOKENS, ATTENTION_HEADS, HEAD_DIM))
    doc_ids = np.concatenate([np.full(n, d, np.int32) for d, n in ATTENTION_RUNS])
    f32 = lambda xs: [x.astype(np.float32) for x in xs]  # noqa: E731
    return f32(gdp), gdp_output_grad.astype(np.float32), seq_idx, f32(attention), \
        attention_output_grad.astype(np.float32), doc_ids


def run_ops(mesh) -> dict:
    """The CP ops on ``mesh`` (1-D, axis "cp", spanning every process): GDP forward and its five
    gradients under ``jax.jit``; block-diagonal attention forward eagerly from doc ids (so the host
    checks of concrete ids and values run on global arrays) and its gradients under ``jax.jit`` from
    a plan. Returns numpy arrays gathered to this host, the same on every process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_api import blockdiag_attention, gdp_chunkwise_context_parallel
    from jax_api.attention.blockdiag import plan_blockdiag_exchange
    from jax_api.gdp.chunk import JaxGDPBackend

    cp_size = mesh.shape["cp"]
    split = NamedSharding(mesh, P(None, "cp"))

    def global_array(x):
        """A global array split along T whose shards this process supplies from its own host copy
        (``make_array_from_process_local_data``: the multi-node way; one process supplies all)."""
        columns = sorted({(index[1].start or 0, index[1].stop or x.shape[1])
                          for index in split.addressable_devices_indices_map(x.shape).values()})
        local = x[:, columns[0][0]:columns[-1][1]]  # this process's devices hold one contiguous range
        return jax.make_array_from_process_local_data(split, local, x.shape)

    gdp_inputs, gdp_output_grad, seq_idx, attention_inputs, attention_output_grad, doc_ids = global_inputs()
    q, k, v, g, beta = (global_array(x) for x in gdp_inputs)
    gdp_do = global_array(gdp_output_grad)
    # the reference backend with 8-step chunks, which compiles faster on the CPU than 64-step ones
    options = dict(mesh=mesh, global_seq_idx=seq_idx, num_householder=NUM_HOUSEHOLDER, use_qk_l2norm_in_kernel=True,
                   backend=JaxGDPBackend(chunk_size=8))

    def gdp_loss(q, k, v, g, beta, do):
        output = gdp_chunkwise_context_parallel(q, k, v, g, beta, **options)
        return jnp.sum(output * do), output

    (_, gdp_output), gdp_grads = jax.jit(jax.value_and_grad(gdp_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        q, k, v, g, beta, gdp_do)

    aq, ak, av = (global_array(x) for x in attention_inputs)
    attention_do = global_array(attention_output_grad)
    attention_output = blockdiag_attention(aq, ak, av, doc_ids, mesh=mesh)
    plan = plan_blockdiag_exchange(doc_ids, cp_size)  # host ints, identical on every process

    def attention_loss(q, k, v, plan, do):
        return jnp.sum(blockdiag_attention(q, k, v, plan, mesh=mesh) * do)

    attention_grads = jax.jit(jax.grad(attention_loss, argnums=(0, 1, 2)))(aq, ak, av, plan, attention_do)

    results = {"gdp_output": gdp_output, "attention_output": attention_output,
               **{f"gdp_{name}": x for name, x in zip(("dq", "dk", "dv", "dg", "dbeta"), gdp_grads)},
               **{f"attention_{name}": x for name, x in zip(("dq", "dk", "dv"), attention_grads)}}
    return {name: np.asarray(multihost_utils.process_allgather(x, tiled=True)) for name, x in results.items()}


def main(argv=None):
    args = parse_args(argv)
    jax = start_jax(args)
    import numpy as np

    cp_size = args.num_processes * args.local_devices
    if jax.device_count() != cp_size or jax.local_device_count() != args.local_devices:
        raise RuntimeError(f"expected {cp_size} devices, {args.local_devices} local; got {jax.devices()}")
    # Auto axes: outside a mesh context the ops run an Explicit mesh as its Auto twin (jax_api/_mesh.py),
    # and the cotangents must live on the mesh of the outputs
    mesh = jax.make_mesh((cp_size,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    results = run_ops(mesh)
    if jax.process_index() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, array in results.items():
            np.save(args.out / f"{name}.npy", array)
        (args.out / "done").write_text(f"{jax.process_count()} processes, {jax.device_count()} devices\n")
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
