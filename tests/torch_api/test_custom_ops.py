"""The custom ops (``torch_api.gdp.library``, ``torch_api.attention.library``): ``torch.library.opcheck``
(schema, fake kernels, registered autograd), ``torch.compile(fullgraph=True)`` of the hybrid decoder
under CP against eager, and the number of agreement collectives in a step.

The multi-rank checks run as one task in the 2-rank gloo pool (one process group, several cases);
the pool times every task and collective out. torch.compile uses the ``aot_eager`` backend: it
traces with dynamo (a graph break fails ``fullgraph=True``) and AOTAutograd (fake kernels, the
registered backward) without paying for inductor's C++ compiler on the CI's two cores.
"""

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_api._dist as tdist
import torch_api.gdp.cutedsl as cutedsl
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from tests.cutedsl_inputs import emulation_inputs, recorded_scan_modes
from tests.tolerance import assert_within, decoder_length, rel_err, tolerance
from torch_api.attention.blockdiag import prepare_blockdiag
from torch_api.attention.library import routing_name
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.library import backend_name
from torch_api.gdp.ops import _GatedDeltaProduct, run_gated_delta_product
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


@contextlib.contextmanager
def emulating_kernels():
    """The CuTeDSL backend on the CPU, every launch emulated (as in test_cutedsl_emulated.py); also
    usable inside the pool's ranks, where no monkeypatch fixture runs."""
    patches = [(kl._Launch, "run", run_emulated), (cutedsl, "unsupported_reason", lambda inputs: None),
               (cutedsl, "_sm_count", lambda device: 132)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@pytest.fixture
def emulated_kernels():
    with emulating_kernels():
        yield


@pytest.mark.parametrize("packed, segment_chunks", [(True, 2), (False, None)],
                         ids=["packed-initial-state-2-chunk-segments", "rows-sized-segments"])
def test_cutedsl_kernel_backward_runs_through_the_op_and_compiles_to_eager_results(emulated_kernels, packed,
                                                                                   segment_chunks):
    """The default ``backward="kernels"`` saves the segments' incoming states, which the op returns as
    an extra output of a shape its fake kernel predicts: opcheck passes, and the op and its
    torch.compile(fullgraph=True) give the eager autograd.Function's outputs and gradients."""
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks)
    assert backend.backward == "kernels"
    n_h, dim = 2, 64
    lengths = [70, 37] if packed else [45]
    q, k, v, g, beta = emulation_inputs(lengths, heads=2, key_dim=dim, value_dim=dim, n_h=n_h, seed=7,
                                        rows=1 if packed else 2)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32) if packed else None
    initial = None
    if packed:
        initial = torch.randn(len(lengths), 2, dim, dim, generator=torch.Generator().manual_seed(8)) * 0.1
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)] + ([initial.requires_grad_()] if packed else [])
    options = dict(scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True)

    args = (*leaves[:5], cu, initial, *options.values(), backend_name(backend))
    states = torch.ops.cp_linear.gdp_forward(*args)[4]
    assert states.shape == backend.saved_buffer_shape(_op_inputs(leaves, cu, options)) and states.shape[0] > 1
    torch.library.opcheck(torch.ops.cp_linear.gdp_forward.default, args)

    def through_op(*tensors):
        return run_gated_delta_product(*tensors[:5], backend=backend, cu_seqlens=cu,
                                       initial_state=tensors[5] if packed else None, **options)

    def eager(*tensors):
        return _GatedDeltaProduct.apply(backend, dict(options, cu_seqlens=cu), *tensors[:5],
                                        tensors[5] if packed else None)

    generator = torch.Generator().manual_seed(9)
    do = torch.randn(q.shape[0], q.shape[1], 2, dim, generator=generator).bfloat16()
    dfinal = torch.randn(len(lengths) if packed else 2, 2, dim, dim, generator=generator)
    results = {}
    for name, fn in {"eager": eager, "op": through_op,
                     "compiled": torch.compile(through_op, fullgraph=True, backend="aot_eager")}.items():
        inputs = [x.detach().clone().requires_grad_() for x in leaves]
        out, final = fn(*inputs)
        torch.autograd.backward([out, final], [do, dfinal])
        results[name] = [out, final, *(x.grad for x in inputs)]
    for name in ("op", "compiled"):
        for index, (got, want) in enumerate(zip(results[name], results["eager"])):
            assert torch.equal(got, want), f"{name}: output {index} differs from eager by {rel_err(got, want):.2e}"


def test_cutedsl_forward_without_gradients_keeps_nothing_for_the_backward(emulated_kernels):
    """Under no_grad (or with no input requiring grad) the op is told no backward will run
    (``save_for_backward=False``): the kernel backend writes no saved buffer and runs the output pass
    without the chunk states (mode "output"); with gradients it keeps them (mode "output_states").
    The outputs are bitwise the same, and opcheck passes with the flag off (the fake agrees: [0])."""
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=2)
    n_h, dim, lengths = 2, 128, [70, 37]
    q, k, v, g, beta = emulation_inputs(lengths, heads=2, key_dim=dim, value_dim=dim, n_h=n_h, seed=5)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    options = dict(scale=dim ** -0.5, num_householder=n_h, use_qk_l2norm_in_kernel=True)
    runs = {}
    for name, grad in (("inference", False), ("training", True)):
        with recorded_scan_modes() as runs[name]:
            leaves = [x.clone().requires_grad_(grad) for x in (q, k, v, g, beta)]
            outputs = run_gated_delta_product(*leaves, backend=backend, cu_seqlens=cu, **options)
        runs[name + " outputs"] = [x.detach() for x in outputs]
    assert runs["inference"] == ["summary", "output"] and runs["training"] == ["summary", "output_states"]
    for got, want in zip(runs["inference outputs"], runs["training outputs"]):
        assert torch.equal(got, want)
    args = (q, k, v, g, beta, cu, None, *options.values(), backend_name(backend), False)
    assert torch.ops.cp_linear.gdp_forward(*args)[4].shape == (0,)
    torch.library.opcheck(torch.ops.cp_linear.gdp_forward.default, args)


def _op_inputs(leaves, cu, options):
    from torch_api.gdp.types import GDPInputs

    return GDPInputs(*leaves[:5], options["scale"], options["num_householder"], options["use_qk_l2norm_in_kernel"],
                     cu)


UNCHECKED = dict(gdp_options={"cp_check_inputs": False}, attention_options={"check_inputs": False})


def _decoder(seed=0, num_layers=4):
    """A small decoder with the layers' value checks off: the configuration torch.compile traces (the
    checks read values on the host)."""
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=num_layers, num_heads=2, head_dim=8,
                           num_kv_heads=1)
    return config, HybridDecoder(config, **UNCHECKED)


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
    unchecked, contained = torch.zeros(0, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)
    for trailing_bad in (unchecked, contained):
        args = (q, k, v, g, beta, cu, span, trailing_bad, 8 ** -0.5, 2, True, backend_name(TorchGDPBackend()),
                group.group_name)
        torch.library.opcheck(torch.ops.cp_linear.gdp_cp_forward.default, args)
    # and with the CuTeDSL backend's kernel backward (segment states as the extra output), emulated
    with emulating_kernels():
        backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=1)
        inputs = [x.requires_grad_() for x in emulation_inputs([LOCAL], heads=2, key_dim=64, value_dim=64, n_h=2,
                                                                seed=rank)]
        args = (*inputs, cu, span, unchecked, 64 ** -0.5, 2, True, backend_name(backend), group.group_name)
        torch.library.opcheck(torch.ops.cp_linear.gdp_cp_forward.default, args)
        results["cutedsl-op-equals-eager"] = cutedsl_cp_op_equals_eager(rank, backend, group)

    # opcheck of the attention op (a2a routing, a document across the ranks, padding)
    doc_ids = np.repeat([1, 2, 0], [5, total - 8, 3])
    routing = prepare_blockdiag(doc_ids, group, "a2a")
    generator = torch.Generator().manual_seed(rank)
    qa = torch.randn(1, LOCAL, 4, 8, generator=generator).requires_grad_()
    ka, va = (torch.randn(1, LOCAL, 2, 8, generator=generator).requires_grad_() for _ in range(2))
    for contain in (False, True):
        torch.library.opcheck(torch.ops.cp_linear.blockdiag_attention.default,
                              (qa, ka, va, routing_name(routing), 0.0, "sdpa", contain))

    # torch.compile(fullgraph=True) of the decoder under CP == eager, for two packings of one length
    config, model = _decoder()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 13, (1, total), generator=torch.Generator().manual_seed(3))
    shard = tokens[:, rank * LOCAL:(rank + 1) * LOCAL]
    packings = {"three-docs": np.repeat([1, 2, 3], [5, total - 9, 4]),
                "one-doc-and-padding": np.repeat([1, 0], [total - 2, 2])}
    for name, ids in packings.items():
        layout = build_shard_layout(total_len=total, doc_ids=ids, cp_group=group).materialize("cpu")
        model.agree(shard, layout=layout)  # the compiled step's header, eagerly
        eager_loss, eager_grads = _step(model, shard, layout, total)
        compiled_loss, compiled_grads = _step(compiled, shard, layout, total)
        results[name] = (rel_err(compiled_loss, eager_loss), rel_err(compiled_grads, eager_grads))
    results["config"] = config
    return results


def cutedsl_cp_op_equals_eager(rank, backend, group) -> list[str]:
    """Rows (each row one sequence across the ranks): the CP op against the eager autograd.Function
    path, output and input gradients; the names of those that differ."""
    from torch_api.gdp.cp import gdp_chunkwise_context_parallel, run_cp_op

    inputs = emulation_inputs([LOCAL], heads=2, key_dim=64, value_dim=64, n_h=2, seed=10 + rank, rows=2)
    span = torch.tensor([0, dist.get_world_size(group)], dtype=torch.int32)
    do = torch.randn(2, LOCAL, 2, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    differ = []
    for contain in (False, True):  # the op's containment against check_inputs=False's
        results = []
        # run_cp_op runs the op's bodies through an autograd.Function in eager mode: the custom op itself too
        for path in ("run_cp_op", "eager") + (() if contain else ("custom op",)):
            leaves = [x.clone().requires_grad_() for x in inputs]
            if path == "run_cp_op":
                out = run_cp_op(*leaves, cu_seqlens=None, rank_range=span, group_name=group.group_name,
                                backend=backend, scale=64 ** -0.5, num_householder=2, use_qk_l2norm_in_kernel=True,
                                contain=contain)
            elif path == "custom op":
                out = torch.ops.cp_linear.gdp_cp_forward(*leaves, None, span, torch.zeros(0, dtype=torch.bool),
                                                         64 ** -0.5, 2, True, backend_name(backend),
                                                         group.group_name)[0]
            else:
                out = gdp_chunkwise_context_parallel(*leaves, cp_group=group, num_householder=2, backend=backend,
                                                     use_qk_l2norm_in_kernel=True, check_inputs=not contain)
            out.backward(do)
            results.append([out, *(x.grad for x in leaves)])
        names = [f"{name} (contain={contain})" for name in ("o", "dq", "dk", "dv", "dg", "dbeta")]
        for other in results[1:]:
            differ += [name for name, a, b in zip(names, results[0], other) if not torch.equal(a, b)]
    return differ


def count_agreements(rank, world, num_layers):
    """Agreement collectives in two training steps (forward and backward) of one batch (one layout) of
    a decoder with its checks off."""
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
        _, model = _decoder(num_layers=num_layers)
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
        assert results.pop("cutedsl-op-equals-eager") == [], f"rank {rank}: the CuTeDSL CP op differs from eager"
        # the same float32 ops in another order at most (AOTAutograd may reorder independent work)
        tol = tolerance(decoder_length(config, 2 * LOCAL) + config.vocab_size * 2 * LOCAL, compared_with="rounded")
        for name, (loss_err, grad_err) in results.items():
            assert_within(f"rank {rank} {name} loss", loss_err, tol)
            assert_within(f"rank {rank} {name} gradients", grad_err, tol)


@pytest.mark.multirank
def test_a_decoder_step_agrees_once_whatever_the_depth(gloo_pools):
    """A decoder of 2 or 6 layers (GDP and attention, forward and backward) sends one header per step:
    the model's, which covers every layer and both directions. (Not zero for a repeated batch: a
    cache that one rank hits and another misses would leave the ranks in different collectives.)"""
    pool = gloo_pools(2)
    for layers in (2, 6):
        for rank, per_step in enumerate(pool.run(count_agreements, layers)):
            assert per_step == [1, 1], f"rank {rank}, {layers} layers: agreements per step {per_step}"
