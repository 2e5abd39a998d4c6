"""Compile once per kernel config, keep the compiled function for the process.

``compiled(config)`` compiles the kernel of ``config`` (a frozen dataclass from
``cp_linear.kernels.configs``, which is the whole cache key) with fake tensors derived from the
kernel's typed launch (``cp_linear.kernels.launch``), whose sequence/chunk/head extents are
symbolic (``cute.sym_int()``), so one compiled function serves every T, N and H. The functions take framework tensors directly through TVM-FFI
(``--enable-tvm-ffi``) and launch on the framework's current stream.

A prebuilt kernel library skips compilation: ``python -m cp_linear.kernels --compile --library
DIR`` compiles every config (no GPU needed) and exports each as ``DIR/<config>-<hash>.so``;
with ``CP_LINEAR_KERNEL_LIBRARY=DIR`` set, ``compiled`` loads the matching file instead of
compiling. The hash covers the kernel sources and the DSL version, so a stale library is never
used (the kernel is compiled instead).

cutlass is imported on first use only: ``import cp_linear.kernels`` stays light.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cp_linear.kernels import configs as cfg

_COMPILED: dict[Any, Callable] = {}
_COMPILE_SECONDS: dict[Any, float] = {}
_LOCK = threading.Lock()


def compile_kernel(config) -> Callable:
    """Compile ``config``'s kernel now (no cache lookup); needs no GPU when CUTE_DSL_ARCH is set."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from cp_linear.kernels import launch

    config.validate()
    kernel = launch.kernel_class(config)(config)  # arguments derived from the launch's typed specs
    arguments = launch.fake_arguments(config) + (make_fake_stream(use_tvm_ffi_env_stream=True),)
    return cute.compile(kernel, *arguments, options="--enable-tvm-ffi")


LIBRARY_ENV = "CP_LINEAR_KERNEL_LIBRARY"
_SOURCE_HASH: list[str] = []
# host-side modules: editing them cannot change a compiled kernel
_HOST_SOURCES = {"__init__.py", "__main__.py", "cache.py", "launch.py", "emulation.py", "emulation_backward.py",
                 "backward_algorithm.py"}


def _source_hash(config) -> str:
    """Hash of the device-code modules (every kernel and its helpers) and the DSL version: the
    staleness key of a prebuilt library. Kernels import each other's helpers, so one hash covers all."""
    if not _SOURCE_HASH:
        from importlib.metadata import version

        digest = hashlib.sha256(version("nvidia-cutlass-dsl").encode())
        for path in sorted(Path(__file__).parent.glob("*.py")):
            if path.name not in _HOST_SOURCES:
                digest.update(path.name.encode() + path.read_bytes())
        _SOURCE_HASH.append(digest.hexdigest()[:12])
    return _SOURCE_HASH[0]


def artifact_name(config) -> str:
    """File stem of ``config``'s kernel in a prebuilt library, e.g. ``ChunkScanConfig-bfloat16-K-128-...-<hash>``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cfg.describe(config)).strip("-")
    return f"{slug}-{_source_hash(config)}"


def _symbol(stem: str) -> str:
    return "cp_linear_" + stem.replace("-", "_")


def export_kernel(config, directory: str) -> tuple[Path, Callable]:
    """Compile ``config``'s kernel and write it to ``directory`` as a loadable shared object
    -> (the shared object's path, the compiled function)."""
    function = compile_kernel(config)
    stem = artifact_name(config)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    obj = target / f"{stem}.o"
    # a unique symbol per kernel, and internal symbols hidden: libraries loaded into one process
    # must not resolve each other's internals (one module's cubin would serve another's launch)
    function.export_to_c(str(obj), function_name=_symbol(stem), export_only_tvm_ffi_symbols=True)
    library = target / f"{stem}.so"
    subprocess.run(["cc", "-shared", "-o", str(library), str(obj)], check=True, capture_output=True)
    obj.unlink()
    return library, function


def _load_prebuilt(config) -> Callable | None:
    directory = os.environ.get(LIBRARY_ENV)
    if not directory:
        return None
    library = Path(directory) / f"{artifact_name(config)}.so"
    if not library.exists():
        return None
    from cutlass.runtime import load_module

    try:
        return getattr(load_module(str(library), enable_tvm_ffi=True), _symbol(library.stem))
    except Exception as err:  # an unloadable library entry is compiled instead, never fatal
        import warnings

        warnings.warn(f"could not load {library} ({type(err).__name__}: {err}); compiling instead", stacklevel=3)
        return None


def compiled(config) -> Callable:
    """The compiled function of ``config``: loaded from the prebuilt library when it holds an
    up-to-date one, else compiled on first use in this process."""
    function = _COMPILED.get(config)
    if function is not None:
        return function
    with _LOCK:
        function = _COMPILED.get(config)
        if function is None:
            started = time.perf_counter()
            function = _load_prebuilt(config) or compile_kernel(config)
            _COMPILE_SECONDS[config] = time.perf_counter() - started
            _COMPILED[config] = function
    return function


def compile_seconds(config) -> float | None:
    """Seconds the in-process compile of ``config`` took, or None if it was not compiled here."""
    return _COMPILE_SECONDS.get(config)
