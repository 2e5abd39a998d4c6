"""The JAX CuTeDSL backend lowered for CUDA on this CPU machine: what XLA will run on the GPU.

* every kernel launch is one ``stablehlo.custom_call`` to the kernel's target (its TVM-FFI
  function, registered through jax-tvm-ffi), and nothing else leaves XLA: no host callback;
* the packing is data: two packings lower to the same program, and kernels are compiled and
  registered once per config (a subprocess compiles the forward kernels for sm_90a for real,
  registers them as XLA FFI targets for the GPU platform and lowers the op twice).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax_tvm_ffi", reason="needs jax-tvm-ffi (the cuda extra)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_api.gdp.cutedsl as jcd  # noqa: E402

if jax.default_backend() != "cpu":  # these run the CPU path on purpose (tests/jax_api/test_cutedsl_gpu.py: the GPU)
    pytest.skip("CPU-only tests of the kernel bridge", allow_module_level=True)
from cp_linear.kernels import configs as kcfg  # noqa: E402
from jax_api.gdp import kernel_calls  # noqa: E402
from jax_api.gdp.cp import gdp_chunkwise_context_parallel  # noqa: E402
from jax_api.gdp.ops import gated_delta_product  # noqa: E402
from tests.cp_linear.gdp_cases import seq_idx_from_lengths  # noqa: E402

N_H, HEADS, DIM, TOKENS = 2, 2, 64, 256
ROOT = Path(__file__).resolve().parents[2]


def _names(*configs) -> set[str]:
    return {kernel_calls.target_name(config) for config in configs}


# a few sequences x 2 heads leave SMs idle: the folds run 16-row CTAs (launch.fold_config)
FOLD = kcfg.SegmentFoldConfig(DIM, "fold", 16)


def contained(config):
    """The traced op's chunk kernels run contained: they zero the rows the token flags mark as they load them."""
    return replace(config, contained=True)


PREP = contained(kcfg.ChunkPrepConfig("bfloat16", DIM, 32))
# no gradient taken: the lean one-device plan (no prefix maps, no apply_affine)
INFERENCE = _names(PREP, contained(kcfg.ChunkScanConfig("bfloat16", DIM, DIM, "summary")), FOLD,
                   contained(kcfg.ChunkScanConfig("bfloat16", DIM, DIM, "output", 32)))
FORWARD = INFERENCE | _names(kcfg.SegmentFoldConfig(DIM, "apply_affine"))
# the kernel backward's forward keeps the chunk states (mode "output_states"), so its backward runs no
# states scan (mode "states": only with save_chunk_states=False)
FORWARD_KEEPING_STATES = (FORWARD - _names(contained(kcfg.ChunkScanConfig("bfloat16", DIM, DIM, "output", 32)))
                          | _names(contained(kcfg.ChunkScanConfig("bfloat16", DIM, DIM, "output_states", 32))))
# the traced op's containment: the flags only, in one launch (jax_api.gdp.isolation)
CONTAINMENT = _names(kcfg.TokenChecksConfig("bfloat16", DIM, DIM, N_H, copies=False))
# the work layout of a shard of several sequences: one launch (a single sequence's is jnp slices)
LAYOUT = _names(kcfg.ForwardLayoutConfig())
BACKWARD = _names(contained(kcfg.ChunkGammaConfig("bfloat16", DIM, DIM, 32, "wgmma")),
                  contained(kcfg.ChunkReverseScanConfig("bfloat16", DIM, DIM, 32, 0, "wgmma")),
                  contained(kcfg.ChunkReverseConfig("bfloat16", DIM, DIM, 32)),
                  contained(kcfg.ChunkPrepBackwardConfig("bfloat16", DIM, 32)))


@pytest.fixture
def hopper(monkeypatch):
    """Trace as on a Hopper GPU (the backend takes the kernels); nothing registers here."""
    monkeypatch.setattr(jcd, "kernel_platform_reason", lambda: None)
    assert not kernel_calls._registers_here()


def _arrays(lengths):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, TOKENS, HEADS, DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(1, TOKENS * N_H, HEADS, DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(1, TOKENS * N_H, HEADS, DIM)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(size=(1, TOKENS, HEADS)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(1, TOKENS * N_H, HEADS)), jnp.float32)
    return q, k, v, g, beta, jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @([\w.]+)", text)


def _one_device(backward):
    backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward=backward, sm_count=132)

    def loss(q, k, v, g, beta, cu):
        o, final = gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, num_householder=N_H,
                                       use_qk_l2norm_in_kernel=True, backend=backend)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return loss


def test_the_forward_lowers_to_six_kernel_calls_and_nothing_else(hopper):
    """No gradient: the token checks, the layout, then prep, the summary scan, the one fold (every segment's
    incoming state), the output scan; one sequence: the same without the layout kernel."""
    for lengths, layout in (([100, 56, 100], LAYOUT), ([256], set())):
        text = jax.jit(_one_device("jax")).trace(*_arrays(lengths)).lower(lowering_platforms=("cuda",)).as_text()
        calls = _custom_calls(text)
        assert len(calls) == 5 + len(layout) and set(calls) == CONTAINMENT | layout | INFERENCE, calls
        assert "callback" not in text and "stablehlo.while" not in text and "stablehlo.sort" not in text


def test_the_kernel_backward_lowers_to_kernel_calls_only_and_a_new_packing_to_the_same_program(hopper):
    grad = jax.jit(jax.value_and_grad(_one_device("kernels"), argnums=(0, 1, 2, 3, 4)))
    texts = [grad.trace(*_arrays(lengths)).lower(lowering_platforms=("cuda",)).as_text()
             for lengths in ([100, 56, 100], [3, 250, 3])]
    calls = _custom_calls(texts[0])
    # the token checks; forward 6 (the layout; the output scan keeping the chunk states); backward, from the
    # forward's layout and prep results: gamma, the descending fold, the reverse scan, reverse, prep backward
    # (the fold of the leading gamma builds the CP summary, unused on one device: dropped)
    assert len(calls) == 12 and set(calls) == CONTAINMENT | LAYOUT | FORWARD_KEEPING_STATES | BACKWARD, calls
    assert calls.count(kernel_calls.target_name(PREP)) == 1, calls
    assert "callback" not in texts[0] and "stablehlo.while" not in texts[0]
    assert texts[0] == texts[1]


def test_cp_under_shard_map_lowers_to_kernel_calls_and_collectives(hopper):
    """Two devices (CPU devices here, lowered for CUDA): the same custom calls inside the shard_map,
    the summaries exchanged by all-gathers, and one program for two packings."""
    mesh = jax.make_mesh((2,), ("cp",))
    backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels", sm_count=132)

    def loss(q, k, v, g, beta, seq_idx):
        o = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx, max_sequences=4,
                                           num_householder=N_H, use_qk_l2norm_in_kernel=True, backend=backend)
        return jnp.sum(o.astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    texts = []
    for lengths in ([100, 56, 100], [3, 250, 3]):
        *arrays, _ = _arrays(lengths)
        seq_idx = jnp.asarray(seq_idx_from_lengths(lengths), jnp.int32)
        texts.append(grad.trace(*arrays, seq_idx).lower(lowering_platforms=("cuda",)).as_text())
    assert set(_custom_calls(texts[0])) - {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"} \
        == CONTAINMENT | LAYOUT | FORWARD_KEEPING_STATES | BACKWARD
    assert texts[0].count("all_gather") >= 2 and "callback" not in texts[0]
    assert texts[0] == texts[1]


def test_launch_arguments_are_checked_against_the_kernel_signature():
    config = kcfg.SegmentFoldConfig(DIM)
    from cp_linear.kernels import launch as kl

    good = dict(summaries=jnp.zeros((4, 2, 2 * DIM, DIM)), seq_first_segment=jnp.zeros((3,), jnp.int32),
                init=jnp.zeros((1, 2, DIM, DIM)), addend=jnp.zeros((1, 1, DIM, 1)))
    scalars = dict(init_count=0, value_rows=DIM, identity_row=DIM, transition_count=0, add_mode=0, write_final=0,
    descending=0)
    results = dict(incoming=(4, 2, DIM, DIM), final=(1, 2, DIM, DIM))
    with pytest.raises(ValueError, match=r"SegmentFoldLaunch.summaries must be float32 \[\?, \?, \?, 64\]"):
        kernel_calls.launch(kl.SegmentFoldLaunch, config, inputs={**good, "summaries": jnp.zeros((4, 2, 128, 32))},
                            results=results, scalars=scalars)
    with pytest.raises(ValueError, match="seq_first_segment must be int32"):
        kernel_calls.launch(kl.SegmentFoldLaunch, config, inputs={**good, "seq_first_segment": jnp.zeros((3,))},
                            results=results, scalars=scalars)
    with pytest.raises(ValueError, match="takes inputs"):
        kernel_calls.launch(kl.SegmentFoldLaunch, config, inputs=good, results=results,
                            scalars={k: v for k, v in scalars.items() if k != "descending"})


_REGISTRATION_SCRIPT = textwrap.dedent('''
    import collections, re
    import jax, jax.numpy as jnp, numpy as np
    import jax_api.gdp.cutedsl as jcd
    from cp_linear.kernels import cache
    from jax_api.gdp import kernel_calls
    from jax_api.gdp.ops import gated_delta_product

    jcd.kernel_platform_reason = lambda: None          # trace as on a Hopper GPU ...
    kernel_calls._registers_here = lambda: True        # ... and register the kernels as there
    compiles = collections.Counter()
    real_compile = cache.compile_kernel
    def counting_compile(config):
        compiles[cache.artifact_name(config)] += 1
        return real_compile(config)
    cache.compile_kernel = counting_compile

    backend = jcd.CuTeDSLGatedDeltaProductCPBackend(sm_count=132)
    texts = []
    for lengths in ([100, 56, 100], [3, 250, 3]):
        fn = jax.jit(lambda q, k, v, g, beta, cu: gated_delta_product(
            q, k, v, g, beta, cu_seqlens=cu, num_householder=2, use_qk_l2norm_in_kernel=True, backend=backend)[0])
        args = (jnp.zeros((1, 256, 2, 64), jnp.bfloat16), jnp.zeros((1, 512, 2, 64), jnp.bfloat16),
                jnp.zeros((1, 512, 2, 64), jnp.bfloat16), jnp.zeros((1, 256, 2)), jnp.zeros((1, 512, 2)),
                jnp.asarray(np.cumsum([0, *lengths]), jnp.int32))
        texts.append(fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    print("COMPILES", sorted(compiles.values()), len(compiles))
    print("REGISTERED", " ".join(kernel_calls.registered_targets("gpu")))
    print("CALLS", " ".join(sorted(set(re.findall(r"custom_call @([\\w.]+)", texts[0])))))
    print("SAME", texts[0] == texts[1])
''')


@pytest.mark.timeout(900)
def test_kernels_compile_and_register_once_per_config_for_the_gpu():
    """In a fresh process that traces as on a GPU: the six configs of a forward that takes no gradient (the
    token checks, the layout and four GDP kernels) compile for sm_90a once each (two packings, two traces), register as XLA
    FFI targets for the GPU platform, and the lowered program calls exactly those targets."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CP_LINEAR_KERNEL_LIBRARY", None)
    result = subprocess.run([sys.executable, "-c", _REGISTRATION_SCRIPT], capture_output=True, text=True,
                            timeout=850, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["COMPILES"] == "[1, 1, 1, 1, 1, 1] 6", result.stdout
    assert set(lines["REGISTERED"].split()) == CONTAINMENT | LAYOUT | INFERENCE, result.stdout
    assert set(lines["CALLS"].split()) == CONTAINMENT | LAYOUT | INFERENCE and lines["SAME"] == "True", result.stdout
