"""The containment's token-flags route against its copies route (``torch_api.gdp.isolation``), on the CPU.

With ``check_inputs=False`` a backend that declares ``zeroes_flagged_rows`` gets the raw inputs and the token
flags of one flags-only token-checks launch (``GDPInputs.token_flags``), where the kernel takes the inputs;
every other backend gets sanitised copies. The one-device op then marks every poisoned token read_bad and
leaves the NaN of those outputs and the zero of their gradient to the backend (no select of its own); the CP
op passes the raw read_bad flags and keeps its select. Here the platform is taken as a Hopper GPU and every
kernel launch is emulated (``cp_linear.kernels.emulation``); the backends:

  flag-zeroing      ``FlagZeroingBackend``: ``TorchGDPBackend`` keeping the flags' contract in torch ops
  cutedsl-fallback  the CuTeDSL backend on CPU tensors: its fallback (``TorchGDPBackend``) under the contract
  cutedsl-kernels   the CuTeDSL backend on the emulated contained chunk kernels (backward "kernels" / "torch")

The copies route is the same backend with ``zeroes_flagged_rows`` off. Both routes compute every finite output
from the same values in the same order (a flagged row is zero where the copies hold its sanitised values, and
it reaches only poisoned outputs, whose output gradient is zero: 0 · finite = 0 exactly), so outputs, final
states and gradients are compared bit for bit, NaN where NaN, not to a tolerance.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_api.gdp.cutedsl as cutedsl
from cp_linear import build_packed_sequence_cp_metadata
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from cp_linear.protocol import CPForwardResult, CPSavedContext
from cp_linear.validation import gdp_bad_tokens, poison, zero_flagged_inputs, zero_flagged_rows
from tests.cutedsl_inputs import emulation_inputs
from torch_api.gdp import isolation, validation
from torch_api.gdp.chunk import TorchGDPBackend

N_H, HEADS, DIM = 2, 2, 64
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial")
_READ_BAD = "read_bad"  # FlagZeroingBackend's saved-context flag: read_bad rides last


class FlagZeroingBackend(TorchGDPBackend):
    """``TorchGDPBackend`` that takes ``GDPInputs.token_flags`` and keeps their contract in torch ops, as a
    kernel backend's contained kernels do: it computes with the flagged rows zero (``zero_flagged_inputs``),
    stores NaN as the output of a read_bad token and takes that output's gradient as zero. ``seen`` records,
    per forward, whether flags came."""

    zeroes_flagged_rows = True

    def __init__(self):
        super().__init__()
        self.seen: list[bool] = []

    def cp_forward_prepare(self, inputs):
        self.seen.append(inputs.token_flags is not None)
        if inputs.token_flags is None:
            return super().cp_forward_prepare(inputs)
        state_bad, read_bad = inputs.token_flags
        q, k, v, g, beta = zero_flagged_inputs(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, state_bad,
                                               read_bad, inputs.num_householder)
        summary, context = super().cp_forward_prepare(replace(inputs, q=q, k=k, v=v, g=g, beta=beta,
                                                              token_flags=None))
        return summary, (context, read_bad)

    def cp_forward_apply(self, local_context, preceding):
        if not isinstance(local_context, tuple):
            return super().cp_forward_apply(local_context, preceding)
        context, read_bad = local_context
        output, saved = super().cp_forward_apply(context, preceding)
        o, final = output if isinstance(output, tuple) else (output, None)
        o = poison(o, (read_bad != 0)[..., None])  # the NaN store of a read_bad token's output
        output = o if final is None else (o, final)
        saved = CPSavedContext((*saved.tensors, read_bad), {**saved.metadata, _READ_BAD: True})
        return CPForwardResult(output, saved)

    def cp_backward_prepare(self, output_grad, saved_context):
        if saved_context.metadata.get(_READ_BAD, False):
            read_bad = saved_context.tensors[-1]
            metadata = {name: value for name, value in saved_context.metadata.items() if name != _READ_BAD}
            saved_context = CPSavedContext(saved_context.tensors[:-1], metadata)
            do, final_grad = output_grad if isinstance(output_grad, tuple) else (output_grad, None)
            if do is not None:
                do = zero_flagged_rows(do, read_bad, 1)  # a poisoned output passes no gradient
            output_grad = (do, final_grad) if isinstance(output_grad, tuple) else do
        return super().cp_backward_prepare(output_grad, saved_context)


BACKENDS = ["flag-zeroing", "cutedsl-fallback", "cutedsl-kernels", "cutedsl-kernels-torch-backward"]


def make_backend(kind: str, flags: bool):
    """A backend of ``kind`` (``BACKENDS``) that takes the token flags, or the same with ``zeroes_flagged_rows``
    off (the copies route); ``seen`` records per forward whether flags came."""
    if kind == "flag-zeroing":
        backend = FlagZeroingBackend()
    else:
        backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(
            segment_chunks=2, backward="torch" if kind.endswith("torch-backward") else "kernels")
        backend.seen = []
        prepare = backend.cp_forward_prepare

        def recording_prepare(inputs):
            backend.seen.append(inputs.token_flags is not None)
            return prepare(inputs)

        backend.cp_forward_prepare = recording_prepare
    if not flags:
        backend.zeroes_flagged_rows = False
    return backend


def patch_kernels(patch, kind: str, launches: list) -> None:
    """The platform taken as a Hopper GPU: the token-checks launch (and, for ``cutedsl-kernels``, the chunk
    kernels) run, emulated and recorded in ``launches``; ``patch(owner, name, value)`` sets an attribute."""
    patch(validation, "_kernel_platform_ready", lambda device: True)
    patch(kl._Launch, "run", lambda launch: (launches.append(launch), run_emulated(launch)))
    if kind.startswith("cutedsl-kernels"):
        patch(cutedsl, "unsupported_reason", lambda inputs: None)
        patch(cutedsl, "_sm_count", lambda device: 132)


def route_problems(kind: str, flags: bool, backend, launches: list) -> list[str]:
    """What contradicts the route asked for: the flags route is one flags-only token-checks launch, flags at
    the backend (and contained chunk kernels); the copies route one launch with copies and no flags."""
    problems = []
    checks = [launch.config.copies for launch in launches if isinstance(launch, kl.TokenChecksLaunch)]
    if checks != [not flags]:
        problems.append(f"token-checks launches with copies={checks}, expected [{not flags}]")
    if not backend.seen or set(backend.seen) != {flags}:
        problems.append(f"the backend saw token flags {backend.seen}, expected {flags}")
    contained = {launch.config.contained for launch in launches if hasattr(launch.config, "contained")}
    if kind.startswith("cutedsl-kernels") and contained != {flags}:
        problems.append(f"chunk kernels contained={contained}, expected {flags}")
    return problems


def bitwise_problems(got, want, names=NAMES) -> list[str]:
    """The names whose tensors differ (NaN where NaN, the rest bit for bit; -0 equals +0)."""
    problems = []
    for name, a, b in zip(names, got, want):
        if (a is None) != (b is None):
            problems.append(f"{name}: one is None")
        elif a is not None:
            try:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            except AssertionError as err:
                problems.append(f"{name}: {str(err).splitlines()[0]}")
    return problems


# --------------------------------------------------------------------------- one device

LENGTHS = [40, 25, 131]  # three sequences; the last spans several segments at segment_chunks=2


def dirty_inputs(seed=3):
    """bf16 q, k, v (K = V = 64) and float32 g, beta of the packed ``LENGTHS`` with NaN / ±Inf in every input
    at several (token, head), and a NaN in one initial state; and cu_seqlens."""
    q, k, v, g, beta = emulation_inputs(LENGTHS, HEADS, DIM, DIM, N_H, seed=seed)
    q[0, 10, 1, 5] = float("nan")  # token 10 (sequence 0), head 1: that output alone
    q[0, 120, 0, 0] = float("inf")  # token 120 (sequence 2), head 0
    k[0, 50 * N_H + 1, 0, 2] = float("inf")  # token 50 (sequence 1), head 0, second step
    v[0, 70 * N_H, 1, 0] = float("nan")  # token 70 (sequence 2), head 1
    g[0, 30, 0] = -float("inf")  # token 30 (sequence 0), head 0
    beta[0, 150 * N_H + 1, 1] = float("nan")  # token 150 (sequence 2), head 1: after v's, changes nothing new
    beta[0, 180 * N_H, 0] = float("nan")  # token 180 (sequence 2), head 0
    initial = torch.randn(len(LENGTHS), HEADS, DIM, DIM, generator=torch.Generator().manual_seed(seed)) * 0.1
    initial[1, 1, 3, 3] = float("nan")  # sequence 1, head 1: every output of it
    cu = torch.tensor(np.cumsum([0] + LENGTHS), dtype=torch.int32)
    return [q, k, v, g, beta], initial, cu


def one_device_step(backend, inputs, initial, cu):
    """check_inputs=False forward and backward with output gradients everywhere (poisoned outputs included:
    the op's select, or the backend, must zero them) -> [o, final, input grads..., initial grad]."""
    from torch_api.gdp.ops import gated_delta_product

    leaves = [x.clone().requires_grad_() for x in inputs]
    initial = None if initial is None else initial.clone().requires_grad_()
    o, final = gated_delta_product(*leaves, num_householder=N_H, cu_seqlens=cu, initial_state=initial,
                                   use_qk_l2norm_in_kernel=True, backend=backend, check_inputs=False)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    torch.autograd.backward([o, final], [do, torch.randn(final.shape, generator=gen)])
    return [o, final, *(x.grad for x in leaves), None if initial is None else initial.grad]


@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "nan-initial-state"])
@pytest.mark.parametrize("kind", BACKENDS)
def test_one_device_flags_route_equals_the_copies_route_bit_for_bit(monkeypatch, kind, with_initial):
    inputs, initial, cu = dirty_inputs()
    initial = initial if with_initial else None
    results = {}
    for flags in (True, False):
        launches = []
        backend = make_backend(kind, flags)
        with monkeypatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's one-line reason
            patch_kernels(patch.setattr, kind, launches)
            results[flags] = one_device_step(backend, inputs, initial, cu)
        assert not route_problems(kind, flags, backend, launches), route_problems(kind, flags, backend, launches)
    assert not bitwise_problems(results[True], results[False]), bitwise_problems(results[True], results[False])
    o = results[True][0][0]
    assert o[10, 1].isnan().all() and o[:10].isfinite().all() and o[11:30, 0].isfinite().all()
    assert o[30:40, 0].isnan().all() and o[40:50].isfinite().all() == (not with_initial)
    assert all(x.isfinite().all() for x in results[True][2:] if x is not None)


def test_the_op_marks_every_poisoned_token_read_bad_and_selects_nothing_over_the_output(monkeypatch):
    """The one-device op's flags route: read_bad at the backend is every poisoned token (not only the non-finite
    q rows), and the op's one select is over the final states (the backend's NaN store makes the outputs')."""
    from torch_api.gdp import ops

    inputs, _, cu = dirty_inputs()
    backend = make_backend("flag-zeroing", flags=True)
    flags_seen = []
    prepare = backend.cp_forward_prepare

    def recording(gdp_inputs):
        flags_seen.append(gdp_inputs.token_flags)
        return prepare(gdp_inputs)

    backend.cp_forward_prepare = recording
    selected = []
    original_poison = ops.poison
    monkeypatch.setattr(ops, "poison", lambda x, mask: (selected.append(tuple(x.shape)), original_poison(x, mask))[1])
    patch_kernels(monkeypatch.setattr, "flag-zeroing", [])
    o, final = one_device_step(backend, inputs, None, cu)[:2]
    (state_bad, read_bad), = flags_seen
    want_state, want_read = gdp_bad_tokens(*inputs, N_H)
    assert state_bad.dtype == read_bad.dtype == torch.uint8
    assert torch.equal(state_bad != 0, want_state)
    assert torch.equal(read_bad != 0, o.isnan().any(-1)) and (read_bad != 0).sum() > want_read.sum()
    assert selected == [tuple(final.shape)]


def test_a_finite_step_on_the_flags_route_equals_the_checked_op_bit_for_bit(monkeypatch):
    """Finite inputs: check_inputs=False through the flags route (contained chunk kernels with no flag set)
    gives what check_inputs=True gives, bit for bit, outputs, final states and gradients."""
    _, initial, cu = dirty_inputs()
    inputs = emulation_inputs(LENGTHS, HEADS, DIM, DIM, N_H, seed=3)
    initial = torch.nan_to_num(initial)
    launches = []
    patch_kernels(monkeypatch.setattr, "cutedsl-kernels", launches)
    from torch_api.gdp.ops import gated_delta_product

    results = []
    for check in (False, True):
        backend = make_backend("cutedsl-kernels", flags=True)
        leaves = [x.clone().requires_grad_() for x in (*inputs, initial)]
        o, final = gated_delta_product(*leaves[:5], num_householder=N_H, cu_seqlens=cu, initial_state=leaves[5],
                                       use_qk_l2norm_in_kernel=True, backend=backend, check_inputs=check)
        gen = torch.Generator().manual_seed(7)
        torch.autograd.backward([o, final], [torch.randn(o.shape, generator=gen).to(o.dtype),
                                             torch.randn(final.shape, generator=gen)])
        results.append([o, final, *(x.grad for x in leaves)])
    contained = {launch.config.contained for launch in launches if hasattr(launch.config, "contained")}
    assert contained == {True, False}  # the flags route's contained kernels, then the checked op's plain ones
    assert not bitwise_problems(results[0], results[1]), bitwise_problems(results[0], results[1])


# --------------------------------------------------------------------------- the custom ops and torch.compile


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-ops", "kernel-emulated"])
def test_the_token_flags_op_passes_opcheck_and_equals_gdp_bad_tokens(monkeypatch, kernel):
    launches = []
    if kernel:
        patch_kernels(monkeypatch.setattr, "flag-zeroing", launches)
    inputs, _, _ = dirty_inputs()
    args = (*inputs, N_H)
    torch.library.opcheck(torch.ops.cp_linear.gdp_token_flags.default, args)
    state_bad, read_bad = torch.ops.cp_linear.gdp_token_flags(*args)
    want_state, want_read = gdp_bad_tokens(*args)
    assert state_bad.dtype == read_bad.dtype == torch.uint8
    assert torch.equal(state_bad != 0, want_state) and torch.equal(read_bad != 0, want_read)
    assert [launch.config.copies for launch in launches] == ([False] * len(launches) if kernel else [])
    assert bool(launches) == kernel


@pytest.mark.parametrize("kind", ["cutedsl-fallback", "cutedsl-kernels"])
def test_compiled_contained_step_takes_the_flags_route_through_the_opaque_ops(monkeypatch, kind):
    """Under torch.compile (aot_eager) the flags route is ``cp_linear::gdp_token_flags`` and the flags ride
    into ``cp_linear::gdp_forward`` (and its backward): no copies op, no select over the output; the same
    outputs, final states and gradients as eager, bit for bit."""
    from torch._dynamo.backends.common import aot_autograd

    from torch_api.gdp.library import register_backend
    from torch_api.gdp.ops import run_gated_delta_product

    launches = []
    patch_kernels(monkeypatch.setattr, kind, launches)
    monkeypatch.setattr(isolation, "_compiled_kernel_device", lambda device: True)  # CPU stands in for CUDA
    inputs, _, cu = dirty_inputs()
    backend = make_backend(kind, flags=True)
    register_backend(backend)

    def step(q, k, v, g, beta):
        return run_gated_delta_product(q, k, v, g, beta, backend=backend, scale=DIM ** -0.5, num_householder=N_H,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True, contain=True)

    graphs = []
    compiler = aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm, bw_compiler=lambda gm, _: gm)
    torch._dynamo.reset()
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's one-line reason
        for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True, backend=compiler))):
            launches.clear()
            leaves = [x.clone().requires_grad_() for x in inputs]
            o, final = fn(*leaves)
            gen = torch.Generator().manual_seed(7)
            torch.autograd.backward([o, final], [torch.randn(o.shape, generator=gen).to(o.dtype),
                                                 torch.randn(final.shape, generator=gen)])
            results[name] = [o, final, *(x.grad for x in leaves)]
            assert not route_problems(kind, True, backend, launches), route_problems(kind, True, backend, launches)
    (forward,) = graphs
    targets = [node.target for node in forward.graph.nodes if node.op == "call_function"]
    ops = torch.ops.cp_linear
    assert targets.count(ops.gdp_token_flags.default) == 1 and targets.count(ops.gdp_forward.default) == 1, targets
    assert ops.gdp_contained_inputs.default not in targets and torch.ops.aten.nan_to_num.default not in targets
    problems = bitwise_problems(results["compiled"], results["eager"])
    assert not problems, problems
    assert results["eager"][0].isnan().any()


# --------------------------------------------------------------------------- CP on two gloo ranks

LOCAL = 48  # tokens per rank
CP_LENGTHS = [20, 50, 26]  # sequence 1 (tokens 20..69) spans ranks 0 and 1


def cp_dirty_inputs():
    """The whole packed sequence (bf16 q, k, v, K = V = 64; float32 g, beta) with NaN / ±Inf in every input:
    a k on rank 0 poisons its sequence on rank 1 too (through the summary)."""
    q, k, v, g, beta = emulation_inputs(CP_LENGTHS, HEADS, DIM, DIM, N_H, seed=11)
    v[0, 5 * N_H + 1, 1, 3] = float("nan")  # token 5 (sequence 0, rank 0), head 1
    k[0, 30 * N_H, 0, 7] = float("nan")  # token 30 (sequence 1, rank 0), head 0: poisons tokens 30..69
    q[0, 60, 1, 0] = float("inf")  # token 60 (sequence 1, rank 1), head 1: that output alone
    g[0, 80, 1] = -float("inf")  # token 80 (sequence 2, rank 1), head 1
    beta[0, 90 * N_H + 1, 0] = float("nan")  # token 90 (sequence 2, rank 1), head 0
    return [q, k, v, g, beta]


def cp_routes(rank, world, kind):
    """Each route of the CP op on this rank's shard -> the problems: route mismatches, and flags-route results
    that differ from the copies route's bit for bit (output and input gradients; output gradient everywhere).
    Paths: the public op (check_inputs=False) and ``run_cp_op`` (contain=True) in eager mode, and for the
    CuTeDSL backend ``run_cp_op`` compiled (aot_eager), where the flags ride through ``cp_linear::gdp_cp_forward``
    and its backward (against the eager copies route)."""
    from torch._dynamo.backends.common import aot_autograd

    from torch_api.gdp.cp import gdp_chunkwise_context_parallel, run_cp_op
    from torch_api.gdp.library import register_backend

    token = slice(rank * LOCAL, (rank + 1) * LOCAL)
    step = slice(token.start * N_H, token.stop * N_H)
    shard = [x[:, token if i in (0, 3) else step].contiguous() for i, x in enumerate(cp_dirty_inputs())]
    ids = np.repeat(np.arange(len(CP_LENGTHS)), CP_LENGTHS).reshape(1, -1)
    metadata = build_packed_sequence_cp_metadata(ids, rank, world)
    cu = torch.tensor(metadata.local_cu_seqlens, dtype=torch.int32)
    span = torch.tensor([metadata.preceding_rank_start, metadata.following_rank_stop], dtype=torch.int32)
    do = torch.randn(1, LOCAL, HEADS, DIM, generator=torch.Generator().manual_seed(rank)).bfloat16()
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore():
        while saved:
            owner, name, value = saved.pop()
            setattr(owner, name, value)

    def run(path, backend, leaves):
        if path == "public op":
            return gdp_chunkwise_context_parallel(*leaves, cp_group=dist.group.WORLD, metadata=metadata,
                                                  num_householder=N_H, use_qk_l2norm_in_kernel=True, backend=backend,
                                                  check_inputs=False)
        return run_cp_op(*leaves, cu_seqlens=cu, rank_range=span, group_name=dist.group.WORLD.group_name,
                         backend=backend, scale=DIM ** -0.5, num_householder=N_H, use_qk_l2norm_in_kernel=True,
                         contain=True)

    compiled = kind.startswith("cutedsl")
    runs = [("public op", True), ("public op", False), ("run_cp_op", True), ("run_cp_op", False)]
    runs += [("compiled run_cp_op", True)] if compiled else []
    results, problems = {}, []
    try:
        for path, flags in runs:
            launches = []
            patch_kernels(patch, kind, launches)
            backend = make_backend(kind, flags)
            leaves = [x.clone().requires_grad_() for x in shard]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback's one-line reason
                if path.startswith("compiled"):
                    patch(isolation, "_compiled_kernel_device", lambda device: True)  # CPU stands in for CUDA
                    register_backend(backend)
                    torch._dynamo.reset()
                    step_fn = torch.compile(lambda *x: run("run_cp_op", backend, x), fullgraph=True,
                                            backend=aot_autograd(fw_compiler=lambda gm, _: gm,
                                                                 bw_compiler=lambda gm, _: gm))
                    out = step_fn(*leaves)
                else:
                    out = run(path, backend, leaves)
                out.backward(do)
            results[path, flags] = [out, *(x.grad for x in leaves)]
            problems += [f"{path} flags={flags}: {p}" for p in route_problems(kind, flags, backend, launches)]
            restore()
    finally:
        restore()
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    for path, flags in runs:
        if flags:
            copies = results[path.removeprefix("compiled "), False]
            problems += [f"{path}: {p}" for p in bitwise_problems(results[path, True], copies, names)]
    poisoned = np.zeros((2 * LOCAL, HEADS), bool)
    poisoned[5:20, 1] = poisoned[30:70, 0] = poisoned[60, 1] = poisoned[80:96, 1] = poisoned[90:96, 0] = True
    nan = results["public op", True][0][0].isnan().any(-1).numpy()  # [L, H]
    if not np.array_equal(nan, poisoned[token]):
        problems.append(f"NaN outputs at {np.argwhere(nan).tolist()}, expected {np.argwhere(poisoned[token]).tolist()}")
    return problems


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["flag-zeroing", "cutedsl-fallback", "cutedsl-kernels"])
def test_cp_flags_route_equals_the_copies_route_bit_for_bit_on_two_ranks(gloo_pools, kind):
    """The CP op over gloo (2 ranks, packed sequences, one spanning both): the flags route (raw read_bad, the
    op's select kept) gives the copies route's outputs and gradients bit for bit, eager and compiled."""
    for rank, problems in enumerate(gloo_pools(2).run(cp_routes, kind)):
        assert not problems, f"rank {rank}: {problems}"
