"""Graph-ready layouts (``build_shard_layout(..., max_sequences=M)``): the same model as the default
layout, buffers rewritten in place for a new packing, checks that still raise on every rank, and a
steady-state step that sends no header after an explicit agreement.

The graph-ready attention (``torch_api.attention.static``: all-gather, a mask built on the device)
and the padded GDP ``cu_seqlens`` are checked against the default path (plan-based exchanges, host
chunks), within the rounding of the sums they reorder; CP cases run on the session's 2-rank gloo
pool (timeouts on every task and collective).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_api._dist as tdist
from tests.tolerance import assert_within, decoder_length, rel_err, tolerance
from torch_api.layers import BlockDiagAttention, DecoderConfig, HybridDecoder, build_shard_layout

TOTAL = 48
IDS = np.repeat([1, 0, 2, 3, 0], [7, 3, 20, 15, 3])  # padding inside and at the end; doc 2 crosses L = 24
OTHER_IDS = np.repeat([1, 2, 0], [30, 10, 8])
CONFIG = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=2, num_heads=2, head_dim=8, num_kv_heads=1)


def _model(checks: bool):
    torch.manual_seed(0)
    options = {} if checks else dict(gdp_options={"cp_check_inputs": False}, attention_options={"check_inputs": False})
    return HybridDecoder(CONFIG, **options)


def _step(model, tokens, layout):
    model.zero_grad(set_to_none=True)
    logits = model(tokens, layout=layout)
    logits.square().mean().backward()
    return logits.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _tolerance():
    return tolerance(decoder_length(CONFIG, TOTAL) + CONFIG.vocab_size * TOTAL, compared_with="rounded")


def _tokens(rank=0, world=1):
    tokens = torch.randint(0, 13, (1, TOTAL), generator=torch.Generator().manual_seed(1))
    local = TOTAL // world
    return tokens[:, rank * local:(rank + 1) * local]


def graph_ready_against_default(rank, world, group=None):
    """(logits error, gradient error) of the graph-ready layout against the default one, checks on and off."""
    errors = {}
    for checks in (True, False):
        model = _model(checks)
        tokens = _tokens(rank, world)
        results = []
        for max_sequences in (None, 8):
            layout = build_shard_layout(total_len=TOTAL, doc_ids=IDS, cp_group=group, max_sequences=max_sequences)
            results.append(_step(model, tokens, layout))
        (ref_logits, ref_grads), (logits, grads) = results
        errors[f"checks={checks}"] = (rel_err(logits, ref_logits), rel_err(grads, ref_grads))
    return errors


def test_graph_ready_layout_gives_the_default_layouts_results_on_one_device():
    for name, (logits_err, grad_err) in graph_ready_against_default(0, 1).items():
        assert_within(f"{name} logits", logits_err, _tolerance())
        assert_within(f"{name} gradients", grad_err, _tolerance())


def test_graph_ready_attention_contains_a_nonfinite_input_like_the_default_path():
    """check_inputs=False: a NaN in one token's hidden state makes NaN exactly the outputs that read it
    (its own row and later rows of its document), in both paths; the rest agree within rounding."""
    torch.manual_seed(0)
    layer = BlockDiagAttention(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, check_inputs=False)
    hidden = torch.randn(1, TOTAL, 16)
    hidden[0, 12] = float("nan")  # inside document 2 (tokens 10..29)
    outs = [layer(hidden, layout=build_shard_layout(total_len=TOTAL, doc_ids=IDS, max_sequences=m)) for m in (None, 8)]
    nan_rows = [torch.isnan(out).any(-1)[0] for out in outs]
    assert torch.equal(nan_rows[0], nan_rows[1]), "the two paths poison different rows"
    assert nan_rows[1].nonzero().flatten().tolist() == list(range(12, 30)), "poisoned rows should be 12..29"
    clean = ~nan_rows[0]
    assert_within("clean rows", rel_err(outs[1][0, clean].detach(), outs[0][0, clean].detach()),
                  tolerance(TOTAL * 8, compared_with="rounded"))


def test_max_sequences_smaller_than_a_shards_sequences_raises():
    with pytest.raises(ValueError, match="max_sequences = 4 is too small: a shard of this packing holds 5"):
        build_shard_layout(total_len=TOTAL, doc_ids=IDS, max_sequences=4)
    with pytest.raises(ValueError, match="max_sequences must be a positive int"):
        build_shard_layout(total_len=TOTAL, doc_ids=IDS, max_sequences=0)


def test_copy_packing_rewrites_the_captured_buffers_in_place():
    model = _model(False)
    tokens = _tokens()
    layout = build_shard_layout(total_len=TOTAL, doc_ids=IDS, max_sequences=8).materialize("cpu")
    _step(model, tokens, layout)
    buffers = {key: value.data_ptr() for key, value in layout._device_cache.items()
               if isinstance(value, torch.Tensor)}
    assert buffers, "materialize built no device tensors"
    fresh = build_shard_layout(total_len=TOTAL, doc_ids=OTHER_IDS, max_sequences=8)
    layout.copy_packing_(build_shard_layout(total_len=TOTAL, doc_ids=OTHER_IDS, max_sequences=8))
    for key, pointer in buffers.items():
        assert layout._device_cache[key].data_ptr() == pointer, f"{key} was replaced, not written in place"
    for name in ("positions", "cu_seqlens", "doc_ids_tensor"):
        assert torch.equal(getattr(layout, name)("cpu"), getattr(fresh, name)("cpu")), f"{name} differs"
    for got, want in zip(_step(model, tokens, layout), _step(model, tokens, fresh)):
        assert torch.equal(got, want), "a step on the rewritten layout differs from one on a fresh layout"


@pytest.mark.parametrize("source, match", [
    (lambda: build_shard_layout(total_len=TOTAL, doc_ids=OTHER_IDS, max_sequences=6), "max_sequences"),
    (lambda: build_shard_layout(total_len=2 * TOTAL, doc_ids=np.ones(2 * TOTAL, int), max_sequences=8), "T, cp_size"),
    (lambda: build_shard_layout(total_len=TOTAL, doc_ids=OTHER_IDS), "graph-ready layouts on both sides"),
], ids=["other-max-sequences", "other-length", "not-graph-ready"])
def test_copy_packing_rejects_a_layout_of_other_shapes(source, match):
    layout = build_shard_layout(total_len=TOTAL, doc_ids=IDS, max_sequences=8).materialize("cpu")
    with pytest.raises(ValueError, match=match):
        layout.copy_packing_(source())


# --------------------------------------------------------------------------- CP (2-rank gloo pool)


def _cp_against_default(rank, world):
    return graph_ready_against_default(rank, world, dist.group.WORLD)


@pytest.mark.multirank
def test_graph_ready_layout_gives_the_default_layouts_results_under_cp(gloo_pools):
    for rank, errors in enumerate(gloo_pools(2).run(_cp_against_default)):
        for name, (logits_err, grad_err) in errors.items():
            assert_within(f"rank {rank} {name} logits", logits_err, _tolerance())
            assert_within(f"rank {rank} {name} gradients", grad_err, _tolerance())


def steady_state_headers(rank, world):
    """Headers sent by two steps after an explicit agree (expected none), and what a call that differs
    from the agreed one raises (on its rank alone, without a collective)."""
    import torch_api.attention.blockdiag as attention_module
    import torch_api.gdp.cp as gdp_module
    import torch_api.layers.layout as layout_module

    calls = []
    original = tdist.agree_or_raise

    def spy(*args, **kwargs):
        calls.append(kwargs.get("what", ""))
        return original(*args, **kwargs)

    modules = (attention_module, gdp_module, layout_module, tdist)
    for module in modules:
        module.agree_or_raise = spy
    try:
        model = _model(False)
        tokens = _tokens(rank, world)
        layout = build_shard_layout(total_len=TOTAL, doc_ids=IDS, cp_group=dist.group.WORLD, max_sequences=8)
        model.agree(tokens, layout=layout)
        agreed = len(calls)
        for _ in range(2):
            _step(model, tokens, layout)
        steady = len(calls) - agreed
        try:
            with torch.no_grad():  # grad mode is part of the agreed signature
                model(tokens, layout=layout)
            differing = None
        except ValueError as err:
            differing = str(err)
        return agreed, steady, differing, len(calls) - agreed - steady
    finally:
        for module in modules:
            module.agree_or_raise = original


@pytest.mark.multirank
def test_a_step_after_an_explicit_agreement_sends_no_header_and_a_differing_call_raises_alone(gloo_pools):
    for rank, (agreed, steady, differing, after) in enumerate(gloo_pools(2).run(steady_state_headers)):
        assert agreed == 1, f"rank {rank}: model.agree sent {agreed} headers"
        assert steady == 0, f"rank {rank}: two agreed steps sent {steady} headers"
        assert differing and "differs" in differing and after == 0, (
            f"rank {rank}: a call unlike the agreed one should raise without a header; got {differing!r}, {after} headers")


def forced_halo(rank, world):
    torch.manual_seed(0)
    model = HybridDecoder(CONFIG, attention_options={"mode": "halo"})
    layout = build_shard_layout(total_len=TOTAL, doc_ids=IDS, cp_group=dist.group.WORLD, max_sequences=8)
    model(_tokens(rank, world), layout=layout)


@pytest.mark.multirank
def test_a_forced_halo_on_a_graph_ready_layout_raises_on_every_rank(gloo_pools):
    outcome = gloo_pools(2).run_collect(forced_halo)
    for rank, (ok, value) in enumerate(outcome):
        assert not ok and value.type_name == "ValueError" and "all-gather" in value.message, (
            f"rank {rank}: expected the graph-ready mode error; got {value}")


def gathered_halo_against_exchange(rank, world):
    """The conv halo through an all-gather against the neighbour exchange: the window and the
    gradient it sends back, bitwise; and opcheck of the gathered op."""
    from torch_api.attention.library import left_halo_gathered_op, left_halo_op

    group_name = dist.group.WORLD.group_name
    kv = torch.randn(6, 1, 5, generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(9, 1, 5, generator=torch.Generator().manual_seed(10 + rank))
    results = []
    for op in (left_halo_op, left_halo_gathered_op):
        leaf = kv.clone().requires_grad_()
        window = op(leaf, 3, group_name)
        window.backward(grad)
        results.append((window.detach(), leaf.grad))
    torch.library.opcheck(torch.ops.cp_linear.left_halo_gathered.default, (kv.clone().requires_grad_(), 3, group_name))
    return [torch.equal(a, b) for a, b in zip(*results)]


@pytest.mark.multirank
def test_the_gathered_conv_halo_equals_the_neighbour_exchange(gloo_pools):
    for rank, same in enumerate(gloo_pools(2).run(gathered_halo_against_exchange)):
        assert same == [True, True], f"rank {rank}: (window, gradient) bitwise equal: {same}"


def padded_cu_seqlens_against_plain(rank, world):
    """The GDP CP op with cu_seqlens padded by empty sequences at the end (what a graph-ready layout
    passes) against the unpadded one, for the reference backend and the CuTeDSL backend (launches
    emulated on the CPU): output and input gradients bitwise, per backend."""
    from tests.cutedsl_inputs import emulation_inputs
    from tests.torch_api.test_custom_ops import emulating_kernels
    from torch_api.gdp.chunk import TorchGDPBackend
    from torch_api.gdp.cp import run_cp_op
    from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend

    local = 12
    differ = []
    with emulating_kernels():
        for backend in (TorchGDPBackend(), CuTeDSLGatedDeltaProductCPBackend(segment_chunks=1)):
            inputs = emulation_inputs([local], heads=2, key_dim=64, value_dim=64, n_h=2, seed=rank)
            do = torch.randn(1, local, 2, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
            for plain, padded in (([0, 5, local], [0, 5, local, local, local]), ([0, local], [0, local, local])):
                results = []
                for cu in (plain, padded):
                    leaves = [x.clone().requires_grad_() for x in inputs]
                    out = run_cp_op(*leaves, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                    rank_range=torch.tensor([0, world], dtype=torch.int32),
                                    group_name=dist.group.WORLD.group_name, backend=backend, scale=64 ** -0.5,
                                    num_householder=2, use_qk_l2norm_in_kernel=True, contain=False)
                    out.backward(do)
                    results.append([out, *(x.grad for x in leaves)])
                differ += [f"{type(backend).__name__} {plain}: {name}" for name, a, b in
                           zip(("o", "dq", "dk", "dv", "dg", "dbeta"), *results) if not torch.equal(a, b)]
    return differ


@pytest.mark.multirank
def test_empty_sequences_padding_cu_seqlens_change_nothing_under_cp(gloo_pools):
    for rank, differ in enumerate(gloo_pools(2).run(padded_cu_seqlens_against_plain)):
        assert differ == [], f"rank {rank}: padded cu_seqlens changed {differ}"
