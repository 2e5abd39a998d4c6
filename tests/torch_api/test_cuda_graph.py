"""A steady-state HybridDecoder step (forward + backward) on a CUDA GPU: no host synchronisation,
captured in a CUDA graph, replayed for a new packing of the same total length.

The model runs its default backends in bf16 (the CuTeDSL GDP kernels for K = V = 128 on a Hopper
GPU, flex attention), on a graph-ready layout (``build_shard_layout(..., max_sequences=M)``): every
tensor a step reads has a shape fixed by (T, cp_size, M). Per batch, on the host and eagerly:
``model.agree`` (the header and the token check, recorded on the layout) and, for a new packing,
``layout.copy_packing_`` (the new values written into the buffers the graph reads). The step itself
is then sync-free and capturable:

  * ``torch.cuda.set_sync_debug_mode("error")`` around an eager steady-state step raises nothing;
  * a CUDA graph captured on packing A (warm-up on a side stream, grads set to None before the
    capture so that backward allocates them in the graph's pool, as the PyTorch docs describe) and
    replayed after copying packing B and its tokens into the static buffers gives logits, loss and
    every parameter gradient bitwise equal to an eager step on packing B.

One GPU, and 2 ranks (NCCL, the session pool's workers with timeouts on every task and collective;
skipped unless 2 GPUs). Failures print the name, max |difference| and, for context, how far two
eager runs of packing B differ (nonzero there means a nondeterministic kernel, not the graph).
Run: ``python -m pytest tests/torch_api/test_cuda_graph.py -x -q -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

TOTAL = 4096
MAX_SEQUENCES = 16
VOCAB = 128
# packing A (captured) and B (replayed): the same T, other documents, padding (id 0) in B, and a
# document that crosses the rank boundary (2 ranks: L = 2048) in both
PACKING_A = [(1, 700), (2, 1900), (3, 1496)]
PACKING_B = [(1, 100), (2, 1000), (0, 64), (3, 2500), (4, 300), (0, 132)]


def _ids(runs) -> np.ndarray:
    return np.repeat([doc for doc, _ in runs], [length for _, length in runs])


def _model(device):
    from torch_api.layers import DecoderConfig, HybridDecoder

    torch.manual_seed(0)
    # K = V = 128 in bf16: the CuTeDSL GDP kernels on a Hopper GPU; head_dim 128: flex attention
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=256, num_layers=4, num_heads=2, head_dim=128,
                           num_kv_heads=1)
    model = HybridDecoder(config, gdp_options={"cp_check_inputs": False}, attention_options={"check_inputs": False})
    return model.to(device=device, dtype=torch.bfloat16)


def _loss(model, tokens, layout):
    logits = model(tokens, layout=layout)
    return logits, logits.float().square().mean()


def _forward_backward(model, tokens, layout) -> None:
    """One step whose autograd graph dies on return: an AccumulateGrad node kept alive across steps
    (e.g. by a loss variable) keeps the stream it was made on, and breaks a later capture."""
    model.zero_grad(set_to_none=True)
    _, loss = _loss(model, tokens, layout)
    loss.backward()


def _eager_step(model, tokens, layout):
    """(logits, loss, {parameter name: grad}) of one eager forward + backward, cloned."""
    model.zero_grad(set_to_none=True)
    logits, loss = _loss(model, tokens, layout)
    loss.backward()
    return (logits.detach().clone(), loss.detach().clone(),
            {name: p.grad.detach().clone() for name, p in model.named_parameters()})


def _compare(got: dict, want: dict) -> dict:
    """{name: max |got - want|} for the tensors that are not bitwise equal."""
    differ = {}
    for name, value in want.items():
        if not torch.equal(got[name], value):
            differ[name] = float((got[name].float() - value.float()).abs().max())
    return differ


def _flatten(logits, loss, grads) -> dict:
    return {"logits": logits, "loss": loss, **{f"grad {name}": grad for name, grad in grads.items()}}


def graph_case(rank: int, world: int, group=None) -> dict:
    """Capture on packing A, replay on packing B; return the diagnostics the test asserts on."""
    from torch_api.layers import build_shard_layout

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = _model(device)
    local = TOTAL // world
    generator = torch.Generator().manual_seed(1)
    tokens = {name: torch.randint(0, VOCAB, (1, TOTAL), generator=generator)[:, rank * local:(rank + 1) * local]
              .to(device) for name in ("A", "B")}

    def layout_of(runs):
        return build_shard_layout(total_len=TOTAL, doc_ids=_ids(runs), cp_group=group,
                                  max_sequences=MAX_SEQUENCES).materialize(device)

    report = {"backend": None, "sync_error": None}
    from torch_api.gdp.ops import resolve_backend

    probe = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16, device=device)
    report["backend"] = type(resolve_backend(None, probe, probe, probe, 2)).__name__

    # eager references on packing B (twice: a nonzero difference there is a nondeterministic kernel)
    layout_b = layout_of(PACKING_B)
    model.agree(tokens["B"], layout=layout_b)
    eager_b = _flatten(*_eager_step(model, tokens["B"], layout_b))
    eager_b_again = _flatten(*_eager_step(model, tokens["B"], layout_b))
    report["eager_b_repeat_differs"] = _compare(eager_b_again, eager_b)

    # the static buffers: packing A's layout and tokens
    static_layout = layout_of(PACKING_A)
    static_tokens = tokens["A"].clone()
    model.agree(static_tokens, layout=static_layout)
    eager_a = _flatten(*_eager_step(model, static_tokens, static_layout))
    report["a_equals_b"] = float((eager_a["logits"].float() - eager_b["logits"].float()).abs().max()) == 0.0

    # a steady-state step (agreed, warm) raises under sync debug mode "error" if anything synchronises;
    # first show that the mode is live here: a host read must raise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        static_tokens.sum().item()
        report["sync_mode_live"] = False
    except RuntimeError:
        report["sync_mode_live"] = True
    try:
        _forward_backward(model, static_tokens, static_layout)
    except RuntimeError as err:
        report["sync_error"] = f"{type(err).__name__}: {err}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    # warm-up on a side stream, then capture forward + backward with the grads unset
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            _forward_backward(model, static_tokens, static_layout)
    torch.cuda.current_stream(device).wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits, static_loss = _loss(model, static_tokens, static_layout)
        static_loss.backward()
    static_grads = {name: p.grad for name, p in model.named_parameters()}

    graph.replay()  # packing A first: the graph reproduces the eager step it was captured from
    torch.cuda.synchronize()
    report["replay_a_differs"] = _compare(_flatten(static_logits, static_loss, static_grads), eager_a)

    # packing B: new values into the captured buffers (host checks, then in-place copies), agree, replay
    static_layout.copy_packing_(layout_of(PACKING_B))
    static_tokens.copy_(tokens["B"])
    model.agree(static_tokens, layout=static_layout)
    graph.replay()
    torch.cuda.synchronize()
    report["replay_b_differs"] = _compare(_flatten(static_logits, static_loss, static_grads), eager_b)
    report["tensors"] = len(eager_b)
    return report


def _check(report: dict, who: str) -> None:
    context = (f"{who}: GDP backend {report['backend']}; eager packing B run twice differs in "
               f"{report['eager_b_repeat_differs'] or 'nothing'}")
    print(f"\n{who}: {report}")
    assert report["sync_mode_live"], f"{who}: sync debug mode 'error' let .item() through; the sync check is void"
    assert report["sync_error"] is None, f"{who}: a steady-state step synchronised with the host: {report['sync_error']}"
    assert not report["a_equals_b"], f"{who}: packings A and B give the same logits; the test would prove nothing"
    assert report["replay_a_differs"] == {}, (
        f"{who}: replay on the captured packing differs from eager (max |diff| per tensor): "
        f"{report['replay_a_differs']}; {context}")
    assert report["replay_b_differs"] == {}, (
        f"{who}: replay on a new packing differs from eager on it (max |diff| per tensor, of {report['tensors']}): "
        f"{report['replay_b_differs']}; {context}")


@pytest.mark.gpu
def test_decoder_step_is_sync_free_and_replays_a_new_packing_in_a_cuda_graph_on_one_gpu():
    _check(graph_case(0, 1), "one GPU")


def _cp_graph_case(rank, world):
    import torch.distributed as dist

    return graph_case(rank, world, dist.group.WORLD)


@pytest.mark.gpu
@pytest.mark.multirank
def test_decoder_step_under_cp_replays_a_new_packing_in_a_cuda_graph_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from tests.gloo_pool import GlooPool

    pool = GlooPool(2, backend="nccl", collective_timeout_s=120)
    try:
        reports = pool.run(_cp_graph_case, timeout=600)
    finally:
        pool.close(kill=True)
    for rank, report in enumerate(reports):
        _check(report, f"rank {rank} of 2")
