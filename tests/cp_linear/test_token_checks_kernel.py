"""The token-checks kernel (``cp_linear.kernels.token_checks``): the containment's per-token flags and the
sanitised copies of the GDP inputs in one pass.

On the CPU: its emulation against ``cp_linear.validation.gdp_bad_tokens`` and ``torch.nan_to_num`` (NaN /
±Inf sprinkled into every input, next to -0, the largest finite values and subnormals; n_h 1-3; K, V 64 /
128; bf16, fp16), bit for bit; the configs and the launch's argument order; the kernel compiled for sm_90a
(16-byte loads and stores, three shuffles, no atomics, no spills); and
``torch_api.gdp.isolation.contained_inputs`` with the launch carried out by the emulation (the torch path's
flags, copies and pass-through gradients; the torch path where the kernel cannot read the inputs; the opaque
op under ``torch.compile``). On a GPU (marked ``gpu``): the kernel against the torch path, bit for bit;
``contained_inputs`` eager and compiled (one launch, gradients passed through); and the contained GDP op
end to end with the kernel and with the torch ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from cp_linear.validation import gdp_bad_tokens
from torch_api.gdp import isolation, validation

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = ("q", "k", "v", "g", "beta")
SPECIALS = (float("nan"), float("inf"), -float("inf"))
INT_VIEWS = {2: torch.int16, 4: torch.int32}


def make_inputs(dtype, *, batch=2, tokens=37, heads=3, key_dim=64, value_dim=64, n_h=2, seed=0, device="cpu"):
    """Finite GDP inputs [B, T, H, ·] (float32 g and beta) with -0, ±the largest finite value and the
    smallest subnormal planted in each tensor (values a bit test must keep)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, key_dim, generator=gen).to(dtype)
    k = torch.randn(batch, tokens * n_h, heads, key_dim, generator=gen).to(dtype)
    v = torch.randn(batch, tokens * n_h, heads, value_dim, generator=gen).to(dtype)
    g = -torch.rand(batch, tokens, heads, generator=gen)
    beta = torch.rand(batch, tokens * n_h, heads, generator=gen)
    tensors = [q, k, v, g, beta]
    for x in tensors:
        info = torch.finfo(x.dtype)
        flat = x.view(-1)
        for value in (-0.0, info.max, -info.max, info.smallest_normal / 2 ** 3):
            flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = value
    return [x.to(device) for x in tensors]


def sprinkle(tensors, *, count=3, seed=1):
    """``count`` NaN / +Inf / -Inf entries at random places of every tensor, and one at its first (q, v, beta)
    or last (k, g) element."""
    gen = torch.Generator().manual_seed(seed)
    for index, x in enumerate(tensors):
        flat = x.view(-1)
        edge = 0 if index % 2 == 0 else flat.numel() - 1
        places = torch.randint(flat.numel(), (count,), generator=gen).tolist() + [edge]
        for n, place in enumerate(places):
            flat[place] = SPECIALS[(n + index) % 3]
    return tensors


def reference(q, k, v, g, beta, n_h):
    """(state_bad, read_bad, clean copies): ``gdp_bad_tokens`` and ``torch.nan_to_num(x, 0, 0, 0)``."""
    state_bad, read_bad = gdp_bad_tokens(q, k, v, g, beta, n_h)
    return state_bad, read_bad, [torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (q, k, v, g, beta)]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(INT_VIEWS[x.element_size()])


def assert_same(got, want):
    """Flags equal as bools; copies equal bit for bit (+0 for a replaced value, -0 kept)."""
    (state, read, clean), (state_ref, read_ref, clean_ref) = got, want
    assert state.dtype == read.dtype == torch.bool
    assert torch.equal(state.cpu(), state_ref.cpu()) and torch.equal(read.cpu(), read_ref.cpu())
    for name, x, y in zip(NAMES, clean, clean_ref):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(bits(x).cpu(), bits(y).cpu()), name


def emulated(config, q, k, v, g, beta):
    """The launch on row views (``TokenChecksLaunch``'s doc), carried out by the emulation."""
    heads = q.shape[2]
    rows = lambda x: x.view(-1, x.shape[-1] // 8, 8)  # noqa: E731
    by_head = lambda x: x.view(-1, heads)  # noqa: E731
    flags = [torch.full(q.shape[:3], 7, dtype=torch.uint8) for _ in range(2)]  # every entry must be written
    clean = [torch.full_like(x, 3.0) for x in (q, k, v, g, beta)]
    run_emulated(kl.TokenChecksLaunch(config, rows(q), rows(k), rows(v), by_head(g), by_head(beta),
                                      *(by_head(f) for f in flags), *(rows(x) for x in clean[:3]),
                                      by_head(clean[3]), by_head(clean[4])))
    return flags[0].view(torch.bool), flags[1].view(torch.bool), clean


SIZES = [pytest.param(64, 64, id="K64-V64"), pytest.param(64, 128, id="K64-V128"),
         pytest.param(128, 128, id="K128-V128")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("key_dim, value_dim", SIZES)
def test_emulation_equals_bad_tokens_and_nan_to_num_bit_for_bit(dtype, n_h, key_dim, value_dim):
    tensors = sprinkle(make_inputs(DTYPES[dtype], key_dim=key_dim, value_dim=value_dim, n_h=n_h, seed=n_h))
    config = kcfg.TokenChecksConfig(str(DTYPES[dtype]).removeprefix("torch."), key_dim, value_dim, n_h)
    got = emulated(config, *tensors)
    want = reference(*tensors, n_h)
    assert want[0].any() and not want[0].all() and want[1].any()  # a mix of bad and clean tokens
    assert_same(got, want)


# (input, step): one NaN in the last element of that step's row (entry) of token 5, head 1, batch row 1
PLANTED = [pytest.param("q", 0, id="q"), pytest.param("k", 0, id="k-step0"), pytest.param("k", 2, id="k-step2"),
           pytest.param("v", 1, id="v-step1"), pytest.param("g", 0, id="g"), pytest.param("beta", 2, id="beta-step2")]


@pytest.mark.parametrize("name, step", PLANTED)
def test_emulation_flags_only_the_token_and_head_of_a_planted_nan(name, step):
    n_h, token, head = 3, 5, 1
    tensors = make_inputs(torch.bfloat16, n_h=n_h)
    x = tensors[NAMES.index(name)]
    row = token * n_h + step if name in ("k", "v", "beta") else token
    if x.dim() == 4:
        x[1, row, head, -1] = float("nan")
    else:
        x[1, row, head] = float("nan")
    state, read, clean = emulated(kcfg.TokenChecksConfig("bfloat16", 64, 64, n_h), *tensors)
    expected = torch.zeros_like(state)
    expected[1, token, head] = True
    assert torch.equal(read if name == "q" else state, expected)
    assert not (state if name == "q" else read).any()
    assert all(torch.isfinite(c).all() for c in clean)


def test_configs_are_in_the_library_and_ci_and_reject_unsupported_sizes():
    library = set(kcfg.all_configs())
    for dtype in kcfg.TENSOR_CORE_DTYPES:
        for n_h in kcfg.TOKEN_CHECKS_HOUSEHOLDERS:
            for copies in (True, False):  # with the sanitised copies, and the flags only (JAX)
                assert kcfg.TokenChecksConfig(dtype, 64, 128, n_h, copies) in library
    ci = [c for c in kcfg.ci_configs() if isinstance(c, kcfg.TokenChecksConfig)]
    assert {(c.num_householder, c.copies) for c in ci if c.key_dim == 128} == {
        (n_h, copies) for n_h in (1, 2, 3) for copies in (True, False)} and len(ci) == 7
    described = kcfg.describe(kcfg.TokenChecksConfig("float16", 64, 128, 3))
    assert described == "TokenChecksConfig(float16, K=64, V=128, n_h=3)"
    for bad, match in [(("float32", 64, 64, 1), "dtype must be one of"), (("bfloat16", 96, 64, 1), "key_dim"),
                       (("bfloat16", 64, 32, 1), "value_dim"), (("bfloat16", 64, 64, 4), "num_householder")]:
        with pytest.raises(ValueError, match=match):
            kcfg.TokenChecksConfig(*bad).validate()


def test_launch_lists_inputs_then_outputs_and_derives_its_extents_from_the_config():
    assert kl.TokenChecksLaunch.argument_roles() == (
        NAMES, ("state_bad", "read_bad", "q_out", "k_out", "v_out", "g_out", "beta_out"), ())
    config = kcfg.TokenChecksConfig("bfloat16", 64, 128, 2)
    specs = dict(kl.TokenChecksLaunch.argument_specs())
    assert [kl._extent(config, e) for e in specs["v"].shape] == [None, 16, 8]
    assert [kl._extent(config, e) for e in specs["k_out"].shape] == [None, 8, 8]
    assert specs["state_bad"].dtype == "uint8" and specs["g"].dtype == "float32"
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    fake = kl.fake_arguments(config)
    assert len(fake) == 12 and [str(t.element_type) for t in fake[5:7]] == ["Uint8", "Uint8"]


# --------------------------------------------------------------------------- compiled for sm_90a (no GPU)


def test_kernel_compiles_for_sm90a_with_vector_loads_and_stores_and_no_spills(tmp_path):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "cp_linear.kernels", "--compile", "--arch", "sm_90a", "--ptxas", "--ci", "--only",
         "TokenChecksConfig", "--jobs", "2", "--keep-ptx", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "7 of 7 compiled" in result.stdout
    for line in (line for line in result.stdout.splitlines() if line.startswith("ok ")):
        assert "spills 0/0 B" in line or "registers" not in line, line
    ptx_files = sorted(tmp_path.glob("TokenChecksConfig-*.ptx"))
    assert len(ptx_files) == 7
    configs = [c for c in kcfg.ci_configs() if isinstance(c, kcfg.TokenChecksConfig)]
    for path in ptx_files:
        config = next(c for c in configs if path.name.startswith(
            f"TokenChecksConfig-{c.dtype}-K-{c.key_dim}-V-{c.value_dim}-n-h-{c.num_householder}-")
            and ("copies-False" in path.name) == (not c.copies))
        per_lane = (config.key_dim + config.num_householder * (config.key_dim + config.value_dim)) // 64
        ptx = Path(path).read_text()
        assert ptx.count("ld.global.v4.b32") == per_lane, path.name  # every q, k, v vector: 16 bytes
        # the copies' stores; the flags-only kernel stores nothing but its two flag bytes
        assert ptx.count("st.global.v4.b32") == (per_lane if config.copies else 0), path.name
        assert ptx.count("shfl.sync.bfly.b32") == 3, path.name  # the flags ORed over 8 lanes
        assert "atom." not in ptx and "red." not in ptx, path.name


# --------------------------------------------------------------------------- the torch integration (emulated)


def _pass_through_gradients(contained, tensors, n_h):
    """``contained`` on leaves; backward of sum(w_i · clean_i) -> (result, leaf gradients, the w_i)."""
    leaves = [x.detach().requires_grad_() for x in tensors]  # the same storage: offsets and strides kept
    state, read, clean, token_flags = contained(*leaves, n_h)
    assert token_flags is None  # no backend that zeroes flagged rows: sanitised copies
    weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(x.device, x.dtype)
               for i, x in enumerate(tensors)]
    sum(((c * w).float().sum() for c, w in zip(clean, weights))).backward()
    return (state, read, [c.detach() for c in clean]), [x.grad for x in leaves], weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_h", [1, 3])
def test_contained_inputs_through_the_kernel_equal_the_torch_path_and_pass_gradients(emulated_launches, dtype, n_h):
    tensors = sprinkle(make_inputs(DTYPES[dtype], key_dim=128, value_dim=64, n_h=n_h))
    got, grads, weights = _pass_through_gradients(isolation.contained_inputs, tensors, n_h)
    assert [type(launch) for launch in emulated_launches] == [kl.TokenChecksLaunch]
    assert emulated_launches[0].config == kcfg.TokenChecksConfig(str(DTYPES[dtype]).removeprefix("torch."), 128, 64,
                                                                  n_h)
    assert_same(got, reference(*tensors, n_h))
    for name, grad, weight in zip(NAMES, grads, weights):  # unchanged, also at the replaced entries
        assert torch.equal(grad, weight), name


def _misaligned(x):
    storage = torch.empty(x.numel() + 8, dtype=x.dtype)
    view = storage[1:1 + x.numel()].view(x.shape)
    view.copy_(x)
    return view


@pytest.mark.parametrize("case", ["float32-qkv", "bfloat16-g", "n_h-4", "K-32", "misaligned-q", "non-contiguous-k",
                                  "non-contiguous-beta"])
def test_contained_inputs_take_the_torch_path_where_the_kernel_cannot_read_the_inputs(emulated_launches, case):
    n_h = 4 if case == "n_h-4" else 2
    tensors = sprinkle(make_inputs(torch.bfloat16, key_dim=32 if case == "K-32" else 64, n_h=n_h))
    q, k, v, g, beta = tensors
    if case == "float32-qkv":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "bfloat16-g":
        g = g.bfloat16()
    elif case == "misaligned-q":
        q = _misaligned(q)
        assert q.is_contiguous() and q.data_ptr() % 16 != 0
    elif case == "non-contiguous-k":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "non-contiguous-beta":
        beta = beta.transpose(1, 2).contiguous().transpose(1, 2)
    tensors = [q, k, v, g, beta]
    got, grads, weights = _pass_through_gradients(isolation.contained_inputs, tensors, n_h)
    assert emulated_launches == []
    assert_same(got, reference(*tensors, n_h))
    for grad, weight in zip(grads, weights):
        assert torch.equal(grad, weight)


def test_cpu_inputs_take_the_torch_path_without_the_patch(monkeypatch):
    launches = []
    monkeypatch.setattr(kl._Launch, "run", launches.append)
    tensors = sprinkle(make_inputs(torch.bfloat16))
    assert isolation._token_checks_config(*tensors, 2) is not None  # dtypes and sizes the kernel takes
    assert not isolation._kernel_reads(*tensors)  # but no CUDA device
    assert_same(isolation.contained_inputs(*tensors, 2)[:3], reference(*tensors, 2))
    assert launches == []


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-ops", "kernel-emulated"])
def test_the_contained_inputs_op_passes_opcheck_and_equals_the_torch_path(monkeypatch, kernel):
    launches = []
    if kernel:
        monkeypatch.setattr(validation, "_kernel_platform_ready", lambda device: True)
        monkeypatch.setattr(kl._Launch, "run", lambda launch: (launches.append(launch), run_emulated(launch)))
    tensors = sprinkle(make_inputs(torch.float16, batch=1, tokens=9, heads=2, n_h=3))
    args = (*(x.clone().requires_grad_() for x in tensors), 3)
    torch.library.opcheck(torch.ops.cp_linear.gdp_contained_inputs.default, args)
    *clean, state, read = torch.ops.cp_linear.gdp_contained_inputs(*args)
    assert_same((state, read, clean), reference(*tensors, 3))
    assert bool(launches) == kernel


def test_compiled_contained_inputs_call_the_opaque_op_once_and_equal_eager(monkeypatch, emulated_launches):
    """Under torch.compile (aot_eager) the kernel path is the op ``cp_linear::gdp_contained_inputs``: no row
    reductions or nan_to_num in the graph; the same flags, copies and gradients as eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(isolation, "_compiled_kernel_device", lambda device: True)  # CPU stands in for CUDA
    graphs = []
    compiler = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or make_boxed_func(gm.forward),
                            bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    tensors = sprinkle(make_inputs(torch.bfloat16, n_h=2))
    torch._dynamo.reset()
    compiled = torch.compile(isolation.contained_inputs, fullgraph=True, backend=compiler)
    got, grads, weights = _pass_through_gradients(compiled, tensors, 2)
    (forward,) = graphs
    targets = [node.target for node in forward.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.cp_linear.gdp_contained_inputs.default) == 1, targets
    for op in (torch.ops.aten.aminmax.default, torch.ops.aten.nan_to_num.default,
               torch.ops.cp_linear.gdp_bad_tokens.default):
        assert op not in targets, op
    assert [type(launch) for launch in emulated_launches] == [kl.TokenChecksLaunch]
    assert_same(got, reference(*tensors, 2))
    for grad, weight in zip(grads, weights):
        assert torch.equal(grad, weight)


# --------------------------------------------------------------------------- on a GPU


def _kernel_gpu():
    from torch_api.gdp import cutedsl

    reason = cutedsl.kernel_platform_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


GPU_SHAPES = [pytest.param(dict(batch=2, tokens=37, heads=3), id="B2-T37-H3"),
              pytest.param(dict(batch=1, tokens=1, heads=1), id="B1-T1-H1"),
              pytest.param(dict(batch=1, tokens=8192, heads=16), id="B1-T8192-H16")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("key_dim, value_dim", SIZES)
def test_kernel_on_gpu_equals_the_torch_path_bit_for_bit(shape, dtype, n_h, key_dim, value_dim):
    _kernel_gpu()
    tensors = make_inputs(DTYPES[dtype], key_dim=key_dim, value_dim=value_dim, n_h=n_h, seed=n_h, **shape)
    tensors = [x.cuda() for x in sprinkle(tensors, count=max(3, tensors[0].numel() // 100000))]
    config = isolation._token_checks_config(*tensors, n_h)
    assert config is not None and isolation._kernel_reads(*tensors)
    state, read, *clean = isolation._kernel_contained_inputs(config, *tensors)
    torch.cuda.synchronize()
    assert_same((state, read, clean), reference(*tensors, n_h))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_contained_inputs_on_gpu_run_one_kernel_and_pass_gradients(monkeypatch, compiled):
    _kernel_gpu()
    launches = []
    original = kl._Launch.run
    monkeypatch.setattr(kl._Launch, "run", lambda launch: (launches.append(type(launch)), original(launch)))
    tensors = [x.cuda() for x in sprinkle(make_inputs(torch.bfloat16, key_dim=128, value_dim=128, n_h=2))]
    contained = isolation.contained_inputs
    if compiled:
        torch._dynamo.reset()
        contained = torch.compile(contained, fullgraph=True)
    got, grads, weights = _pass_through_gradients(contained, tensors, 2)
    assert launches == [kl.TokenChecksLaunch]
    assert_same(got, reference(*tensors, 2))
    for grad, weight in zip(grads, weights):
        assert torch.equal(grad, weight)


@pytest.mark.gpu
def test_contained_gdp_on_gpu_through_the_kernel_equals_the_torch_containment(monkeypatch):
    """check_inputs=False end to end (CuTeDSL backend, bf16, K = V = 128, n_h = 2, three sequences): with the
    token-checks kernel (one flags-only launch: the backend zeroes the flagged rows, ``zeroes_flagged_rows``)
    and with the torch ops (sanitised copies), the same poisoned outputs and final states, and the same finite
    gradients (tests/torch_api/test_cutedsl_backend.py compares the two routes bit for bit)."""
    _kernel_gpu()
    import numpy as np

    from tests.cutedsl_inputs import emulation_inputs
    from torch_api import gated_delta_product

    lengths, n_h, heads = [700, 300, 1048], 2, 4
    dirty = [x.cuda() for x in emulation_inputs(lengths, heads, 128, 128, n_h, seed=5)]
    dirty[1][0, 100 * n_h + 1, 1, 7] = float("nan")  # k, token 100 (sequence 0), head 1
    dirty[0][0, 500, 0, 3] = float("inf")  # q, token 500: that output alone
    dirty[3][0, 1500, 2] = -float("inf")  # g, token 1500 (sequence 2), head 2
    dirty[4][0, 1800 * n_h + 1, 3] = float("nan")  # beta, token 1800, head 3
    dirty[2][0, 900 * n_h, 0, 0] = float("nan")  # v, token 900 (sequence 1), head 0
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    do = torch.randn(1, sum(lengths), heads, 128, device="cuda", generator=gen).bfloat16()
    launches = []
    original = kl._Launch.run
    monkeypatch.setattr(kl._Launch, "run", lambda launch: (launches.append(type(launch)), original(launch)))
    results = {}
    for path in ("kernel", "torch-ops"):
        if path == "torch-ops":
            monkeypatch.setattr(isolation, "_kernel_reads", lambda *tensors: False)
        launches.clear()
        leaves = [x.clone().requires_grad_() for x in dirty]
        out, final = gated_delta_product(*leaves, num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                         backend="cutedsl", check_inputs=False)
        torch.where(out.isfinite(), out.float() * do.float(), 0).sum().backward()
        results[path] = [out, final, *(x.grad for x in leaves)]
        assert launches.count(kl.TokenChecksLaunch) == (path == "kernel"), launches
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta"), results["kernel"],
                               results["torch-ops"]):
        assert torch.equal(got.isnan(), want.isnan()), name
        torch.testing.assert_close(got, want, equal_nan=True, msg=name)
    out = results["kernel"][0]
    assert out.isnan().any() and not out[0, :100].isnan().any()
    assert all(torch.isfinite(grad).all() for grad in results["kernel"][2:])
