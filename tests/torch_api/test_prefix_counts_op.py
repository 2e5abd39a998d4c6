"""``cp_linear::prefix_counts`` (``torch_api._prefix_counts``): the containment's flag counts as a torch custom op.
It equals a numpy cumsum, passes ``opcheck``, and a compiled graph of the range flags calls it instead of a cumsum
that Inductor would lower to its own Triton scan (whose codegen failed on these on torch 2.11)."""

import numpy as np
import pytest
import torch

from cp_linear import validation
from torch_api._prefix_counts import prefix_counts


@pytest.mark.parametrize("tokens", [0, 1, validation._SCAN_BLOCK - 1, validation._SCAN_BLOCK, 1000])
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_prefix_counts_op_equals_numpy_cumsum_and_passes_opcheck(tokens, dtype):
    flags = (torch.rand(2, 3, tokens, generator=torch.Generator().manual_seed(tokens)) < 0.3).to(dtype)
    expected = np.concatenate([np.zeros((2, 3, 1), np.int64), np.cumsum(flags.numpy().astype(np.int64), -1)], -1)
    counts = prefix_counts(flags)
    assert counts.dtype == torch.int32 and counts.is_contiguous()
    np.testing.assert_array_equal(counts.numpy(), expected)
    np.testing.assert_array_equal(validation._prefix_counts(flags).numpy(), expected)  # eager: the plain scans
    torch.library.opcheck(prefix_counts, (flags,))


def _compiled_graph(fn, *args) -> str:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def test_compiled_range_flags_call_the_op_and_no_cumsum():
    flags = torch.rand(1, 600, 4, generator=torch.Generator().manual_seed(0)) < 0.05  # [B, T, H]
    start = torch.tensor([0, 5, 300, 599])
    stop = torch.tensor([3, 520, 300, 600])
    sequence_start = torch.zeros(600, dtype=torch.int64)
    sequence_start[250:] = 250
    for fn, args in ((validation.any_in_ranges, (flags, start, stop)),
                     (validation.gdp_token_poison, (flags, torch.zeros_like(flags), sequence_start))):
        graph = _compiled_graph(fn, *args)
        assert "cp_linear.prefix_counts" in graph
        assert "cumsum" not in graph
