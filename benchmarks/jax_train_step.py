"""bench_train.py's JAX row ("jax-1gpu"): one training step of ``jax_api.layers.HybridDecoder`` on one device.

The caller hands over what its torch row ran on: the config, the torch model's initial weights (a
``state_table``, copied as they are: both frameworks share the parameter table), the packed documents'
ids and the token row. The step is ``jax.jit(jax.value_and_grad(loss))`` over the parameters, compiled
ahead of time, and it updates nothing, as the torch step (forward, then backward into ``.grad``; no
optimizer). Timed as the torch step: ``warmup`` calls, then the median of ``repeat`` calls, each
ended by ``block_until_ready`` on the loss and every gradient. Loss: mean cross-entropy of the float32
logits against the input tokens themselves, as torch's ``F.cross_entropy(logits.float(), tokens)``.

Precision (``bf16=True``, where torch runs under bf16 autocast): the model's ``compute_dtype=bfloat16``,
as examples/train_jax.py ``--dtype bfloat16`` and torch's rows with ``--residual bf16`` (their
``compute_dtype``); the JAX model has no autocast and no param-dtype option. ``PRECISION_DIFFERENCES``
lists what still differs from torch's rows.

Kernels: the layers pick the CuTeDSL kernels (GDP, short conv, gated norm) and cuDNN's attention by
themselves on a Hopper GPU with bf16 activations. ``kernel_use`` reads which ones the compiled step calls
from its lowered program (their XLA custom calls), so the row records what ran rather than what should have.
"""

from __future__ import annotations

import os
import re
import time

# JAX would otherwise take 75% of the GPU at start, next to torch's rows in this process
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

# what differs from torch's rows with their default --residual bf16 (HybridDecoder(compute_dtype=bf16)); the
# residual stream itself no longer does (bench_train.py adds it to the note for --residual float32)
PRECISION_DIFFERENCES = (
    "attention on cuDNN's fused flash attention in bf16 within each document where the step calls it (see the "
    "kernels line; elsewhere float32 over every key with a document mask), torch: flex_attention in bf16, "
    "masked blocks skipped; without the fused kernels XLA may fuse bf16 elementwise chains without rounding "
    "between ops (torch rounds after each); as torch: bf16 residual stream, float32 weights cast to bf16 at "
    "each matmul, float32 accumulation, norms, gates, softmax and loss, float32 gradients")

# cp_linear custom-call targets by kernel family: "cp_linear_" + the kernel config's class name + ...
KERNEL_FAMILIES = {
    "GDP": ("ChunkPrep", "ChunkScan", "SegmentFold", "ChunkGamma", "ChunkReverse", "ValueChecks"),
    "short conv": ("ShortConv",),
    "gated norm": ("GatedRMSNorm",),
}
CUDNN_ATTENTION = "cuDNN attention"  # the attention layers' fused calls (jax_api.attention.cudnn), not CuTeDSL


def backend() -> str:
    """JAX's default backend: "gpu" on a CUDA machine, "cpu" without one (or under JAX_PLATFORMS=cpu)."""
    return jax.default_backend()


def kernel_use(lowered_text: str) -> dict[str, int]:
    """Custom calls of each kernel family in a lowered program's text (0: that family ran on jnp ops)."""
    targets = re.findall(r"custom_call\s*@cp_linear_([A-Za-z]+)Config", lowered_text)
    counts = {family: sum(target.startswith(prefixes) for target in targets)
              for family, prefixes in KERNEL_FAMILIES.items()}
    counts[CUDNN_ATTENTION] = len(re.findall(r'custom_call\s*@"?__cudnn\$fmha', lowered_text))
    return counts


def kernel_summary(counts: dict[str, int]) -> str:
    """One line: each family's custom calls in the step, or why there are none."""
    from jax_api.gdp.cutedsl import kernel_platform_reason

    platform = kernel_platform_reason()
    if platform is not None and not any(counts.values()):
        return f"none ({platform})"
    # on a Hopper GPU a family without calls means its layer's rule (dtype, sizes) refused the inputs
    return ", ".join(f"{family} {f'yes ({count} calls)' if count else 'no (jnp ops)'}"
                     for family, count in counts.items())


def measure_jax(config, torch_state: dict, doc_ids: np.ndarray, tokens: np.ndarray, *, bf16: bool, on_cpu: bool,
                warmup: int, repeat: int) -> dict:
    """Time the step on JAX's first device (``on_cpu``: its first CPU device, as torch's dry run, also on
    a GPU machine). tokens int [1, T], doc_ids int [T] (1-based documents).

    Returns seconds (median), loss (the last step's: every step's, as nothing is updated), peak_bytes
    (None where the device reports no memory stats), compile_s, kernels (``kernel_use``) and device."""
    device = jax.devices("cpu")[0] if on_cpu else jax.devices()[0]
    with jax.default_device(device):  # the model, the layout and so the step live there
        result = _measure(config, torch_state, doc_ids, tokens, bf16=bf16, warmup=warmup, repeat=repeat)
    # XLA keeps no resettable peak: this is the process's, which the step's own peak dominates
    stats = device.memory_stats()
    return dict(result, peak_bytes=None if stats is None else stats.get("peak_bytes_in_use"), device=device.platform)


def _measure(config, torch_state, doc_ids, tokens, *, bf16: bool, warmup: int, repeat: int) -> dict:
    from jax_api.layers import HybridDecoder, build_layout, load_state_table

    compute_dtype = jnp.bfloat16 if bf16 else None
    model = HybridDecoder(config, rngs=nnx.Rngs(0), compute_dtype=compute_dtype)
    load_state_table(model, torch_state)  # the torch row's initial weights: the same first loss
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    layout = build_layout(total_len=tokens.shape[1], doc_ids=doc_ids)
    token_array = jnp.asarray(tokens, jnp.int32)

    def loss_fn(params, tokens, layout):
        logits = nnx.merge(graphdef, params, rest)(tokens, layout=layout)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[..., None], axis=-1))

    start = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss_fn)).lower(params, token_array, layout)
    step = lowered.compile()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        jax.block_until_ready(step(params, token_array, layout))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        loss, grads = jax.block_until_ready(step(params, token_array, layout))
        times.append(time.perf_counter() - start)
    return dict(seconds=sorted(times)[len(times) // 2], loss=float(loss), compile_s=compile_s,
                kernels=kernel_use(lowered.as_text()))
