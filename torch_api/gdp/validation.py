"""Input checks shared by the GDP entry points; each returns an error message (None when fine).

Returning messages instead of raising lets the CP frontend fold a local failure into one
cross-rank agreement (``torch_api._dist.agree_or_raise``) so that every rank raises together.
"""

from __future__ import annotations

import math
import struct

import torch

from cp_linear.gdp import MAX_KEY_DIM, check_gdp_shapes  # noqa: F401 (MAX_KEY_DIM re-exported)
from cp_linear.validation import describe_failed, gdp_dims_error
from cp_linear.validation import GDP_VALUE_CHECKS, gdp_value_flag_array
from torch_api._dist import nonfinite_flags, read_value_flags, value_flags_tensor  # noqa: F401 (re-export)

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 0)


def float_bits(value: float) -> int:
    """A float as an int64 bit pattern (for cross-rank agreement signatures)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def gdp_input_error(q, k, v, g, beta, *, num_householder, scale, cu_seqlens=None) -> str | None:
    """Shapes, dtypes, devices and limits of one GDP call (docs/design.md §2); no values are read.
    Limits and empty sizes come from ``cp_linear.validation`` (shared with jax_api)."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor; received {type(x).__name__}"
    try:
        check_gdp_shapes(q.shape, k.shape, v.shape, g.shape, beta.shape, num_householder)
    except ValueError as err:
        return str(err)
    batch = q.shape[0]
    error = gdp_dims_error(q.shape, v.shape)
    if error:
        return error
    for name, x in named.items():
        if x.dtype not in INPUT_DTYPES:
            return f"{name} must be float32, bfloat16 or float16; received {x.dtype}"
    if not q.dtype == k.dtype == v.dtype:
        return f"q, k and v must share one dtype; received {q.dtype}, {k.dtype}, {v.dtype}"
    devices = {name: x.device for name, x in named.items()}
    if len(set(devices.values())) != 1:
        return f"inputs must live on one device; received {devices}"
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        return f"scale must be a finite float; received {scale!r}"
    if cu_seqlens is not None:  # the values are read by the one-device op only (cp_linear.gdp.cu_seqlens_error)
        if not isinstance(cu_seqlens, torch.Tensor):
            return f"cu_seqlens must be a torch.Tensor; received {type(cu_seqlens).__name__}"
        if batch != 1:
            return f"cu_seqlens needs a packed batch (B = 1); received B = {batch}"
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            return f"cu_seqlens must be 1-D with at least 2 entries; received shape {tuple(cu_seqlens.shape)}"
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            return f"cu_seqlens must be int32 or int64; received {cu_seqlens.dtype}"
    return None


def gdp_value_flags(q, k, v, g, beta) -> torch.Tensor:
    """bool [7] on the inputs' device, in ``cp_linear.validation.GDP_VALUE_CHECKS`` order (no host read).

    One kernel launch (``cp_linear.kernels.value_checks``) where ``_kernel_checks_available``, else
    five torch reductions and the comparisons on their bounds (~19 operations)."""
    if _kernel_checks_available(q, k, v, g, beta):
        return _kernel_value_flags(q, k, v, g, beta)
    return gdp_value_flag_array(q, k, v, g, beta, extrema=torch.aminmax)


_INT32_ELEMENTS = 2**31  # the kernel indexes its 1-D views with int32


def _kernel_checks_available(q, k, v, g, beta) -> bool:
    """The value-checks kernel takes these tensors: q / k / v of one kernel dtype on a device that runs
    the kernels (``_kernel_platform_ready``), every tensor there, contiguous, 16-byte aligned (the kernel
    reads 16-byte vectors; a view into a larger tensor may not be), non-empty and indexable with int32."""
    from cp_linear.kernel_support import KERNEL_DTYPES

    if not q.dtype == k.dtype == v.dtype or str(q.dtype).removeprefix("torch.") not in KERNEL_DTYPES:
        return False
    if not _kernel_platform_ready(q.device):
        return False
    return all(x.device == q.device and x.is_contiguous() and 0 < x.numel() < _INT32_ELEMENTS
               and x.data_ptr() % 16 == 0 for x in (q, k, v, g, beta))


def _kernel_platform_ready(device: torch.device) -> bool:
    """A CUDA device the kernels run on (the kernel backend's platform check: Hopper, the DSL installed),
    and no ``torch.compile`` tracing (the launch is no traceable op)."""
    if device.type != "cuda":
        return False
    from torch_api.gdp import cutedsl

    return not cutedsl._compiling() and cutedsl.kernel_platform_reason(device) is None


def _kernel_value_flags(q, k, v, g, beta) -> torch.Tensor:
    """The checks in one launch: the kernel ORs 1 into a zeroed int32 [7] at every failed check."""
    from cp_linear.kernels import configs as kcfg
    from cp_linear.kernels import launch as kl
    from torch_api.gdp import cutedsl

    flags = torch.zeros(len(GDP_VALUE_CHECKS), dtype=torch.int32, device=q.device)
    config = kcfg.ValueChecksConfig(str(q.dtype).removeprefix("torch."))
    # float32 g / beta as they are (.float() returns the tensor itself), others as a float32 copy; detached,
    # as DLPack exports no tensor that requires grad
    flat = [x.detach().view(-1) for x in (q, k, v, g.float(), beta.float())]
    kl.ValueChecksLaunch.of(config, *flat, flags, sm_count=cutedsl._sm_count(q.device)).run()
    return flags != 0


def initial_state_error(initial_state, sequences: int, q, v, *, rows: str = "") -> str | None:
    """Why ``initial_state`` is not a floating [N, H, K, V] tensor on q's device (N = ``sequences``),
    or None; ``rows`` says what a row is (appended to the shape message)."""
    expected = (sequences, q.shape[2], q.shape[3], v.shape[3])
    if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
        shape = tuple(getattr(initial_state, "shape", ()))
        return (f"initial_state must be a tensor [N, H, K, V] = {expected}{rows}; received "
                f"{type(initial_state).__name__} of shape {shape}")
    if not initial_state.is_floating_point() or initial_state.device != q.device:
        return (f"initial_state must be floating point on {q.device}; received {initial_state.dtype} on "
                f"{initial_state.device}")
    return None


def raise_failed_checks(checks, flags: torch.Tensor, what: str) -> None:
    """One host read of ``flags``; ValueError naming every failed check (one-device ops)."""
    message = describe_failed(checks, read_value_flags(flags))
    if message:
        raise ValueError(f"{what}: {message}")


class PendingValueChecks:
    """Value-check flags on their way to the host: copied without blocking as soon as they are computed,
    read by ``raise_if_failed`` after the caller has queued its kernels. The host then waits for the
    checks alone, and the GPU keeps the queued work; reading them first would drain the queue and leave
    the GPU idle while the host launches the step. Only for work that cannot hang on bad values (one
    device, no collective): the kernels then compute on them, and the error is raised all the same."""

    def __init__(self, checks, flags: torch.Tensor, what: str):
        self.checks, self.what, self.ready = checks, what, None
        self.flags = flags
        if flags.is_cuda:
            self.flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.flags.copy_(flags, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def raise_if_failed(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        raise_failed_checks(self.checks, self.flags, self.what)


def check_gdp_inputs(inputs) -> None:
    """Raise ValueError for a ``GDPInputs`` whose shapes, dtypes or cu_seqlens are wrong (host only)."""
    error = gdp_input_error(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta,
                            num_householder=inputs.num_householder, scale=inputs.scale, cu_seqlens=inputs.cu_seqlens)
    if error:
        raise ValueError(error)
