"""The stacked value checks (``gdp_value_flag_array``, ``nonfinite_from_bounds``) raise exactly the
flags of the checks one by one (``gdp_value_flags``, ``nonfinite_flag``), in torch (with its one-pass
aminmax), numpy and jax, with the dtype mixes the ops take (bf16 / fp16 q, k, v beside float32 g, beta)."""

import itertools

import numpy as np
import pytest
import torch

from cp_linear.validation import (
    gdp_value_flag_array,
    gdp_value_flags,
    nonfinite_flag,
    nonfinite_from_bounds,
    stacked_bounds,
    value_bounds,
)

# (input index in q, k, v, g, beta; value) written into one element
BAD_VALUES = [None, (0, float("nan")), (1, float("inf")), (2, -float("inf")), (3, float("nan")), (3, 0.5),
              (3, float("inf")), (4, -0.25), (4, 2.5), (4, float("nan")), (4, -float("inf"))]


def _inputs(qkv_dtype, *bad_values):
    """q, k, v, g, beta in range, then each (input index, value) of ``bad_values`` written into one element."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=gen).to(qkv_dtype) for _ in range(3))
    g = -torch.rand(1, 6, 2, generator=gen)
    beta = 2 * torch.rand(1, 6, 2, generator=gen)
    arrays = [q, k, v, g, beta]
    for position, bad in enumerate(bad_values):
        if bad is not None:
            index, value = bad
            arrays[index].view(-1)[position] = value
    return arrays


def _as(namespace, x):
    if namespace == "torch":
        return x
    if namespace == "numpy":
        return x.float().numpy()
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(x.float().numpy()).astype(str(x.dtype).removeprefix("torch."))


@pytest.mark.parametrize("namespace", ["torch", "numpy", "jax"])
@pytest.mark.parametrize("qkv_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stacked_gdp_value_flags_equal_the_checks_one_by_one(namespace, qkv_dtype):
    extrema = torch.aminmax if namespace == "torch" else None
    for first, second in itertools.product(BAD_VALUES, BAD_VALUES[:4]):  # up to two failures at once
        arrays = [_as(namespace, x) for x in _inputs(qkv_dtype, first, second)]
        one_by_one = [bool(f) for f in gdp_value_flags(*arrays, extrema=extrema)]
        stacked = np.asarray(gdp_value_flag_array(*arrays, extrema=extrema)).tolist()
        assert stacked == one_by_one, (first, second)
        assert any(one_by_one) == (first is not None or second is not None)


def test_stacked_nonfinite_flags_equal_the_flags_one_by_one():
    arrays = _inputs(torch.bfloat16, None)
    arrays[1].view(-1)[0] = float("nan")
    arrays[4].view(-1)[2] = -float("inf")
    stacked = nonfinite_from_bounds(*stacked_bounds(arrays, torch.aminmax)).tolist()
    assert stacked == [bool(nonfinite_flag(x, value_bounds(x, torch.aminmax))) for x in arrays]
    assert stacked == [False, True, False, False, True]


def test_an_empty_input_takes_the_checks_one_by_one():
    arrays = _inputs(torch.float32)
    arrays[0] = torch.empty(1, 0, 2, 4)
    assert stacked_bounds(arrays) is None
    assert gdp_value_flag_array(*arrays).tolist() == [False] * 7
    arrays[4].view(-1)[0] = 3.0
    assert gdp_value_flag_array(*arrays).tolist() == [False] * 6 + [True]
