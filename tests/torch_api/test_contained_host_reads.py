"""The contained GDP step (``check_inputs=False``) reads nothing back to the host.

On a GPU a host read (``.item()``, ``bool(tensor)``, ``.tolist()``, ``.cpu()``, ``nonzero``, a synchronize)
stalls the host until the GPU has run everything queued before it, which turns a step whose host work
overlaps its kernels into host work plus kernels. On the CPU a read costs nothing and is easy to add
unnoticed, so these tests run the step's host path (the CuTeDSL backend as on a Hopper GPU, every launch
emulated outside the guard) under ``no_host_reads``, which fails at the first one.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_api.gdp.cutedsl as cutedsl
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from tests.cutedsl_inputs import emulation_inputs
from torch_api.gdp import validation
from torch_api.gdp.ops import gated_delta_product, run_gated_delta_product

# aten ops whose result reaches the host (item, bool, int and float all end in _local_scalar_dense) or whose
# output size depends on the values (the device tells the host how large to make it)
HOST_READ_OPS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero", "nonzero_static", "masked_select",
                 "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave",
                 "bincount", "histc"}


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.paused = False  # while a kernel launch is emulated: the emulation reads as it likes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READ_OPS and not self.paused:
            raise AssertionError(f"host read: aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


_GUARDS: list[_HostReads] = []  # the active guard (one at a time)


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Fail at the first host read: the dispatched ops above, and the Python calls that copy to the host
    without dispatching on a CPU tensor (``.cpu()``, ``.numpy()``, ``.tolist()``) or wait for a device.
    Not caught: ``.to(device)`` with the CPU as the device, which on CPU tensors is no copy (and the code
    under test moves tensors to its inputs' device, the CPU here)."""
    guard = _HostReads()

    def forbidden(what, original):
        def call(*args, **kwargs):
            if not guard.paused:
                raise AssertionError(f"host read: {what}")
            return original(*args, **kwargs)
        return call

    with monkeypatch.context() as patch:
        for owner, name in [(torch.Tensor, name) for name in ("cpu", "numpy", "tolist", "__array__")] + [
                (torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]:
            patch.setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}", getattr(owner, name)))
        _GUARDS.append(guard)
        try:
            with guard:
                yield
        finally:
            _GUARDS.pop()


def _emulated_launch(launch):
    """A kernel launch carried out by the emulation, outside any host-read guard (the kernel runs on the
    device: only the host code around it is under test)."""
    guard = _GUARDS[-1] if _GUARDS else None
    if guard is not None:
        guard.paused = True
    try:
        run_emulated(launch)
    finally:
        if guard is not None:
            guard.paused = False


@pytest.fixture
def kernels_as_on_hopper(monkeypatch):
    """The CuTeDSL backend and the token-checks containment taken as on a Hopper GPU; launches recorded and
    emulated (``_emulated_launch``)."""
    launched = []
    monkeypatch.setattr(kl._Launch, "run", lambda launch: (launched.append(type(launch).__name__),
                                                           _emulated_launch(launch)))
    monkeypatch.setattr(cutedsl, "unsupported_reason", lambda inputs: None)
    monkeypatch.setattr(cutedsl, "_sm_count", lambda device: 132)
    monkeypatch.setattr(validation, "_kernel_platform_ready", lambda device: True)
    return launched


def test_no_host_reads_catches_reads(monkeypatch):
    x = torch.ones(3)
    for read in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.tolist(), lambda: x.cpu(),
                 lambda: x.nonzero(), lambda: np.asarray(x)):
        with pytest.raises(AssertionError, match="host read"), no_host_reads(monkeypatch):
            read()
    with no_host_reads(monkeypatch):
        (x * 2).cumsum(0).any(0)  # device work only


@pytest.mark.parametrize("containment", ["token-checks-kernel", "torch-ops"])
@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zero-start", "initial-state"])
def test_contained_step_reads_nothing_on_the_host(kernels_as_on_hopper, monkeypatch, containment, layout,
                                                  with_initial):
    """Forward and backward of the contained step (the op after validation, which reads cu_seqlens once on
    purpose) with NaN and Inf inputs: no host read, and the containment takes the path asked for."""
    if containment == "torch-ops":
        monkeypatch.setattr(validation, "_kernel_platform_ready", lambda device: False)
    n_h, heads, dim = 2, 2, 64
    rows, lengths = (2, [48]) if layout == "rows" else (1, [30, 0, 34])
    cu = None if layout == "rows" else torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    sequences = rows if cu is None else len(lengths)
    inputs = list(emulation_inputs(lengths, heads, dim, dim, n_h, seed=5, rows=rows))
    inputs[1][0, 3, 1, 2] = float("nan")
    inputs[3][-1, 9, 0] = float("inf")
    if with_initial:
        inputs.append(torch.randn(sequences, heads, dim, dim, generator=torch.Generator().manual_seed(6)))
        inputs[5][0, 1, 2, 3] = float("nan")
    leaves = [x.requires_grad_() for x in inputs]
    do = torch.randn(rows, sum(lengths), heads, dim).bfloat16()
    dfinal = torch.randn(sequences, heads, dim, dim)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2, backward="kernels")
    with no_host_reads(monkeypatch):
        o, final = run_gated_delta_product(*leaves[:5], backend=backend, scale=dim ** -0.5, num_householder=n_h,
                                           cu_seqlens=cu, initial_state=leaves[5] if with_initial else None,
                                           use_qk_l2norm_in_kernel=True, contain=True)
        torch.autograd.backward([o, final], [do, dfinal])
    assert ("TokenChecksLaunch" in kernels_as_on_hopper) == (containment == "token-checks-kernel")
    assert all(x.grad is not None for x in leaves)


def test_contained_rows_op_reads_nothing_on_the_host(kernels_as_on_hopper, monkeypatch):
    """The public op with check_inputs=False on rows (bench_gdp_train.py's step): validation included."""
    n_h = 2
    leaves = [x.requires_grad_() for x in emulation_inputs([40], 2, 64, 64, n_h, seed=7)]
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(backward="kernels")
    with no_host_reads(monkeypatch):
        o, final = gated_delta_product(*leaves, num_householder=n_h, use_qk_l2norm_in_kernel=True, backend=backend,
                                       check_inputs=False)
        torch.autograd.backward([o, final], [torch.ones_like(o), torch.ones_like(final)])
    assert "TokenChecksLaunch" in kernels_as_on_hopper
