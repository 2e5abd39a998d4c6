"""Test-only: the kernels' XLA custom calls carried out on the CPU by the torch emulation.

``register_emulated_kernels()`` registers, for the CPU platform, an implementation of every
kernel's custom-call target (``jax_api.gdp.kernel_calls.register_kernel``, the bridge's one
injection point): a TVM-FFI function that receives the call's operands, results and attributes
in the kernel's argument order, as XLA buffers (DLPack, no copy), and runs
``cp_linear.kernels.emulation.run_emulated`` on them. The traced program is the product's, custom
calls included; only the implementation behind each target differs from the GPU's. Every config of
``cp_linear.kernels.configs.all_configs()`` is covered (the GDP kernels and the short conv's), through
the launch class ``LAUNCHES`` maps it to: a new kernel family needs only its config listed there.

Every result buffer is filled with NaN (floats), a large negative int (int32) or the type's largest
value (uint8 flags) before the emulation writes it, so a read of anything a kernel does not write
shows up in the outputs (XLA's result buffers are uninitialised on the GPU too).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter

import torch

from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated

LAUNCH_COUNTS: Counter = Counter()  # config -> launches executed (on the CPU, at run time)
_LOCK = threading.Lock()
_DONE: list[bool] = []
_POISON_INT = -(2**30)


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:  # int32 tables; uint8 flags (which hold 0 or 1) get their largest value
        tensor.fill_(_POISON_INT if tensor.dtype == torch.int32 else torch.iinfo(tensor.dtype).max)


def _emulate(config, *arguments) -> None:
    launch_cls = kl.LAUNCHES[type(config)]
    inputs, outputs, _ = launch_cls.argument_roles()
    count = len(inputs) + len(outputs)
    tensors = [torch.from_dlpack(x) for x in arguments[:count]]
    for tensor in tensors[len(inputs):]:
        _poison(tensor)
    run_emulated(launch_cls(config, *tensors, *arguments[count:]))
    with _LOCK:
        LAUNCH_COUNTS[config] += 1


def register_emulated_kernels() -> None:
    """Make the emulation of each kernel config its custom call's CPU implementation, registered when a
    launch of the config is first traced (jax_tvm_ffi holds 1024 handlers: fewer than every config)."""
    import tvm_ffi

    from jax_api.gdp import kernel_calls

    with _LOCK:
        if _DONE:
            return
        kernel_calls.register_on_trace(lambda config: tvm_ffi.convert(functools.partial(_emulate, config)),
                                       platform="cpu", pass_owned_tensor=True)
        _DONE.append(True)
