"""Sequence states through the torch layers: a document split into two training windows, window 2
started from window 1's final states, equals the one-window run (outputs, final states, parameter
gradients with the states kept attached), on one device and under CP (gloo, world 2).

The short conv does not carry its ``conv_size - 1`` tokens across windows, so these models have no
conv reach (``use_short_conv=False`` for the layer, ``conv_size=1`` for the decoder).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from cp_linear.model_config import DecoderConfig
from tests.cp_linear.gdp_cases import rel_err
from torch_api.layers import GatedDeltaProduct, HybridDecoder
from tests.layer_state_cases import DECODER, DOC_IDS, GDP, WINDOW



def continued_state(final_state, window_ids):
    """Window 1's final states -> window 2's initial states: the document crossing the boundary keeps
    its state, every sequence that starts in window 2 starts from zeros."""
    rows = 1 + int(np.count_nonzero(np.diff(window_ids)))
    zeros = final_state.new_zeros((rows - 1, *final_state.shape[1:]))
    return torch.cat([final_state[-1:], zeros])


def grads_of(module):
    grads = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    module.zero_grad(set_to_none=True)
    return grads


def test_gdp_layer_two_windows_equal_one_window_on_one_device():
    torch.manual_seed(0)
    layer = GatedDeltaProduct(**GDP)
    x = torch.randn(1, DOC_IDS.shape[0], GDP["hidden_size"])
    cotangent = torch.randn_like(x)
    out, final = layer(x, seq_idx=torch.from_numpy(DOC_IDS)[None], output_final_state=True)
    (out * cotangent).sum().backward()
    expected = grads_of(layer)
    ids = torch.from_numpy(DOC_IDS)[None]
    out1, final1 = layer(x[:, :WINDOW], seq_idx=ids[:, :WINDOW], output_final_state=True)
    out2, final2 = layer(x[:, WINDOW:], seq_idx=ids[:, WINDOW:], output_final_state=True,
                         initial_state=continued_state(final1, DOC_IDS[WINDOW:]))
    windows = torch.cat([out1, out2], dim=1)
    (windows * cotangent).sum().backward()
    assert final.shape == (3, 2, 4, 6)
    assert rel_err(windows.detach(), out.detach()) <= 2e-6
    assert rel_err(torch.cat([final1[:1], final2]).detach(), final.detach()) <= 2e-6
    assert rel_err(grads_of(layer), expected) <= 2e-5


def decoder_windows(rank, world):
    """(logits, finals, parameter gradients) of the one-window and the two-window run; under CP each
    window's final states are summed over the group (differentiably) before window 2 reads them."""
    torch.manual_seed(0)
    model = HybridDecoder(DECODER)
    tokens = torch.randint(0, DECODER.vocab_size, (1, DOC_IDS.shape[0]), generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn(1, DOC_IDS.shape[0], DECODER.vocab_size, generator=torch.Generator().manual_seed(2))
    group = dist.group.WORLD if world > 1 else None

    def run(tokens, ids, **states):
        local = tokens.shape[1] // world
        shard = slice(rank * local, (rank + 1) * local)
        logits, finals = model(tokens[:, shard], doc_ids=torch.from_numpy(ids), cp_group=group,
                               output_gdp_states=True, **states)
        if world > 1:
            finals = {i: dist_fn.all_reduce(f) for i, f in finals.items()}
        return logits, finals, shard

    results = []
    logits, finals, shard = run(tokens, DOC_IDS)
    (logits * cotangent[:, shard]).sum().backward()
    results.append((logits.detach(), {i: f.detach() for i, f in finals.items()}, grads_of(model)))
    logits1, finals1, shard1 = run(tokens[:, :WINDOW], DOC_IDS[:WINDOW])
    states = {i: continued_state(f, DOC_IDS[WINDOW:]) for i, f in finals1.items()}
    logits2, finals2, shard2 = run(tokens[:, WINDOW:], DOC_IDS[WINDOW:], gdp_states=states)
    loss = (logits1 * cotangent[:, :WINDOW][:, shard1]).sum() + (logits2 * cotangent[:, WINDOW:][:, shard2]).sum()
    loss.backward()
    finals = {i: torch.cat([finals1[i][:1], finals2[i]]).detach() for i in finals2}
    results.append((torch.cat([logits1, logits2], dim=1).detach(), finals, grads_of(model)))
    grads = [r[2] for r in results]
    if world > 1:  # weight gradients of a replicated model: summed over the group
        for g in grads:
            dist.all_reduce(g)
    return [(logits, finals, g) for (logits, finals, _), g in zip(results, grads)]


def check_states_and_gradients(one_window, two_windows):
    _, finals, grads = one_window
    _, finals_w, grads_w = two_windows
    assert sorted(finals_w) == [0, 1]
    for index in finals:
        assert rel_err(finals_w[index], finals[index]) <= 2e-6, index
    assert rel_err(grads_w, grads) <= 2e-5


def test_decoder_two_windows_equal_one_window_on_one_device():
    one_window, two_windows = decoder_windows(0, 1)
    assert rel_err(two_windows[0], one_window[0]) <= 2e-6
    check_states_and_gradients(one_window, two_windows)


def gathered_decoder_windows(rank, world):
    one_window, two_windows = decoder_windows(rank, world)
    # the full run's shard r holds tokens [r T/w, (r+1) T/w), the windows' shards [r W/w, ...) of each window:
    # gather both to compare whole sequences
    logits = [torch.empty_like(one_window[0]) for _ in range(world)]
    dist.all_gather(logits, one_window[0].contiguous())
    logits_w = [torch.empty_like(two_windows[0]) for _ in range(world)]
    dist.all_gather(logits_w, two_windows[0].contiguous())
    half = WINDOW // world
    windows = torch.cat([x[:, :half] for x in logits_w] + [x[:, half:] for x in logits_w], dim=1)
    return rel_err(windows, torch.cat(logits, dim=1)), one_window, two_windows


@pytest.mark.multirank
def test_decoder_two_windows_equal_one_window_under_cp(gloo_pools):
    for rank, (logits_err, one_window, two_windows) in enumerate(gloo_pools(2).run(gathered_decoder_windows)):
        assert logits_err <= 2e-6, (rank, logits_err)
        check_states_and_gradients(one_window, two_windows)


def test_decoder_rejects_states_of_a_layer_that_is_not_gdp():
    model = HybridDecoder(DecoderConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, head_dim=4))
    with pytest.raises(ValueError, match=r"gdp_states must be a dict keyed by GDP layer indices \[0\]"):
        model(torch.zeros((1, 8), dtype=torch.int64), gdp_states={1: torch.zeros((1, 2, 4, 4))})
