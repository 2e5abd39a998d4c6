"""JAX and torch run the same CuTeDSL kernels on a Hopper GPU: bit-for-bit the same results.

Same inputs, the same launch plan (``jax_api/gdp/cutedsl.py`` mirrors ``torch_api/gdp/cutedsl.py``),
the same compiled kernels (one TVM-FFI function per config, called by torch on its stream and by
XLA through its custom calls): outputs, final states and, with ``backward="kernels"`` in both,
every gradient must be identical bits. With the default backwards (``TorchGDPBackend`` and
``JaxGDPBackend``: two float32 recomputations) only the forward is bitwise; the gradients agree to
rounding. On two GPUs the JAX CP op (jit + shard_map + custom_vjp, all-gathers over NCCL) is
checked against torch's four functions on the same two shards, one per GPU, with the summaries
exchanged by hand (what torch's all-gather hands each rank), which is bit-exact.

Run with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (set below when this module loads first) so that
JAX leaves GPU memory to torch. Marked ``gpu``: skipped without a CUDA GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from tests.cp_linear.gdp_cases import rel_err, seq_idx_from_lengths  # noqa: E402
from tests.cutedsl_inputs import emulation_inputs  # noqa: E402

pytestmark = pytest.mark.gpu
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def _jax_gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(scope="module")
def kernels_here():
    import jax_api.gdp.cutedsl as jcd

    reason = jcd.kernel_platform_reason()
    if reason is not None:
        pytest.skip(f"JAX cannot run the kernels here: {reason}")
    sm_jax = jcd._sm_count()
    sm_torch = torch.cuda.get_device_properties(0).multi_processor_count
    # segments are sized from the SM count: both frameworks must see the same one
    assert sm_jax == sm_torch, f"JAX sees {sm_jax} SMs, torch {sm_torch}"


def _jax(t: torch.Tensor, device=None) -> jax.Array:
    x = jnp.asarray(t.detach().float().cpu().numpy(), device=device)
    return x.astype({torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}.get(t.dtype, jnp.float32))


def _bits(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return x.view(torch.int16).numpy() if x.element_size() == 2 else x.view(torch.int32).numpy()
    x = np.asarray(jax.device_get(x))
    return x.view(np.int16) if x.dtype.itemsize == 2 else x.view(np.int32)


def _assert_same_bits(name, ours, theirs):
    a, b = _bits(ours), _bits(theirs)
    assert a.shape == b.shape, (name, a.shape, b.shape)
    different = int(np.count_nonzero(a != b))
    assert different == 0, f"{name}: {different} of {a.size} elements differ between JAX and torch"


ONE_DEVICE_CASES = [
    pytest.param((17, 90, 1, 40), 1, 2, 128, 64, 2, torch.bfloat16, id="bf16-docs17,90,1,40-H2-K128-V64-nh2"),
    pytest.param((300,), 2, 2, 128, 128, 1, torch.bfloat16, id="bf16-rows2xT300-H2-K128-V128-nh1"),
    pytest.param((300, 0, 700), 1, 4, 64, 64, 3, torch.float16, id="fp16-docs300,0,700-H4-K64-V64-nh3"),
    pytest.param((8192,), 1, 2, 128, 128, 2, torch.bfloat16, id="bf16-T8192-H2-K128-V128-nh2-segments"),
]


@pytest.mark.parametrize("lengths, rows, heads, key_dim, value_dim, n_h, dtype", ONE_DEVICE_CASES)
@pytest.mark.parametrize("backward", ["kernels", "kernels-recomputed-states", "default"])
def test_one_device_op_matches_torch_bit_for_bit(kernels_here, lengths, rows, heads, key_dim, value_dim, n_h, dtype,
                                                 backward):
    import jax_api
    import jax_api.gdp.cutedsl as jcd
    import torch_api
    import torch_api.gdp.cutedsl as tcd

    packed = rows == 1 and len(lengths) > 1
    q, k, v, g, beta = emulation_inputs(lengths, heads, key_dim, value_dim, n_h, seed=len(lengths) + n_h, rows=rows,
                                       dtype=dtype)
    count = len(lengths) if packed else rows
    gen = torch.Generator().manual_seed(11)
    initial = torch.randn(count, heads, key_dim, value_dim, generator=gen) * 0.1
    do = torch.randn(rows, sum(lengths), heads, value_dim, generator=gen).to(dtype)
    dfinal = torch.randn(count, heads, key_dim, value_dim, generator=gen)
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32) if packed else None
    options = dict(num_householder=n_h, use_qk_l2norm_in_kernel=True)

    leaves = [x.cuda().requires_grad_() for x in (q, k, v, g, beta, initial)]
    # "kernels": the forward keeps the chunk states (the default); "kernels-recomputed-states": the backward
    # recomputes them (save_chunk_states=False); "default": the framework's own backward
    kernels = backward.startswith("kernels")
    saved = dict(save_chunk_states=backward == "kernels") if kernels else {}
    torch_backend = tcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels" if kernels else "torch", **saved)
    o_t, final_t = torch_api.gated_delta_product(*leaves[:5], cu_seqlens=None if cu is None else cu.cuda(),
                                                 initial_state=leaves[5], backend=torch_backend, **options)
    torch.autograd.backward([o_t, final_t], [do.cuda(), dfinal.cuda()])

    jax_backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels" if kernels else "jax", **saved)

    @jax.jit
    def run(q, k, v, g, beta, initial, cu, do, dfinal):
        def op(q, k, v, g, beta, initial):
            return jax_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, initial_state=initial,
                                               backend=jax_backend, **options)

        (o, final), vjp = jax.vjp(op, q, k, v, g, beta, initial)
        return o, final, vjp((do, dfinal))

    cu_j = None if cu is None else jnp.asarray(cu.numpy())
    o_j, final_j, grads_j = run(*(_jax(x) for x in (q, k, v, g, beta, initial)), cu_j, _jax(do), _jax(dfinal))
    _assert_same_bits("o", o_j, o_t)
    _assert_same_bits("final_state", final_j, final_t)
    for name, ours, leaf in zip(GRAD_NAMES + ("dinitial",), grads_j, leaves):
        if kernels:
            _assert_same_bits(name, ours, leaf.grad)
        else:  # two float32 recomputations: the gradients' own rounding (bf16/fp16 for q, k, v)
            limit = 1e-2 if leaf.dtype != torch.float32 else 1e-3
            theirs = leaf.grad.float().cpu().numpy()
            assert rel_err(np.asarray(ours.astype(jnp.float32)), theirs) < limit, name


def _assert_same_values(name, ours, theirs):
    """Equal values, NaN where NaN (the two frontends write NaN with their own bits; -0 == 0)."""
    a = np.asarray(jax.device_get(ours.astype(jnp.float32)))
    b = theirs.detach().float().cpu().numpy()
    assert a.shape == b.shape, (name, a.shape, b.shape)
    differ = int(np.count_nonzero(~((a == b) | (np.isnan(a) & np.isnan(b)))))
    assert differ == 0, f"{name}: {differ} of {a.size} values differ between JAX and torch"


def test_contained_op_matches_torch_contained(kernels_here):
    """Non-finite inputs under jit (JAX's flags-only token-checks launch and contained chunk kernels, which
    zero the flagged rows as they load them: ``jax_api.gdp.isolation``) against torch's ``check_inputs=False``
    (the token-checks kernel's sanitised copies): the same outputs, final states and gradients, NaN where a
    non-finite input reaches, and some of each actually NaN and finite."""
    import jax_api
    import jax_api.gdp.cutedsl as jcd
    import torch_api
    import torch_api.gdp.cutedsl as tcd

    lengths, heads, dim, n_h = [700, 300, 1000], 4, 128, 2
    q, k, v, g, beta = emulation_inputs(lengths, heads, dim, dim, n_h, seed=5)
    q[0, 10, 1, 3] = float("inf")
    k[0, 900 * n_h, 0, 7] = float("nan")
    g[0, 1500, 2] = float("nan")
    beta[0, 1800 * n_h + 1, 3] = float("-inf")
    do = torch.randn(1, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    options = dict(num_householder=n_h, use_qk_l2norm_in_kernel=True)

    leaves = [x.cuda().requires_grad_() for x in (q, k, v, g, beta)]
    o_t, final_t = torch_api.gated_delta_product(*leaves, cu_seqlens=cu.cuda(), check_inputs=False,
                                                 backend=tcd.CuTeDSLGatedDeltaProductCPBackend(), **options)
    o_t.backward(do.cuda())
    backend = jcd.CuTeDSLGatedDeltaProductCPBackend()

    @jax.jit
    def run(q, k, v, g, beta, cu, do):
        (o, final), vjp = jax.vjp(lambda *a: jax_api.gated_delta_product(*a, cu_seqlens=cu, backend=backend,
                                                                         **options), q, k, v, g, beta)
        return o, final, vjp((do, jnp.zeros_like(final)))

    o_j, final_j, grads_j = run(*(_jax(x) for x in (q, k, v, g, beta)), jnp.asarray(cu.numpy()), _jax(do))
    text = run.lower(*(_jax(x) for x in (q, k, v, g, beta)), jnp.asarray(cu.numpy()), _jax(do)).as_text()
    # the flags-only token checks, then contained chunk kernels (no sanitised copies)
    assert "cp_linear_TokenChecksConfig" in text and "copies_False" in text and "contained_True" in text
    nan = np.isnan(np.asarray(o_j.astype(jnp.float32)))
    assert nan[0, 10, 1].all() and nan[0, 900:1000, 0].all() and nan[0, 1500:, 2].all() and not nan[0, :10].any()
    _assert_same_values("o", o_j, o_t)
    _assert_same_values("final_state", final_j, final_t)
    for name, ours, leaf in zip(GRAD_NAMES, grads_j, leaves):
        _assert_same_values(name, ours, leaf.grad)


def test_new_packings_reuse_the_program_and_the_kernels(kernels_here):
    """A jitted op sees a new packing as data: no retrace, no new kernel, no host callback."""
    import jax_api
    import jax_api.gdp.cutedsl as jcd
    from cp_linear.kernels import cache

    n_h, heads, dim = 2, 4, 128
    q, k, v, g, beta = (_jax(x) for x in emulation_inputs([4096], heads, dim, dim, n_h, seed=3))
    backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    traces = []

    @jax.jit
    def step(q, k, v, g, beta, cu):
        traces.append(1)

        def loss(q, k, v, g, beta):
            o, _ = jax_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, num_householder=n_h,
                                               use_qk_l2norm_in_kernel=True, backend=backend)
            return jnp.sum(o.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    compiled = []
    for lengths in ([1000, 96, 3000], [4000, 32, 64], [1, 1, 4094]):
        cu = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
        jax.block_until_ready(step(q, k, v, g, beta, cu))
        compiled.append(len(cache._COMPILED))
    assert len(traces) == 1 and step._cache_size() == 1
    assert compiled[0] == compiled[1] == compiled[2]
    text = step.lower(q, k, v, g, beta, cu).as_text()
    assert "callback" not in text and "cp_linear_ChunkReverseConfig" in text


SHORT_CONV_CASES = [
    # a piece boundary inside a document (P = 2 reads the second halo), length-1 documents, runs of the
    # backward's 128 tokens cut short at piece ends
    pytest.param(torch.bfloat16, 4, 1, True, (5, 1000, 1, 1042), id="bf16-W4-P1-bias"),
    pytest.param(torch.bfloat16, 4, 2, False, (5, 1000, 1, 1042), id="bf16-W4-P2"),
    pytest.param(torch.float16, 3, 2, True, (1, 1023, 1, 1023), id="fp16-W3-P2-bias-boundary-at-start"),
    pytest.param(torch.bfloat16, 2, 1, False, (2000,), id="bf16-W2-P1"),
]


@pytest.mark.parametrize("dtype, width, pieces, with_bias, lengths", SHORT_CONV_CASES)
def test_short_conv_matches_torch_bit_for_bit(kernels_here, dtype, width, pieces, with_bias, lengths):
    """``kernel_short_conv`` of both frontends runs the same kernels on the same inputs: y and every
    gradient (x, halo, weight, bias) are the same bits."""
    from jax_api.layers.conv import kernel_short_conv
    from torch_api.layers.conv import kernel_short_conv as torch_kernel_short_conv

    gen = torch.Generator().manual_seed(10 * width + pieces)
    batch, length, channels = 2, sum(lengths), 96
    x = torch.randn(batch, length, channels, generator=gen).to(dtype)
    halo = torch.randn(batch, pieces, width - 1, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 1, width, generator=gen) / width ** 0.5
    bias = torch.randn(channels, generator=gen) if with_bias else None
    dy = torch.randn(batch, length, channels, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(torch.int32)

    leaves = [t.cuda().requires_grad_() for t in (x, halo, weight, bias) if t is not None]
    y_t = torch_kernel_short_conv(*leaves[:3], leaves[3] if with_bias else None, positions.cuda())
    y_t.backward(dy.cuda())

    @jax.jit
    def run(x, halo, weight, bias, positions, dy):
        y, vjp = jax.vjp(lambda x, halo, weight, bias: kernel_short_conv(x, halo, weight, bias, positions),
                         x, halo, weight, bias)
        return y, vjp(dy)

    y_j, grads_j = run(_jax(x), _jax(halo), _jax(weight), None if bias is None else _jax(bias),
                       jnp.asarray(positions.numpy()), _jax(dy))
    _assert_same_bits("y", y_j, y_t)
    for name, ours, leaf in zip(("dx", "dhalo", "dweight", "dbias"), grads_j, leaves):
        _assert_same_bits(name, ours, leaf.grad)
    if not with_bias:
        assert grads_j[3] is None



GATED_NORM_CASES = [
    # x, gate [2, tokens, 2, D]: 4 · tokens rows, the last CTA of GATED_NORM_ROWS rows partial
    pytest.param(torch.bfloat16, 7, 64, id="bf16-D64-rows28"),
    pytest.param(torch.bfloat16, 1000, 128, id="bf16-D128-rows4000"),
    pytest.param(torch.float16, 333, 64, id="fp16-D64-rows1332"),
    pytest.param(torch.bfloat16, 10001, 128, id="bf16-D128-rows40004"),
]


@pytest.mark.parametrize("dtype, tokens, dim", GATED_NORM_CASES)
def test_gated_norm_matches_torch_bit_for_bit(kernels_here, dtype, tokens, dim):
    """``GatedRMSNorm`` of both frontends takes its kernel path on the same inputs: out and every gradient
    (x, gate, weight) are the same bits."""
    from flax import nnx

    import jax_api.layers.blocks as jax_blocks
    import torch_api.layers.blocks as torch_blocks

    gen = torch.Generator().manual_seed(tokens + dim)
    x, gate, dout = (torch.randn(2, tokens, 2, dim, generator=gen).to(dtype) for _ in range(3))
    weight = 1 + torch.randn(dim, generator=gen) / 4

    torch_norm = torch_blocks.GatedRMSNorm(dim, eps=1e-5).cuda()
    torch_norm.weight.data.copy_(weight)
    x_t, gate_t = x.cuda().requires_grad_(), gate.cuda().requires_grad_()
    assert torch_blocks.gated_norm_kernel_reason(x_t, gate_t) is None
    out_t = torch_norm(x_t, gate_t)
    out_t.backward(dout.cuda())

    jax_norm = jax_blocks.GatedRMSNorm(dim, eps=1e-5)
    jax_norm.weight[...] = _jax(weight)
    graphdef, state = nnx.split(jax_norm)
    x_j, gate_j = _jax(x), _jax(gate)
    assert jax_blocks.gated_norm_kernel_reason(x_j, gate_j) is None

    @jax.jit
    def run(state, x, gate, dout):
        out, vjp = jax.vjp(lambda state, x, gate: nnx.merge(graphdef, state)(x, gate), state, x, gate)
        return out, vjp(dout)

    out_j, (dstate, dx_j, dgate_j) = run(state, x_j, gate_j, _jax(dout))
    _assert_same_bits("out", out_j, out_t)
    _assert_same_bits("dx", dx_j, x_t.grad)
    _assert_same_bits("dgate", dgate_j, gate_t.grad)
    _assert_same_bits("dweight", dstate["weight"][...], torch_norm.weight.grad)

def test_cp_over_two_gpus_matches_torch_bit_for_bit(kernels_here):
    if len(_jax_gpus()) < 2 or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import jax_api
    import jax_api.gdp.cutedsl as jcd
    import torch_api.gdp.cutedsl as tcd
    from torch_api.gdp.types import GDPInputs

    n_h, heads, dim = 2, 4, 128
    lengths = [1000, 5000, 2192]  # shards of 4096: [1000, 3096] | [1904, 2192]; the middle one spans both
    q, k, v, g, beta = emulation_inputs(lengths, heads, dim, dim, n_h, seed=21)
    do = torch.randn(1, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(22)).bfloat16()
    half = sum(lengths) // 2
    cu_local = [[0, 1000, half], [0, 6000 - half, half]]

    # torch: each shard on its own GPU, the all-gathers by hand (stacking is what every rank receives)
    backend = tcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    shards, dos = [], []
    for rank in range(2):
        device = torch.device("cuda", rank)
        tok, step = slice(rank * half, (rank + 1) * half), slice(rank * half * n_h, (rank + 1) * half * n_h)
        with torch.cuda.device(device):
            shards.append(GDPInputs(*(x.to(device) for x in (q[:, tok], k[:, step], v[:, step], g[:, tok],
                                                             beta[:, step])), scale=dim ** -0.5, num_householder=n_h,
                                    use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=torch.tensor(cu_local[rank], dtype=torch.int32, device=device)))
        dos.append(do[:, tok].to(device))
    prepared = []
    for rank in range(2):
        with torch.cuda.device(rank):
            prepared.append(backend.cp_forward_prepare(shards[rank]))
    gathered = [torch.stack([s.packed.to(f"cuda:{rank}") for s, _ in prepared]) for rank in range(2)]
    applied = []
    for rank in range(2):
        with torch.cuda.device(rank):
            applied.append(backend.cp_forward_apply(prepared[rank][1], gathered[rank][0:rank]))
    backward = []
    for rank in range(2):
        with torch.cuda.device(rank):
            backward.append(backend.cp_backward_prepare(dos[rank], applied[rank].saved_context))
    gathered = [torch.stack([s.packed.to(f"cuda:{rank}") for s, _ in backward]) for rank in range(2)]
    grads_t = []
    for rank in range(2):
        with torch.cuda.device(rank):
            grads_t.append(backend.cp_backward_apply(backward[rank][1], gathered[rank][rank + 1:2]))
    o_t = torch.cat([applied[r].output.cpu() for r in range(2)], dim=1)

    mesh = jax.sharding.Mesh(np.array(_jax_gpus()[:2]), ("cp",))
    jax_backend = jcd.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    seq_idx = jnp.asarray(seq_idx_from_lengths(lengths), jnp.int32)

    def loss(q, k, v, g, beta, do):
        o = jax_api.gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx,
                                                   max_sequences=2, num_householder=n_h,
                                                   use_qk_l2norm_in_kernel=True, backend=jax_backend)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

    (_, o_j), grads_j = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *(_jax(x) for x in (q, k, v, g, beta, do)))
    _assert_same_bits("o", o_j, o_t)
    for name, ours in zip(GRAD_NAMES, grads_j):
        theirs = torch.cat([getattr(grads_t[r], name).cpu() for r in range(2)], dim=1)
        _assert_same_bits(name, ours, theirs)
