"""The zig-zag CP layout (``cp_linear.zigzag``) in torch over real gloo groups, world 2-4.

Rank r holds chunks r and 2·cp−1−r. Each test runs many cases in one task per world size; every rank
returns its local results, the host scatters them back to global positions and compares them with the
contiguous layout (same group), the one-device op and the float64 recurrence / attention reference:
GDP outputs and all five input gradients, block-diagonal attention outputs and q/k/v gradients, and a
``HybridDecoder`` forward and backward (logits, input-embedding gradients and every weight gradient).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_linear.zigzag import local_positions
from tests.cp_linear.gdp_cases import seq_idx_from_lengths
from tests.tolerance import gdp_length, tolerance
from tests.torch_api.test_gdp_chunk import NAMES, check_close, cu_from_lengths, gdp_arrays, oracle, to_torch
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.cp import gdp_chunkwise_context_parallel
from torch_api.gdp.ops import gated_delta_product

LOCAL_LEN = 12  # two chunks of 6
HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6
WORLDS = (2, 3, 4)

pytestmark = pytest.mark.multirank


def token_rows(positions: np.ndarray, per_token: int) -> np.ndarray:
    """Rows of a [B, T·n, ...] array that hold the n entries of the given tokens (token-major)."""
    return (positions[:, None] * per_token + np.arange(per_token)).reshape(-1)


# --------------------------------------------------------------------------- GDP


def gdp_cases(world):
    total, chunk = world * LOCAL_LEN, LOCAL_LEN // 2
    packings = {
        "one-sequence": [total],
        "sequences-cross-chunk-boundaries": [chunk - 1, 2, chunk + 3, total - 2 * chunk - 4],
        "many-short-sequences": [3, 1, 2, 1, 1, total - 8],
        "sequences-end-on-chunk-boundaries": [chunk] * (2 * world),
        "B2-rows": None,
    }
    # the CP op takes float32 or half precision (not float64); float32 keeps the float64 comparison tight
    flavours = [(1, False, 4, torch.float32), (2, True, 64, torch.float32), (3, False, 8, torch.float32),
                (1, True, 8, torch.float32), (2, False, 4, torch.float32)]
    return [dict(name=name, lengths=lengths, batch=1 if lengths else 2, seed=500 * world + i, num_householder=n,
                 l2norm=l2, chunk_size=c, dtype=dtype)
            for i, ((name, lengths), (n, l2, c, dtype)) in enumerate(zip(packings.items(), flavours))]


def gdp_case_data(case, world):
    arrays = gdp_arrays(case["seed"], batch=case["batch"], tokens=world * LOCAL_LEN, heads=HEADS, key_dim=KEY_DIM,
                        value_dim=VALUE_DIM, num_householder=case["num_householder"], l2norm=case["l2norm"])
    output_grad = np.random.default_rng(case["seed"] + 1).normal(size=(case["batch"], world * LOCAL_LEN, HEADS,
                                                                        VALUE_DIM))
    return arrays, output_grad


def run_gdp_layouts(rank, world, cases):
    """Per case and layout: this rank's output and input gradients (numpy), computed with its shard."""
    results = []
    for case in cases:
        arrays, output_grad = gdp_case_data(case, world)
        ids = None if case["lengths"] is None else seq_idx_from_lengths(case["lengths"])
        per_layout = {}
        for layout in ("contiguous", "zigzag"):
            positions = local_positions(world * LOCAL_LEN, world, rank, layout)
            rows = token_rows(positions, case["num_householder"])
            leaves = [x[:, positions if name in ("q", "g") else rows].contiguous().requires_grad_()
                      for name, x in zip(NAMES, to_torch(arrays, case["dtype"]))]
            output = gdp_chunkwise_context_parallel(
                *leaves, cp_group=dist.group.WORLD, global_seq_idx=ids, num_householder=case["num_householder"],
                use_qk_l2norm_in_kernel=case["l2norm"], backend=TorchGDPBackend(case["chunk_size"]), layout=layout)
            assert output.dtype == case["dtype"]
            (output * torch.tensor(output_grad[:, positions], dtype=output.dtype)).sum().backward()
            got = {"o": output.detach().double().numpy()}
            got.update({f"d{name}": leaf.grad.double().numpy() for name, leaf in zip(NAMES, leaves)})
            per_layout[layout] = got
        results.append(per_layout)
    return results


def scatter_to_global(per_rank: list[dict], world: int, layout: str, num_householder: int) -> dict:
    """Put every rank's local rows back at their global positions."""
    out = {}
    for key in per_rank[0]:
        shape = list(per_rank[0][key].shape)
        shape[1] *= world
        full = np.zeros(shape)
        for rank, got in enumerate(per_rank):
            positions = local_positions(world * LOCAL_LEN, world, rank, layout)
            per_token = 1 if key in ("o", "dq", "dg") else num_householder
            full[:, token_rows(positions, per_token)] = got[key]
        out[key] = full
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_gdp_zigzag_matches_contiguous_one_device_and_float64(gloo_pools, world):
    cases = gdp_cases(world)
    results = gloo_pools(world).run(run_gdp_layouts, cases)
    for index, case in enumerate(cases):
        arrays, output_grad = gdp_case_data(case, world)
        n = case["num_householder"]
        cu = None if case["lengths"] is None else cu_from_lengths(case["lengths"])
        float64 = oracle(arrays, num_householder=n, cu_seqlens=cu, l2norm=case["l2norm"], output_grad=output_grad)
        leaves = [x.requires_grad_() for x in to_torch(arrays)]
        o, _ = gated_delta_product(*leaves, num_householder=n, cu_seqlens=None if cu is None else torch.tensor(cu),
                                   use_qk_l2norm_in_kernel=case["l2norm"])
        (o * torch.tensor(output_grad, dtype=torch.float32)).sum().backward()
        one_device = {"o": o.detach().numpy(), **{f"d{k}": x.grad.numpy() for k, x in zip(NAMES, leaves)}}
        length = gdp_length(world * LOCAL_LEN, n, KEY_DIM)
        zigzag = scatter_to_global([r[index]["zigzag"] for r in results], world, "zigzag", n)
        contiguous = scatter_to_global([r[index]["contiguous"] for r in results], world, "contiguous", n)
        for key in ("o", *(f"d{name}" for name in NAMES)):
            label = f"{case['name']} (world {world}, {case['dtype']}) {key}"
            check_close(f"{label} zigzag vs float64", zigzag[key], float64[key], tolerance(length))
            check_close(f"{label} zigzag vs one-device", zigzag[key], one_device[key],
                        tolerance(length, compared_with="rounded"))
            check_close(f"{label} zigzag vs contiguous", zigzag[key], contiguous[key],
                        tolerance(length, compared_with="rounded"))


# --------------------------------------------------------------------------- block-diagonal attention


def attention_cases(world):
    total, chunk = world * LOCAL_LEN, LOCAL_LEN // 2
    return {
        "one-document": np.ones(total, np.int64),
        "documents-and-padding": np.repeat([1, 0, 2, 3, 0, 4], [chunk + 1, 2, chunk + 2, 3, 1, total - 2 * chunk - 9]),
        "documents-end-on-chunk-boundaries": np.repeat(np.arange(1, 2 * world + 1), chunk),
        "padding-chunk-in-the-middle": np.repeat([1, 0, 2], [chunk * world - chunk, 2 * chunk, chunk * world - chunk]),
    }


def attention_inputs(seed, total):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, total, 4, 8))
    k, v = rng.normal(size=(2, 1, total, 2, 8))
    return q, k, v, rng.normal(size=q.shape)


def attention_float64(doc_ids, q, k, v, grad_out) -> dict:
    """The whole sequence's output and q, k, v gradients by the float64 reference."""
    from torch_api.attention.naive import naive_blockdiag_attention

    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = naive_blockdiag_attention(*leaves, torch.from_numpy(doc_ids))
    out.backward(torch.tensor(grad_out))
    return {"o": out.detach().numpy(), **{f"d{n}": t.grad.numpy() for n, t in zip("qkv", leaves)}}


def check_attention_layouts(label, expected, zigzag, contiguous, doc_ids, tol):
    """Zig-zag against float64 and the contiguous layout (global order), padding rows exactly zero."""
    padding = doc_ids == 0
    for key in expected:
        name = f"{label} {key}"
        check_close(f"{name} zigzag vs float64", zigzag[key], expected[key], tol)
        check_close(f"{name} zigzag vs contiguous", zigzag[key], contiguous[key], 2 * tol)
        assert not np.any(zigzag[key][:, padding]), f"{name}: padding rows must be exactly 0"


def run_attention_layouts(rank, world, cases):
    from torch_api.attention.blockdiag import blockdiag_attention

    results = []
    for index, doc_ids in enumerate(cases.values()):
        q, k, v, grad_out = attention_inputs(index, world * LOCAL_LEN)
        per_layout = {}
        for layout in ("contiguous", "zigzag"):
            positions = local_positions(world * LOCAL_LEN, world, rank, layout)
            leaves = [torch.tensor(x[:, positions], dtype=torch.float32, requires_grad=True) for x in (q, k, v)]
            out = blockdiag_attention(*leaves, doc_ids, cp_group=dist.group.WORLD, mode="auto", kernel="sdpa",
                                      layout=layout)
            (out * torch.tensor(grad_out[:, positions], dtype=torch.float32)).sum().backward()
            per_layout[layout] = {"o": out.detach().double().numpy(),
                                  **{f"d{n}": t.grad.double().numpy() for n, t in zip("qkv", leaves)}}
        results.append(per_layout)
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_attention_zigzag_matches_contiguous_and_full_sequence(gloo_pools, world):
    from tests.tolerance import attention_length

    cases = attention_cases(world)
    results = gloo_pools(world).run(run_attention_layouts, cases)
    tol = tolerance(attention_length(world * LOCAL_LEN, 8))
    for index, (name, doc_ids) in enumerate(cases.items()):
        expected = attention_float64(doc_ids, *attention_inputs(index, world * LOCAL_LEN))
        zigzag = scatter_to_global([r[index]["zigzag"] for r in results], world, "zigzag", 1)
        contiguous = scatter_to_global([r[index]["contiguous"] for r in results], world, "contiguous", 1)
        check_attention_layouts(f"{name} (world {world})", expected, zigzag, contiguous, doc_ids, tol)


def attention_errors(rank, world, mode, layout):
    from torch_api.attention.blockdiag import blockdiag_attention

    q = torch.zeros(1, LOCAL_LEN, 2, 8)
    try:
        blockdiag_attention(q, q, q, np.ones(world * LOCAL_LEN, np.int64), cp_group=dist.group.WORLD, mode=mode,
                            layout=layout)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("mode, layout, expected", [
    pytest.param("halo", "zigzag", "layout='zigzag' exchanges K/V by all-gather; mode='halo'", id="zigzag-halo"),
    pytest.param("a2a", "zigzag", "mode='a2a' is not supported", id="zigzag-a2a"),
    pytest.param("auto", "diagonal", "layout must be one of", id="unknown-layout"),
])
def test_attention_unsupported_zigzag_option_raises_on_every_rank(gloo_pools, mode, layout, expected):
    messages = gloo_pools(2).run(attention_errors, mode, layout)
    assert all(m is not None and expected in m for m in messages), messages


# --------------------------------------------------------------------------- HybridDecoder


def decoder_doc_ids(world):
    total, chunk = world * LOCAL_LEN, LOCAL_LEN // 2
    # document 2 crosses several chunk boundaries (conv taps and RoPE positions reach across them)
    return {"packed": np.repeat([1, 2, 0, 3], [chunk - 2, total - 2 * chunk, 3, chunk - 1]), "rows": None}


def decoder_model():
    from cp_linear.model_config import DecoderConfig
    from torch_api.layers import HybridDecoder

    torch.manual_seed(0)  # the same weights on every rank and on the host
    config = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=4, num_heads=2, head_dim=8, num_kv_heads=1)
    return HybridDecoder(config)


def decoder_inputs(world):
    rng = np.random.default_rng(world)
    tokens = rng.integers(0, 13, size=(1, world * LOCAL_LEN))
    return tokens, rng.normal(size=(1, world * LOCAL_LEN, 13))


def run_decoder_layouts(rank, world, cases):
    from torch_api.layers import build_shard_layout

    tokens, cotangent = decoder_inputs(world)
    results = []
    for doc_ids in cases.values():
        per_layout = {}
        for name in ("contiguous", "zigzag"):
            model = decoder_model()
            layout = build_shard_layout(total_len=world * LOCAL_LEN, doc_ids=doc_ids, cp_group=dist.group.WORLD,
                                        layout=name)
            positions = layout.global_positions
            logits = model(torch.from_numpy(tokens[:, positions]), layout=layout)
            (logits * torch.tensor(cotangent[:, positions], dtype=torch.float32)).sum().backward()
            per_layout[name] = {"o": logits.detach().double().numpy(),
                                "grads": {n: p.grad.double().numpy() for n, p in model.named_parameters()}}
        results.append(per_layout)
    return results


@pytest.mark.parametrize("world", WORLDS)
def test_decoder_zigzag_matches_contiguous_and_one_device(gloo_pools, world):
    from tests.tolerance import decoder_length

    cases = decoder_doc_ids(world)
    results = gloo_pools(world).run(run_decoder_layouts, cases)
    tokens, cotangent = decoder_inputs(world)
    total = world * LOCAL_LEN
    for index, (name, doc_ids) in enumerate(cases.items()):
        model = decoder_model()
        logits = model(torch.from_numpy(tokens), doc_ids=None if doc_ids is None else torch.from_numpy(doc_ids))
        (logits * torch.tensor(cotangent, dtype=torch.float32)).sum().backward()
        one_device = {"o": logits.detach().double().numpy(), "grads": {n: p.grad.numpy() for n, p in
                                                                       model.named_parameters()}}
        tol = tolerance(decoder_length(model.config, total) + model.config.vocab_size * total,
                        compared_with="rounded")
        by_layout = {}
        for layout in ("contiguous", "zigzag"):
            per_rank = [r[index][layout] for r in results]
            logits = scatter_to_global([{"o": got["o"]} for got in per_rank], world, layout, 1)["o"]
            grads = {n: sum(got["grads"][n] for got in per_rank) for n in per_rank[0]["grads"]}  # the all-reduce
            by_layout[layout] = (logits, grads)
        for reference_name, (logits, grads) in (("one-device", (one_device["o"], one_device["grads"])),
                                                ("contiguous", by_layout["contiguous"])):
            label = f"{name} (world {world}) zigzag vs {reference_name}"
            check_close(f"{label} logits", by_layout["zigzag"][0], logits, tol)
            for param, grad in grads.items():
                check_close(f"{label} d{param}", by_layout["zigzag"][1][param], grad, tol)


# --------------------------------------------------------------------------- unsupported options


def gdp_errors(rank, world, scenario):
    from cp_linear import build_packed_sequence_cp_metadata

    total = world * LOCAL_LEN
    positions = local_positions(total, world, rank, "zigzag")
    arrays = gdp_arrays(0, tokens=total, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM)
    leaves = [x[:, positions].contiguous() for x in to_torch(arrays)]
    ids = seq_idx_from_lengths([5, total - 5])
    options = dict(cp_group=dist.group.WORLD, global_seq_idx=ids, layout="zigzag", backend=TorchGDPBackend(4))
    if scenario == "scan":
        options["summary_exchange"] = "scan"
    elif scenario == "states":
        options["output_final_state"] = True
    elif scenario == "unchecked":
        options["check_inputs"] = False
    elif scenario == "contiguous-metadata":
        options.pop("global_seq_idx")
        options["metadata"] = build_packed_sequence_cp_metadata(ids, rank, world)
    elif scenario == "one-rank-contiguous" and rank == 1:
        options["layout"] = "contiguous"
    try:
        gdp_chunkwise_context_parallel(*leaves, **options)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("scenario, expected", [
    pytest.param("scan", "summary_exchange='scan' is not supported", id="scan"),
    pytest.param("states", "does not support initial_state / output_final_state", id="states"),
    pytest.param("unchecked", "needs check_inputs=True", id="unchecked"),
    pytest.param("contiguous-metadata", "needs a cp_linear.zigzag.ZigzagCPMetadata", id="contiguous-metadata"),
    pytest.param("one-rank-contiguous", "disagree", id="ranks-disagree-on-layout"),
])
def test_gdp_unsupported_zigzag_option_raises_on_every_rank(gloo_pools, scenario, expected):
    messages = gloo_pools(2).run(gdp_errors, scenario)
    assert all(m is not None and expected in m for m in messages), messages
