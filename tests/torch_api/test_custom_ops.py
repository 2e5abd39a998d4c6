"""The custom ops (``torch_api.gdp.library``, ``torch_api.attention.library``): ``torch.library.opcheck``
(schema, fake kernels, registered autograd), ``torch.compile(fullgraph=True)`` of the hybrid decoder
under CP against eager, and the number of agreement collectives in a step.

The multi-rank checks run as one task in the 2-rank gloo pool (one process group, several cases);
the pool times every task and collective out. torch.compile uses the ``aot_eager`` backend: it
traces with dynamo (a graph break fails ``fullgraph=True``) and AOTAutograd (fake kernels, the
registered backward) without paying for inductor's C++ compiler on the CI's two cores.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_api._dist as tdist
from tests.tolerance import assert_within, decoder_length, rel_err, tolerance
from torch_api.attention.blockdiag import prepare_blockdiag
from torch_api.attention.library import routing_name
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.library import backend_name
from torch_api.layers import DecoderConfig, HybridDecoder, build_shard_layout

LOCAL = 12


def _gdp_inputs(batch, tokens, heads=2, key_dim=8, value_dim=6, n_h=2, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).requires_grad_()

    return (leaf(batch, tokens, heads, key_dim), leaf(batch, tokens * n_h, heads, key_dim),
            leaf(batch, tokens * n_h, heads, value_dim), (-torch.rand(batch, tokens, heads, generator=generator)
                                                          ).requires_grad_(),
            torch.rand(batch, tokens * n_h, heads, generator=generator).requires_grad_())


@pytest.mark.parametrize("packed", [True, False], ids=["packed-initial-state", "rows"])
def test_one_device_gdp_op_passes_opcheck(packed):
    q, k, v, g, beta = _gdp_inputs(1 if packed else 2, 11)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32) if packed else None
    initial = torch.randn(2, 2, 8, 6).requires_grad_() if packed else None
    args = (q, k, v, g, beta, cu, initial, 8 ** -0.5, 2, packed, backend_name(TorchGDPBackend()))
    torch.library.opcheck(torch.ops.cp_linear.gdp_forward.default, args)


def _decoder(seed=0):
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=4, num_heads=2, head_dim=8, num_kv_heads=1)
    return config, HybridDecoder(config)


def _step(model, tokens, layout, total):
    """Loss piece of this rank and the all-reduced parameter gradients."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens, layout=layout)
    loss = logits.float().square().sum() / (total * logits.shape[-1])
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)
    return loss.detach(), grads


def custom_op_cases(rank, world):
    group = dist.group.WORLD
    total = world * LOCAL
    results = {}

    # opcheck of the CP GDP op (collectives inside run in the same order on both ranks)
    q, k, v, g, beta = _gdp_inputs(1, LOCAL, seed=rank)
    cu = torch.tensor([0, 5, LOCAL], dtype=torch.int32)
    span = torch.tensor([0, world], dtype=torch.int32)
    args = (q, k, v, g, beta, cu, span, 8 ** -0.5, 2, True, backend_name(TorchGDPBackend()), group.group_name)
    torch.library.opcheck(torch.ops.cp_linear.gdp_cp_forward.default, args)

    # opcheck of the attention op (a2a routing, a document across the ranks, padding)
    doc_ids = np.repeat([1, 2, 0], [5, total - 8, 3])
    routing = prepare_blockdiag(doc_ids, group, "a2a")
    generator = torch.Generator().manual_seed(rank)
    qa = torch.randn(1, LOCAL, 4, 8, generator=generator).requires_grad_()
    ka, va = (torch.randn(1, LOCAL, 2, 8, generator=generator).requires_grad_() for _ in range(2))
    torch.library.opcheck(torch.ops.cp_linear.blockdiag_attention.default,
                          (qa, ka, va, routing_name(routing), 0.0, "sdpa"))

    # torch.compile(fullgraph=True) of the decoder under CP == eager, for two packings of one length
    config, model = _decoder()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 13, (1, total), generator=torch.Generator().manual_seed(3))
    shard = tokens[:, rank * LOCAL:(rank + 1) * LOCAL]
    packings = {"three-docs": np.repeat([1, 2, 3], [5, total - 9, 4]),
                "one-doc-and-padding": np.repeat([1, 0], [total - 2, 2])}
    for name, ids in packings.items():
        layout = build_shard_layout(total_len=total, doc_ids=ids, cp_group=group)
        layout.materialize("cpu", hidden_shape=(1, LOCAL, config.hidden_size), dtype=torch.float32)
        eager_loss, eager_grads = _step(model, shard, layout, total)
        compiled_loss, compiled_grads = _step(compiled, shard, layout, total)
        results[name] = (rel_err(compiled_loss, eager_loss), rel_err(compiled_grads, eager_grads))
    results["config"] = config
    return results


def count_agreements(rank, world, num_layers):
    """Agreement collectives in two training steps of one batch (one layout) of a decoder."""
    calls = []
    original = tdist.agree_or_raise

    def spy(*args, **kwargs):
        calls.append(kwargs.get("what", ""))
        return original(*args, **kwargs)

    import torch_api.attention.blockdiag as attention_module
    import torch_api.gdp.cp as gdp_module
    import torch_api.layers.layout as layout_module

    modules = (attention_module, gdp_module, layout_module)  # every caller of the agreement
    for module in modules:
        module.agree_or_raise = spy
    try:
        torch.manual_seed(0)
        config = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=num_layers, num_heads=2, head_dim=8,
                               num_kv_heads=1)
        model = HybridDecoder(config)
        total = world * LOCAL
        layout = build_shard_layout(total_len=total, doc_ids=np.repeat([1, 2], [7, total - 7]),
                                    cp_group=dist.group.WORLD)
        tokens = torch.randint(0, 13, (1, LOCAL), generator=torch.Generator().manual_seed(rank))
        per_step = []
        for _ in range(2):
            before = len(calls)
            model(tokens, layout=layout).square().mean().backward()
            per_step.append(len(calls) - before)
    finally:
        for module in modules:
            module.agree_or_raise = original
    return per_step


@pytest.mark.multirank
def test_custom_ops_pass_opcheck_and_the_compiled_decoder_equals_eager_under_cp(gloo_pools):
    for rank, results in enumerate(gloo_pools(2).run(custom_op_cases)):
        config = results.pop("config")
        # the same float32 ops in another order at most (AOTAutograd may reorder independent work)
        tol = tolerance(decoder_length(config, 2 * LOCAL) + config.vocab_size * 2 * LOCAL, compared_with="rounded")
        for name, (loss_err, grad_err) in results.items():
            assert_within(f"rank {rank} {name} loss", loss_err, tol)
            assert_within(f"rank {rank} {name} gradients", grad_err, tol)


@pytest.mark.multirank
def test_agreement_runs_once_per_batch_whatever_the_depth(gloo_pools):
    """A decoder of 2 or 6 layers (GDP and attention, forward and backward) agrees once in its first
    step and never again for the same batch."""
    pool = gloo_pools(2)
    for layers in (2, 6):
        for rank, per_step in enumerate(pool.run(count_agreements, layers)):
            assert per_step == [1, 0], f"rank {rank}, {layers} layers: agreements per step {per_step}"
