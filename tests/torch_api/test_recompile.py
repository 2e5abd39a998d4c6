"""``torch.compile`` of ``HybridDecoder`` does not recompile for a new packing of the same length.

A graph-ready layout (``build_shard_layout(..., max_sequences=M)``) gives every tensor a step reads
a shape fixed by (T, cp_size, M), so dynamo traces the forward (and AOTAutograd the backward) once
and later packings hit its guards. Counted by a backend that counts the graphs it is handed, and by
dynamo's own ``unique_graphs``; a different total length must add a graph, which shows the counter
counts. Compiled results equal eager ones on every packing. One device here; CP on the session's
2-rank gloo pool (timeouts on every task and collective). ``aot_eager``: dynamo + AOTAutograd
(fake kernels, the registered backwards), without inductor's C++ compiler on two cores.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.tolerance import assert_within, decoder_length, rel_err, tolerance
from torch_api.layers import DecoderConfig, HybridDecoder, build_shard_layout

UNCHECKED = dict(gdp_options={"cp_check_inputs": False}, attention_options={"check_inputs": False})
TOTAL = 48
MAX_SEQUENCES = 6
# three packings of T = 48: documents crossing the rank boundary (cp 2: L = 24), padding (id 0)
# inside and at the end, one document filling everything
PACKINGS = {
    "two-docs-across-ranks": [(1, 10), (2, 38)],
    "padding-inside-and-at-end": [(1, 5), (0, 3), (2, 20), (3, 17), (0, 3)],
    "one-doc": [(1, 48)],
}


def _ids(runs) -> np.ndarray:
    return np.repeat([doc for doc, _ in runs], [length for _, length in runs])


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it, then runs aot_eager."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)


def _model(seed=0):
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=2, num_heads=2, head_dim=8, num_kv_heads=1)
    return config, HybridDecoder(config, **UNCHECKED)


def _step(model, tokens, layout):
    """(logits, parameter gradients) of one forward + backward (this rank's, not reduced)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens, layout=layout)
    logits.float().square().mean().backward()
    return logits.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def compile_counts(rank, world, group=None, other_length=True):
    """Per packing: (graphs counted by the backend, dynamo's unique_graphs, logits error, gradient
    error against eager); then (with ``other_length``) the counts after a different total length."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config, model = _model()
    backend = CountingBackend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    local = TOTAL // world
    tokens = torch.randint(0, 13, (1, TOTAL), generator=torch.Generator().manual_seed(1))
    tokens = tokens[:, rank * local:(rank + 1) * local]
    results = {}
    for name, runs in PACKINGS.items():
        layout = build_shard_layout(total_len=TOTAL, doc_ids=_ids(runs), cp_group=group,
                                    max_sequences=MAX_SEQUENCES).materialize("cpu")
        if group is not None:
            model.agree(tokens, layout=layout)  # eager, once per batch (the compiled step sends no header)
        eager_logits, eager_grads = _step(model, tokens, layout)
        compiled_logits, compiled_grads = _step(compiled, tokens, layout)
        results[name] = (backend.graphs, counters["stats"]["unique_graphs"], rel_err(compiled_logits, eager_logits),
                         rel_err(compiled_grads, eager_grads))
    results["config"] = config
    if not other_length:
        return results
    # sanity: a new total length changes the shapes, so the same counters must see a new graph
    longer = 2 * TOTAL
    tokens = torch.randint(0, 13, (1, longer // world), generator=torch.Generator().manual_seed(2))
    layout = build_shard_layout(total_len=longer, doc_ids=np.repeat([1, 2], [30, longer - 30]), cp_group=group,
                                max_sequences=MAX_SEQUENCES).materialize("cpu")
    if group is not None:
        model.agree(tokens, layout=layout)
    _step(compiled, tokens, layout)
    results["other-length"] = (backend.graphs, counters["stats"]["unique_graphs"])
    return results


def _check(results, who: str):
    config = results.pop("config")
    other = results.pop("other-length", None)
    seen = {name: value[:2] for name, value in results.items()}
    # aot_eager: forward and backward graphs come from one dynamo graph, so both counts stay 1
    assert all(counts == (1, 1) for counts in seen.values()), f"{who}: (backend graphs, unique_graphs) per packing {seen}"
    if other is not None:
        assert other == (2, 2), f"{who}: a new total length should compile a second graph; counted {other}"
    # the same float32 ops, AOTAutograd may reorder independent work
    tol = tolerance(decoder_length(config, TOTAL) + config.vocab_size * TOTAL, compared_with="rounded")
    for name, (_, _, logits_err, grad_err) in results.items():
        assert_within(f"{who} {name} logits", logits_err, tol)
        assert_within(f"{who} {name} gradients", grad_err, tol)


def test_compiled_decoder_on_one_device_compiles_once_for_every_packing_of_one_length():
    _check(compile_counts(0, 1), "one device")


def _cp_counts(rank, world):
    # the one-device test shows that the counters see a new graph; skipping it here saves a compile
    return compile_counts(rank, world, dist.group.WORLD, other_length=False)


@pytest.mark.multirank
def test_compiled_decoder_under_cp_compiles_once_for_every_packing_of_one_length(gloo_pools):
    for rank, results in enumerate(gloo_pools(2).run(_cp_counts)):
        _check(results, f"rank {rank}")
