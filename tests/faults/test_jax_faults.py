"""The fault suite's JAX cases (issue 16): host devices on CPU (tests/conftest.py asks XLA for 8),
or the first 2-3 GPUs when JAX runs on GPUs (benchmarks/gpu_fault_suite.py).

JAX runs one program over the mesh, so ranks cannot disagree on shapes, flags or ids (classes 1-4
have no JAX analogue); these cases cover non-finite values (5), the domain (6, eagerly and under
``jax.jit`` for the static limits) and edited exchange plans (7).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.faults.cases import N_H, docs, expected_gdp_poison, gdp_full_inputs

pytestmark = pytest.mark.multirank


def mesh_of(size: int):
    devices = jax.devices()
    if len(devices) < size:
        if jax.default_backend() != "cpu":  # e.g. the 2-GPU run of benchmarks/gpu_fault_suite.py
            pytest.skip(f"needs {size} {jax.default_backend()} devices; this machine has {len(devices)}")
        pytest.fail(f"needs {size} JAX devices; found {len(devices)} (set XLA_FLAGS before importing jax)")
    return jax.sharding.Mesh(np.array(devices[:size]), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))


def numpy_inputs(total: int):
    return [x.numpy() for x in gdp_full_inputs(total)]


def seq_ids(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)[None]


@functools.lru_cache
def _jitted_one_device_gdp(lengths: tuple):
    from jax_api.gdp.ops import gated_delta_product

    cu = np.cumsum((0,) + lengths)
    return jax.jit(lambda *a: gated_delta_product(*a, num_householder=N_H, cu_seqlens=cu))


def one_device_gdp(arrays, lengths):
    """The one-device op under jit, compiled once per packing (its eager form dispatches op by op)."""
    return _jitted_one_device_gdp(tuple(lengths))(*arrays)


# --------------------------------------------------------------------------- class 5


@pytest.mark.parametrize("world", [2, 3])
def test_class5_jax_gdp_cp_rejects_nonfinite_inputs_eagerly(world):
    from jax_api.gdp.cp import gdp_chunkwise_context_parallel

    total = 8 * world
    q, k, v, g, beta = numpy_inputs(total)
    beta = beta.copy()
    beta[0, total * N_H - 1, 1] = np.inf
    with pytest.raises(ValueError, match=r"non-finite values \(NaN or Inf\) in beta"):
        gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh_of(world), num_householder=N_H,
                                       global_seq_idx=seq_ids([5, total - 5]))


@pytest.mark.parametrize("world, jit", [(2, False), (3, True)], ids=["w2-eager-unchecked", "w3-jit"])
def test_class5_jax_gdp_cp_keeps_a_nan_in_its_sequence_across_ranks(world, jit):
    """NaN in v at token 6 of a sequence spanning ranks 0-1: only that sequence's outputs from token 6
    on (on both ranks) are NaN; everything else equals the one-device op on clean inputs."""
    from jax_api.gdp.cp import gdp_chunkwise_context_parallel

    total = 8 * world
    lengths = [3, 9, total - 12]
    clean = numpy_inputs(total)
    dirty = [x.copy() for x in clean]
    dirty[2][0, 6 * N_H + 1, 1, 2] = np.nan
    options = dict(mesh=mesh_of(world), num_householder=N_H, global_seq_idx=seq_ids(lengths))
    if jit:
        out = jax.jit(lambda *a: gdp_chunkwise_context_parallel(*a, **options))(*dirty)
    else:
        out = gdp_chunkwise_context_parallel(*dirty, check_inputs=False, **options)
    reference, _ = one_device_gdp(clean, lengths)
    out, reference = np.asarray(out)[0], np.asarray(reference)[0]
    bad = ~np.isfinite(out).all(-1)  # [T, H]
    assert np.array_equal(bad[:, 1], expected_gdp_poison(lengths, [6], total)) and not bad[:, 0].any()
    np.testing.assert_allclose(out[~bad], reference[~bad], rtol=0, atol=1e-4)


def test_class5_jax_gdp_cp_gradients_of_untouched_sequences_match_the_clean_run():
    from jax_api.gdp.cp import gdp_chunkwise_context_parallel

    total, lengths = 16, [3, 9, 4]
    clean = numpy_inputs(total)
    dirty = [x.copy() for x in clean]
    dirty[3][0, 7, 0] = -np.inf  # g of token 7 (sequence 1), head 0
    options = dict(mesh=mesh_of(2), num_householder=N_H, global_seq_idx=seq_ids(lengths))

    def loss(*arrays):
        out = gdp_chunkwise_context_parallel(*arrays, **options)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) ** 2 * keep)

    keep = np.ones((1, total, 2, 1), np.float32)
    keep[0, 7:12, 0] = 0.0  # the outputs the -inf poisons; the clean run drops them too
    dirty_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*dirty)
    clean_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*clean)
    for name, mine, theirs, per in zip("qkvgb", dirty_grads, clean_grads, (1, N_H, N_H, 1, N_H)):
        rows = np.r_[0:3 * per, 12 * per:16 * per]  # sequences 0 and 2
        np.testing.assert_allclose(np.asarray(mine)[0, rows], np.asarray(theirs)[0, rows], rtol=1e-4, atol=1e-5,
                                   err_msg=f"d{name}")
        assert np.isfinite(np.asarray(mine)).all(), f"d{name} holds non-finite values"


def test_class5_jax_one_device_gdp_reports_or_contains():
    from jax_api.gdp.ops import gated_delta_product

    lengths = [10, 30, 24]
    cu = np.cumsum([0] + lengths)
    clean = numpy_inputs(64)
    dirty = [x.copy() for x in clean]
    dirty[0][0, 25, 0, 3] = np.nan  # q of token 25: only output 25 reads it
    dirty[1][0, 41 * N_H, 1, 0] = np.inf  # k of token 41 (sequence 2 = tokens 40..63), head 1
    with pytest.raises(ValueError, match=r"gated_delta_product: non-finite values \(NaN or Inf\) in q, k"):
        gated_delta_product(*dirty, num_householder=N_H, cu_seqlens=cu)  # checked before any compute
    out, final = one_device_gdp(dirty, lengths)  # traced: contained, not checked
    reference, reference_final = one_device_gdp(clean, lengths)
    bad = ~np.isfinite(np.asarray(out)[0]).all(-1)
    expected = np.zeros((64, 2), bool)
    expected[25, 0] = True
    expected[41:, 1] = True
    assert np.array_equal(bad, expected)
    np.testing.assert_array_equal(np.asarray(out)[0][~bad], np.asarray(reference)[0][~bad])
    assert np.isnan(np.asarray(final)[2, 1]).all() and np.isfinite(np.asarray(final)[[0, 1]]).all()


@pytest.mark.parametrize("world, mode", [(2, "allgather"), (2, "a2a"), (3, "halo"), (3, "a2a")])
def test_class5_jax_attention_nan_in_a_padding_token_spoils_nothing(world, mode):
    """The issue's JAX case: a NaN in a padding token's v spoiled tokens on other ranks."""
    from jax_api.attention.blockdiag import blockdiag_attention
    from jax_api.attention.naive import naive_blockdiag_attention

    total = 8 * world
    ids = np.array(docs((1, 5), (0, 2), (2, 6), (3, total - 13)))  # padding 5, 6; document 2 = 7..12
    rng = np.random.default_rng(world)
    q, k, v = (rng.standard_normal((1, total, heads, 8)).astype(np.float32) for heads in (4, 2, 2))
    reference = np.asarray(naive_blockdiag_attention(q, k, v, ids))
    v_bad, k_bad = v.copy(), k.copy()
    v_bad[0, 6, 0, 0] = np.nan  # padding
    k_bad[0, 10, 1, 2] = np.inf  # document 2, kv head 1 -> q heads 2, 3
    with pytest.raises(ValueError, match=r"blockdiag_attention: non-finite values \(NaN or Inf\) in k, v"):
        blockdiag_attention(q, k_bad, v_bad, ids, mesh=mesh_of(world), mode=mode)
    out = np.asarray(blockdiag_attention(q, k_bad, v_bad, ids, mesh=mesh_of(world), mode=mode, check_inputs=False))
    bad = ~np.isfinite(out[0]).all(-1)
    expected = np.zeros((total, 4), bool)
    expected[10:13, 2:] = True
    assert np.array_equal(bad, expected)
    np.testing.assert_allclose(out[0][~bad], reference[0][~bad], rtol=0, atol=1e-5)
    assert (out[0, 5:7] == 0).all()


# --------------------------------------------------------------------------- class 6


@pytest.mark.parametrize("fault, message", [
    ("g_positive", r"g > 0"),
    ("beta_above_2", r"beta outside \[0, 2\]"),
    ("key_dim_300", r"K = 300 exceeds the supported maximum K = 256"),
    ("value_dim_600", r"V = 600 exceeds the supported maximum V = 512"),
    ("empty", r"empty inputs are not supported"),
])
@pytest.mark.parametrize("op", ["one-device", "cp"])
def test_class6_jax_gdp_rejects_out_of_domain_inputs(op, fault, message):
    from jax_api.gdp.cp import gdp_chunkwise_context_parallel
    from jax_api.gdp.ops import gated_delta_product

    q, k, v, g, beta = numpy_inputs(16)
    if fault == "g_positive":
        g = g.copy()
        g[0, 3, 1] = 20.0
    elif fault == "beta_above_2":
        beta = beta + 2.0
    elif fault == "key_dim_300":
        q, k = np.zeros((*q.shape[:3], 300), np.float32), np.zeros((*k.shape[:3], 300), np.float32)
    elif fault == "value_dim_600":
        v = np.zeros((*v.shape[:3], 600), np.float32)
    elif fault == "empty":
        q, k, v, g, beta = (x[:, :0] for x in (q, k, v, g, beta))
    with pytest.raises(ValueError, match=message):
        if op == "cp":
            gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh_of(2), num_householder=N_H)
        else:
            gated_delta_product(q, k, v, g, beta, num_householder=N_H)


@pytest.mark.parametrize("fault", ["key_dim_300", "empty"])
def test_class6_jax_static_limits_hold_under_jit(fault):
    from jax_api.gdp.cp import gdp_chunkwise_context_parallel
    from jax_api.gdp.ops import gated_delta_product

    q, k, v, g, beta = numpy_inputs(16)
    if fault == "key_dim_300":
        q, k = np.zeros((*q.shape[:3], 300), np.float32), np.zeros((*k.shape[:3], 300), np.float32)
    else:
        q, k, v, g, beta = (x[:, :0] for x in (q, k, v, g, beta))
    with pytest.raises(ValueError, match=r"K = 300|empty inputs"):
        jax.jit(lambda *a: gated_delta_product(*a, num_householder=N_H))(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"K = 300|empty inputs"):
        jax.jit(lambda *a: gdp_chunkwise_context_parallel(*a, mesh=mesh_of(2), num_householder=N_H))(q, k, v, g, beta)


# --------------------------------------------------------------------------- class 7


@pytest.mark.parametrize("edit", ["halo-too-short", "mode-without-routing", "ragged-table"])
def test_class7_jax_edited_exchange_plan_raises(edit):
    from jax_api.attention.blockdiag import blockdiag_attention, plan_blockdiag_exchange

    ids = np.array(docs((1, 3), (2, 10), (3, 11)))  # document 2 reaches 5 tokens back into rank 1 (L = 8)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 24, heads, 8)).astype(np.float32) for heads in (2, 1, 1))
    if edit == "halo-too-short":
        plan = plan_blockdiag_exchange(ids, 3, mode="halo")
        plan = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, halo_len=2))
    elif edit == "mode-without-routing":
        plan = plan_blockdiag_exchange(ids, 3, mode="allgather")
        plan = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, mode="halo"))
    else:
        plan = plan_blockdiag_exchange(ids, 3, mode="a2a", a2a_impl="ragged", bucket_sizes=False)
        tables = list(plan.routing)
        tables[2] = np.zeros_like(tables[2])  # send nothing
        plan = dataclasses.replace(plan, routing=tuple(tables))
    with pytest.raises(ValueError, match="the BlockDiagExchangePlan does not fit its doc_ids"):
        blockdiag_attention(q, k, v, plan, mesh=mesh_of(3))


def test_class7_jax_a_plan_padded_to_a_longer_halo_is_still_accepted():
    from jax_api.attention.blockdiag import blockdiag_attention, plan_blockdiag_exchange
    from jax_api.attention.naive import naive_blockdiag_attention

    ids = np.array(docs((1, 3), (2, 10), (3, 11)))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 24, heads, 8)).astype(np.float32) for heads in (2, 1, 1))
    plan = plan_blockdiag_exchange(ids, 3, mode="halo")
    plan = dataclasses.replace(plan, shape=dataclasses.replace(plan.shape, halo_len=8))  # as jax_api.layers does
    out = blockdiag_attention(q, k, v, plan, mesh=mesh_of(3))
    np.testing.assert_allclose(np.asarray(out), np.asarray(naive_blockdiag_attention(q, k, v, ids)), atol=1e-5)
