"""Which GDP inputs the tensor-core kernels run: the one policy both frontends' automatic backend
choice reads (``torch_api.gdp.cutedsl.auto_backend``, ``jax_api.gdp.cutedsl.auto_backend``).

The frontends add the platform half (a Hopper GPU, sm_90; the DSL installed); this module holds
the configuration half, on plain values so that it needs neither torch nor jax:

    dtype          bfloat16 or float16 q / k / v (one dtype)
    K, V           in ``HEAD_DIMS`` = (64, 128)
    n_h            in ``AUTO_HOUSEHOLDERS`` = (1, 2, 3): the Householder counts the kernels are
                   checked at on the H200 (the kernels compile for any n_h <= 64; an explicit
                   ``CuTeDSLGatedDeltaProductCPBackend`` still takes those)
"""

from __future__ import annotations

from cp_linear.kernels.configs import HEAD_DIMS

KERNEL_DTYPES = ("bfloat16", "float16")
AUTO_HOUSEHOLDERS = (1, 2, 3)
HOPPER_MAJOR = 9


def capability_reason(major: int, minor: int) -> str | None:
    """Why a GPU of compute capability ``major.minor`` cannot run the kernels (None for sm_90)."""
    if major != HOPPER_MAJOR:
        return f"the kernels are built for sm_90a (Hopper); the GPU reports compute capability {major}.{minor}"
    return None


def config_reason(dtype_names, key_dim: int, value_dim: int, num_householder: int) -> str | None:
    """Why the kernels are not chosen for q / k / v of dtypes ``dtype_names`` (names such as
    "bfloat16"), head sizes K, V and ``num_householder`` (None when they are). One line."""
    dtype_names = tuple(dtype_names)
    if len(set(dtype_names)) != 1:
        return f"the kernels need q, k and v of one dtype; received {', '.join(dtype_names)}"
    if dtype_names[0] not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 q/k/v; received {dtype_names[0]}"
    if key_dim not in HEAD_DIMS or value_dim not in HEAD_DIMS:
        return f"the kernels support K, V in {HEAD_DIMS}; received K = {key_dim}, V = {value_dim}"
    if num_householder not in AUTO_HOUSEHOLDERS:
        return (f"the automatic choice takes the kernels for num_householder in {AUTO_HOUSEHOLDERS}; "
                f"received {num_householder}")
    return None


__all__ = ["AUTO_HOUSEHOLDERS", "KERNEL_DTYPES", "capability_reason", "config_reason"]
