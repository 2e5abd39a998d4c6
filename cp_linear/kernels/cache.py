"""Compile once per kernel config, keep the compiled function for the process.

``compiled(config)`` compiles the kernel of ``config`` (a frozen dataclass from
``cp_linear.kernels.configs``, which is the whole cache key) with fake tensors whose
sequence/chunk/head extents are symbolic (``cute.sym_int()``), so one compiled function
serves every T, N and H. The functions take framework tensors directly through TVM-FFI
(``--enable-tvm-ffi``) and launch on the framework's current stream. The DSL keeps its own
on-disk cache of compiled modules (``CUTE_DSL_CACHE_DIR``); nothing here bypasses it.

cutlass is imported on first use only: ``import cp_linear.kernels`` stays light.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from cp_linear.kernels import configs as cfg

_COMPILED: dict[Any, Callable] = {}
_COMPILE_SECONDS: dict[Any, float] = {}
_LOCK = threading.Lock()


def _fake_tensor(dtype, shape):
    """Row-major (last axis contiguous) fake tensor; ints are static extents, None symbolic."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    extents = tuple(cute.sym_int() if extent is None else extent for extent in shape)
    return make_fake_compact_tensor(dtype, extents, stride_order=tuple(reversed(range(len(shape)))))


def _fake_arguments(config) -> tuple:
    """Example arguments of the kernel's ``__call__`` (tensors, then scalars; stream is added later)."""
    import cutlass
    from cutlass import Float32, Int32

    from cp_linear.kernels._common import cutlass_dtype

    f32, i32 = cutlass.Float32, cutlass.Int32
    ints = lambda n: tuple(Int32(0) for _ in range(n))  # noqa: E731
    if isinstance(config, cfg.ChunkIndexConfig):
        return tuple(_fake_tensor(i32, (None,)) for _ in range(4)) + ints(1)
    dt = cutlass_dtype(config.dtype) if hasattr(config, "dtype") else None
    K = config.key_dim
    index = (_fake_tensor(i32, (None,)), _fake_tensor(i32, (None,)))  # cu, chunk_offsets
    if isinstance(config, cfg.WYPrepareConfig):
        V = config.value_dim
        return (_fake_tensor(dt, (None, None, K)), _fake_tensor(dt, (None, None, V)),
                _fake_tensor(f32, (None, None)), _fake_tensor(f32, (None, None))) + index + (
                _fake_tensor(i32, (None,)), _fake_tensor(i32, (None,)), _fake_tensor(f32, (None, None, K)),
                _fake_tensor(f32, (None, None, V)), _fake_tensor(f32, (None, None)),
                _fake_tensor(f32, (None, None))) + ints(2)
    if isinstance(config, cfg.StatePassConfig):
        return (_fake_tensor(dt, (None, None, K)), _fake_tensor(f32, (None, None, K)),
                _fake_tensor(f32, (None, None, None)), _fake_tensor(f32, (None, None)),
                _fake_tensor(f32, (None, None))) + index + (
                _fake_tensor(f32, (None, None, K, None)), _fake_tensor(f32, (None, None, K, None)),
                _fake_tensor(f32, (None, None, None)), _fake_tensor(f32, (None, None, K, None))) + ints(11)
    if isinstance(config, cfg.OutputConfig):
        V = config.value_dim
        return (_fake_tensor(dt, (None, None, K)), _fake_tensor(dt, (None, None, K)),
                _fake_tensor(f32, (None, None)),
                _fake_tensor(f32, (None, None, V)), _fake_tensor(f32, (None, None, K, V)),
                _fake_tensor(f32, (None, None))) + index + (
                _fake_tensor(i32, (None,)), _fake_tensor(i32, (None,)), _fake_tensor(dt, (None, None, V)),
                Float32(1.0)) + ints(2)
    if isinstance(config, cfg.AffineFoldConfig):
        return (_fake_tensor(f32, (None, None, K, None)), _fake_tensor(f32, (None, None, None))) + ints(5)
    raise TypeError(f"no kernel for config {config!r}")


def _kernel_object(config):
    if isinstance(config, cfg.ChunkIndexConfig):
        from cp_linear.kernels.chunk_index import ChunkIndexKernel as kernel_class
    elif isinstance(config, cfg.WYPrepareConfig):
        from cp_linear.kernels.wy_prepare import WYPrepareKernel as kernel_class
    elif isinstance(config, cfg.StatePassConfig):
        from cp_linear.kernels.state_pass import StatePassKernel as kernel_class
    elif isinstance(config, cfg.OutputConfig):
        from cp_linear.kernels.output import OutputKernel as kernel_class
    elif isinstance(config, cfg.AffineFoldConfig):
        from cp_linear.kernels.affine_fold import AffineFoldKernel as kernel_class
    else:
        raise TypeError(f"no kernel for config {config!r}")
    return kernel_class(config)


def compile_kernel(config) -> Callable:
    """Compile ``config``'s kernel now (no cache lookup); needs no GPU when CUTE_DSL_ARCH is set."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    config.validate()
    kernel = _kernel_object(config)
    arguments = _fake_arguments(config) + (make_fake_stream(use_tvm_ffi_env_stream=True),)
    return cute.compile(kernel, *arguments, options="--enable-tvm-ffi")


def compiled(config) -> Callable:
    """The compiled function of ``config``, compiling it on first use in this process."""
    function = _COMPILED.get(config)
    if function is not None:
        return function
    with _LOCK:
        function = _COMPILED.get(config)
        if function is None:
            started = time.perf_counter()
            function = compile_kernel(config)
            _COMPILE_SECONDS[config] = time.perf_counter() - started
            _COMPILED[config] = function
    return function


def compile_seconds(config) -> float | None:
    """Seconds the in-process compile of ``config`` took, or None if it was not compiled here."""
    return _COMPILE_SECONDS.get(config)
