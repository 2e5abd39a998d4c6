"""The CuTeDSL kernels as XLA custom calls: one ``jax.ffi.ffi_call`` per typed launch.

A launch of ``cp_linear.kernels.launch`` (``ChunkPrepLaunch``, ``ChunkScanLaunch``, ...) lists the
kernel's arguments in order: input tensors, output tensors (``OUTPUTS``), scalars. ``launch``
turns one into a custom call whose operands are the inputs, whose results are the outputs
(buffers XLA allocates) and whose attributes are the scalars::

    ChunkPrepLaunch(config, q, k, ..., ta, tb, p, scalars, scale, use_l2, num_householder)
        -> ffi_call("cp_linear_ChunkPrepConfig_bfloat16_K_128_NQ_32", results (ta, tb, p, scalars))
               (q, k, ..., scale=f32, use_l2=i32, num_householder=i32)

The target is the kernel's TVM-FFI function, the very object the torch frontend calls
(``cp_linear.kernels.cache.compiled(config)``: compiled once per config, or loaded from the
prebuilt library), registered with XLA through ``jax_tvm_ffi`` with the argument order
``["args", "rets", "attrs.<scalar>", ...]``. At run time XLA hands the handler its device
buffers and its stream; the handler wraps them as DLTensors (no copy), sets the stream as the
TVM-FFI environment stream and calls the function, which launches on it. No host round trip, no
copy, and shapes, scalars and packings are run-time values: one registration per config serves
every call.

Registration happens when a launch is traced in a process whose default JAX backend is a GPU
(the kernel is compiled, or loaded, then). Elsewhere nothing is registered: the program still
lowers for CUDA (``.lower(lowering_platforms=("cuda",))``), and the CPU tests register their own
implementation of each target for the CPU platform (``register_kernel(..., platform="cpu")``:
the torch emulation of the launch), so the whole traced program, custom calls included, runs on
the CPU unchanged.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl

_SCALAR_TYPES = {"float32": np.float32, "int32": np.int32}
_TENSOR_TYPES = {"float32": jnp.float32, "int32": jnp.int32, "uint8": jnp.uint8, "bfloat16": jnp.bfloat16,
                 "float16": jnp.float16}
_REGISTERED: dict[tuple[str, str], Any] = {}  # (target, platform) -> the registered function (kept alive)
_ON_TRACE: dict[str, tuple] = {}  # platform -> (config -> function, pass_owned_tensor): ``register_on_trace``
_LOCK = threading.Lock()


def target_name(config, *, cuda_graph: bool = False) -> str:
    """XLA custom-call target of ``config``'s kernel, e.g. ``cp_linear_SegmentFoldConfig_K_128``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", kcfg.describe(config)).strip("_")
    return f"cp_linear_{slug}" + ("_graph" if cuda_graph else "")


def argument_spec(launch_cls) -> list[str]:
    """``jax_tvm_ffi`` argument order: operands, results, then each scalar attribute by name."""
    _, _, scalars = launch_cls.argument_roles()
    return ["args", "rets", *(f"attrs.{name}" for name in scalars)]


def register_kernel(config, function, *, platform: str = "gpu", cuda_graph: bool = False,
                    pass_owned_tensor: bool = False) -> str:
    """Register ``function`` (a TVM-FFI function taking the launch's arguments in order) as the
    implementation of ``config``'s custom call on ``platform``; returns the target name.

    The product registers the compiled kernels for "gpu" (``ensure_registered``); the CPU tests
    register emulations for "cpu" through here (the one injection point). Registering a target
    twice for one platform keeps the first."""
    import jax_tvm_ffi

    name = target_name(config, cuda_graph=cuda_graph)
    with _LOCK:
        if (name, platform) not in _REGISTERED:
            jax_tvm_ffi.register_ffi_target(name, function, argument_spec(kl.LAUNCHES[type(config)]),
                                            platform=platform, allow_cuda_graph=cuda_graph,
                                            pass_owned_tensor=pass_owned_tensor)
            _REGISTERED[(name, platform)] = function
    return name


def ensure_registered(config, *, cuda_graph: bool = False) -> str:
    """Compile (or load) ``config``'s kernel and register it for the GPU platform, once per process."""
    name = target_name(config, cuda_graph=cuda_graph)
    if (name, "gpu") not in _REGISTERED:
        from cp_linear.kernels.cache import compiled

        register_kernel(config, compiled(config), platform="gpu", cuda_graph=cuda_graph)
    return name


def register_on_trace(make_function, *, platform: str = "cpu", pass_owned_tensor: bool = False) -> None:
    """Register ``make_function(config)`` as ``config``'s implementation on ``platform`` when a launch of it is
    first traced (the CPU tests' emulations). Only the configs a process uses take a handler: jax_tvm_ffi
    holds at most 1024, fewer than the library's configs (with and without containment, graph or not)."""
    _ON_TRACE[platform] = (make_function, pass_owned_tensor)


def registered_targets(platform: str = "gpu") -> list[str]:
    """Targets registered for ``platform`` in this process."""
    return sorted(name for name, where in _REGISTERED if where == platform)


def _registers_here() -> bool:
    """Launches traced here register their kernels: the default backend is a GPU."""
    return jax.default_backend() in ("gpu", "cuda")


# --------------------------------------------------------------------------- varying manual axes


def _varying_axes(x) -> frozenset:
    """The shard_map axes ``x`` varies over (empty outside shard_map)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax >= 0.10 keeps them in the aval's manual axis type
        vma = getattr(getattr(aval, "mat", None), "varying", ())
    return frozenset(vma or ())


def _make_varying(x, axes: frozenset):
    """``x`` typed as varying over ``axes`` (a no-op at run time)."""
    missing = tuple(sorted(axes - _varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def match_varying(*arrays) -> tuple:
    """``arrays`` typed alike inside ``shard_map``: each varying over every axis any of them varies
    over (None passes through). A no-op at run time and outside shard_map; the transpose of the cast
    sums an unvarying input's gradient over those axes (a replicated weight's gradient, for one)."""
    axes = frozenset().union(*(_varying_axes(x) for x in arrays if x is not None))
    return tuple(None if x is None else _make_varying(x, axes) for x in arrays)


# --------------------------------------------------------------------------- one launch


def _check_tensor(launch_cls, config, name: str, spec: kl.TensorSpec, shape, dtype) -> None:
    expected = _TENSOR_TYPES[config.dtype if spec.dtype == "input" else spec.dtype]
    extents = tuple(kl._extent(config, entry) for entry in spec.shape)
    bad = jnp.dtype(dtype) != jnp.dtype(expected) or len(shape) != len(extents) or any(
        want is not None and got != want for got, want in zip(shape, extents))
    if bad:
        wanted = ", ".join("?" if e is None else str(e) for e in extents)
        raise ValueError(f"{launch_cls.__name__}.{name} must be {jnp.dtype(expected).name} [{wanted}]; received "
                         f"{jnp.dtype(dtype).name} {list(shape)}")


def launch(launch_cls, config, *, inputs: Mapping[str, Any], results: Mapping[str, tuple], scalars: Mapping[str, Any],
           cuda_graph: bool = False) -> dict[str, jax.Array]:
    """Run one kernel launch as an XLA custom call -> its outputs by name.

    inputs: every input tensor of the launch by name (jax arrays); results: every output tensor
    by name as a shape tuple (the dtype comes from the launch's spec); scalars: every scalar by
    name (host numbers). Shapes and dtypes are checked against the launch's specs at trace time.
    Inside ``shard_map`` the operands are typed alike (varying over every axis any of them varies
    over) and so are the results.
    """
    input_names, output_names, scalar_names = launch_cls.argument_roles()
    if (tuple(inputs), tuple(results), tuple(scalars)) != (input_names, output_names, scalar_names):
        raise ValueError(f"{launch_cls.__name__} takes inputs {input_names}, outputs {output_names} and scalars "
                         f"{scalar_names}; received {tuple(inputs)}, {tuple(results)}, {tuple(scalars)}")
    specs = dict(launch_cls.argument_specs())
    shapes = {}
    for name, array in inputs.items():
        _check_tensor(launch_cls, config, name, specs[name], array.shape, array.dtype)
    for name, shape in results.items():
        spec = specs[name]
        dtype = _TENSOR_TYPES[config.dtype if spec.dtype == "input" else spec.dtype]
        _check_tensor(launch_cls, config, name, spec, tuple(shape), dtype)
        shapes[name] = jax.ShapeDtypeStruct(tuple(int(e) for e in shape), dtype)
    attributes = {name: _SCALAR_TYPES[specs[name].dtype](value) for name, value in scalars.items()}
    axes = frozenset().union(*(_varying_axes(x) for x in inputs.values()))
    operands = [_make_varying(x, axes) for x in inputs.values()]
    if _registers_here():
        name = ensure_registered(config, cuda_graph=cuda_graph)
    else:
        name = target_name(config, cuda_graph=cuda_graph)
    for platform, (make_function, owned) in list(_ON_TRACE.items()):
        if (name, platform) not in _REGISTERED:
            register_kernel(config, make_function(config), platform=platform, cuda_graph=cuda_graph,
                            pass_owned_tensor=owned)
    outputs = jax.ffi.ffi_call(name, tuple(shapes.values()))(*operands, **attributes)
    return {key: _make_varying(value, axes) for key, value in zip(shapes, outputs)}



__all__ = ["argument_spec", "ensure_registered", "launch", "match_varying", "register_kernel", "register_on_trace",
           "registered_targets", "target_name"]
