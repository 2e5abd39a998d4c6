"""The zig-zag CP layout (``cp_linear.zigzag``) in JAX on CPU host devices, meshes of 2-4.

Rank r holds chunks r and 2·cp−1−r. The global entry points take the arrays in the layout's rank order
(``x[:, layout_permutation(T, cp, "zigzag")]``); every result is put back in sequence order and compared
with the contiguous layout on the same mesh and with float64 references (the torch test's cases and
oracles, tests/torch_api/test_zigzag.py): GDP outputs and all five input gradients, block-diagonal
attention outputs and q/k/v gradients, a ``HybridDecoder``'s logits and every weight gradient (also
against one device). Unsupported options raise torch's messages; non-finite inputs are contained as in
the contiguous layout; one check runs torch's zig-zag GDP (gloo, world 2) on the same inputs.
"""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cp_linear.model_config import DecoderConfig  # noqa: E402
from cp_linear.zigzag import inverse_permutation, layout_permutation  # noqa: E402
from jax_api.attention.blockdiag import blockdiag_attention, plan_blockdiag_exchange  # noqa: E402
from jax_api.gdp.chunk import JaxGDPBackend  # noqa: E402
from jax_api.gdp.cp import gdp_chunkwise_context_parallel  # noqa: E402
from jax_api.layers import (  # noqa: E402
    GatedDeltaProduct,
    HybridDecoder,
    build_layout,
    cp_apply,
    flatten_jax_state,
)
from tests.cp_linear.gdp_cases import seq_idx_from_lengths  # noqa: E402
from tests.tolerance import attention_length, decoder_length, gdp_length, tolerance  # noqa: E402
from tests.torch_api.test_gdp_chunk import NAMES, check_close, cu_from_lengths, oracle  # noqa: E402
from tests.torch_api.test_zigzag import (  # noqa: E402
    HEADS,
    KEY_DIM,
    LOCAL_LEN,
    VALUE_DIM,
    attention_cases,
    attention_float64,
    attention_inputs,
    check_attention_layouts,
    decoder_doc_ids,
    decoder_inputs,
    gdp_case_data,
    gdp_cases,
    run_gdp_layouts,
    scatter_to_global,
    token_rows,
)

WORLDS = (2, 3, 4)
LAYOUTS = ("contiguous", "zigzag")
# one flavour per program (the packing is data, so one compiled program serves every packed case)
PACKED_FLAVOUR = dict(num_householder=2, l2norm=True, chunk_size=4)
ROWS_FLAVOUR = dict(num_householder=1, l2norm=False, chunk_size=8)
ROWS_WORLD = 3


@functools.lru_cache(maxsize=None)
def mesh_of(world):
    return jax.make_mesh((world,), ("cp",), devices=jax.devices()[:world])


class RankOrder:
    """Moves [B, T·m, ...] arrays between sequence order and a layout's rank order (m steps per token)."""

    def __init__(self, world: int, layout: str):
        self.perm = layout_permutation(world * LOCAL_LEN, world, layout)

    def rows(self, per_token: int) -> np.ndarray:
        return token_rows(self.perm, per_token)

    def to_ranks(self, x, per_token: int = 1):
        return np.asarray(x)[:, self.rows(per_token)]

    def to_sequence(self, x, per_token: int = 1):
        return np.asarray(x)[:, inverse_permutation(self.rows(per_token))]


def per_token_steps(name: str, num_householder: int) -> int:
    return 1 if name in ("q", "g", "o") else num_householder


# --------------------------------------------------------------------------- GDP


def jax_gdp_cases(world):
    """The torch test's packings with one flavour per program: packed cases share one, rows another.
    Batch rows run on the 3-device mesh only: each program costs a compilation (seconds on 2 cores)."""
    return [{**case, **(PACKED_FLAVOUR if case["lengths"] else ROWS_FLAVOUR)} for case in gdp_cases(world)
            if case["lengths"] or world == ROWS_WORLD]


def crossing_case(world):
    """The packing whose sequences cross chunk boundaries (one spans chunks on different ranks)."""
    return next(case for case in jax_gdp_cases(world) if case["name"] == "sequences-cross-chunk-boundaries")


@functools.lru_cache(maxsize=None)
def gdp_value_and_grad(world, layout, num_householder, l2norm, chunk_size, packed):
    """jit(value_and_grad) of sum(o * do) through the global CP op; the ids are an argument."""
    mesh = mesh_of(world)

    def loss(q, k, v, g, beta, seq_idx, output_grad):
        o = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx if packed else None,
                                           num_householder=num_householder, use_qk_l2norm_in_kernel=l2norm,
                                           backend=JaxGDPBackend(chunk_size), layout=layout)
        return jnp.sum(o * output_grad), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def run_gdp(case, world, layout, arrays=None):
    """Output and input gradients in sequence order (numpy float64), from arrays fed in rank order."""
    data, output_grad = gdp_case_data(case, world)
    arrays = data if arrays is None else arrays
    n, order = case["num_householder"], RankOrder(world, layout)
    packed = case["lengths"] is not None
    seq_idx = seq_idx_from_lengths(case["lengths"]) if packed else np.zeros((1, world * LOCAL_LEN), np.int64)
    fn = gdp_value_and_grad(world, layout, n, case["l2norm"], case["chunk_size"], packed)
    leaves = [jnp.asarray(order.to_ranks(x, per_token_steps(name, n)), jnp.float32) for name, x in zip(NAMES, arrays)]
    (_, output), grads = fn(*leaves, jnp.asarray(seq_idx, jnp.int32),
                            jnp.asarray(order.to_ranks(output_grad), jnp.float32))
    result = {"o": order.to_sequence(output)}
    result.update({f"d{name}": order.to_sequence(grad, per_token_steps(name, n)) for name, grad in zip(NAMES, grads)})
    return {key: value.astype(np.float64) for key, value in result.items()}


@pytest.mark.parametrize("world", WORLDS)
def test_gdp_zigzag_matches_contiguous_and_float64(world):
    for case in jax_gdp_cases(world):
        arrays, output_grad = gdp_case_data(case, world)
        n = case["num_householder"]
        cu = None if case["lengths"] is None else cu_from_lengths(case["lengths"])
        float64 = oracle(arrays, num_householder=n, cu_seqlens=cu, l2norm=case["l2norm"], output_grad=output_grad)
        zigzag, contiguous = (run_gdp(case, world, layout) for layout in ("zigzag", "contiguous"))
        length = gdp_length(world * LOCAL_LEN, n, KEY_DIM)
        for key in ("o", *(f"d{name}" for name in NAMES)):
            label = f"{case['name']} (world {world}) {key}"
            check_close(f"{label} zigzag vs float64", zigzag[key], float64[key], tolerance(length))
            check_close(f"{label} zigzag vs contiguous", zigzag[key], contiguous[key],
                        tolerance(length, compared_with="rounded"))


def test_gdp_zigzag_contains_a_non_finite_input_as_the_contiguous_layout_does():
    """NaN in one token of a sequence spanning chunks held by different ranks: the same outputs are NaN
    in both layouts (that token's sequence from it on) and every other output is equal."""
    world = 3
    case = crossing_case(world)
    arrays, _ = gdp_case_data(case, world)
    q, k, v, g, beta = (np.array(x) for x in arrays)
    v[0, 8 * case["num_householder"]] = np.nan  # a step of token 8: the third sequence, on chunk 1 (rank 1)
    outputs = {layout: run_gdp(case, world, layout, (q, k, v, g, beta))["o"] for layout in LAYOUTS}
    bad = np.isnan(outputs["contiguous"])
    assert bad.any() and not bad.all()
    np.testing.assert_array_equal(np.isnan(outputs["zigzag"]), bad)
    length = gdp_length(world * LOCAL_LEN, case["num_householder"], KEY_DIM)
    check_close("finite outputs", outputs["zigzag"][~bad], outputs["contiguous"][~bad],
                tolerance(length, compared_with="rounded"))


@pytest.mark.multirank
def test_gdp_zigzag_agrees_with_torch_zigzag(gloo_pools):
    """The same inputs through torch's zig-zag op (gloo ranks) and JAX's (host devices), world 2."""
    world = 2
    case = crossing_case(world)
    case = {**case, "dtype": torch.float32}
    per_rank = gloo_pools(world).run(run_gdp_layouts, [case])
    torch_zigzag = scatter_to_global([r[0]["zigzag"] for r in per_rank], world, "zigzag", case["num_householder"])
    jax_zigzag = run_gdp(case, world, "zigzag")
    length = gdp_length(world * LOCAL_LEN, case["num_householder"], KEY_DIM)
    for key in ("o", *(f"d{name}" for name in NAMES)):
        check_close(f"torch vs JAX zigzag {key}", jax_zigzag[key], torch_zigzag[key],
                    tolerance(length, compared_with="rounded"))


# --------------------------------------------------------------------------- block-diagonal attention


@functools.lru_cache(maxsize=None)
def attention_value_and_grad(world):
    """One jitted function per mesh; the plan (and with it the layout) is an argument."""
    mesh = mesh_of(world)

    def loss(q, k, v, plan, cotangent):
        out = blockdiag_attention(q, k, v, plan, mesh=mesh, layout=plan.layout)
        return jnp.sum(out * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def run_attention(doc_ids, inputs, world, layout):
    order = RankOrder(world, layout)
    q, k, v, cotangent = (jnp.asarray(order.to_ranks(x), jnp.float32) for x in inputs)
    plan = plan_blockdiag_exchange(doc_ids, world, layout=layout)
    (_, out), grads = attention_value_and_grad(world)(q, k, v, plan, cotangent)
    return {key: order.to_sequence(x).astype(np.float64) for key, x in zip(("o", "dq", "dk", "dv"), (out, *grads))}


@pytest.mark.parametrize("world", WORLDS)
def test_attention_zigzag_matches_contiguous_and_full_sequence(world):
    tol = tolerance(attention_length(world * LOCAL_LEN, 8))
    for index, (name, doc_ids) in enumerate(attention_cases(world).items()):
        inputs = attention_inputs(index, world * LOCAL_LEN)
        expected = attention_float64(doc_ids, *inputs)
        zigzag, contiguous = (run_attention(doc_ids, inputs, world, layout) for layout in ("zigzag", "contiguous"))
        check_attention_layouts(f"{name} (world {world})", expected, zigzag, contiguous, doc_ids, tol)


# --------------------------------------------------------------------------- HybridDecoder


# one GDP and one attention layer: every zig-zag path of the layers (conv windows, RoPE positions, GDP
# metadata, attention plan) at half the compile time of the torch test's four
DECODER = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=2, num_heads=2, head_dim=8, num_kv_heads=1)


def decoder_run(world, doc_ids, layout):
    """Logits in sequence order and the weight gradients of sum(logits * cotangent); ``layout`` None:
    one device."""
    tokens, cotangent = decoder_inputs(world)
    model = HybridDecoder(DECODER, rngs=nnx.Rngs(0))  # the same weights for every run
    order = None if layout is None else RankOrder(world, layout)
    if order is not None:
        tokens, cotangent = order.to_ranks(tokens), order.to_ranks(cotangent)
        token_layout = build_layout(total_len=world * LOCAL_LEN, doc_ids=doc_ids, cp_size=world, layout=layout)

    def loss(model):
        if order is None:
            logits = model(jnp.asarray(tokens), doc_ids=doc_ids)
        else:
            logits = cp_apply(model, jnp.asarray(tokens), token_layout, mesh=mesh_of(world))
        return jnp.sum(logits * jnp.asarray(cotangent, jnp.float32)), logits

    (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    logits = np.asarray(logits) if order is None else order.to_sequence(logits)
    return logits.astype(np.float64), {name: np.asarray(g, np.float64) for name, g in flatten_jax_state(grads).items()}


@pytest.mark.parametrize("world, case", [(2, "rows"), (4, "packed")])
def test_decoder_zigzag_matches_one_device(world, case):
    """Against the whole sequence on one device (the contiguous layout's own reference in test_layers).
    Two of the six (world, case) pairs: a decoder program takes ~14 s to compile on 2 cores."""
    total = world * LOCAL_LEN
    tol = tolerance(decoder_length(DECODER, total) + DECODER.vocab_size * total, compared_with="rounded")
    doc_ids = decoder_doc_ids(world)[case]
    zigzag_logits, zigzag_grads = decoder_run(world, doc_ids, "zigzag")
    logits, grads = decoder_run(world, doc_ids, None)
    label = f"{case} (world {world}) zigzag vs one-device"
    check_close(f"{label} logits", zigzag_logits, logits, tol)
    assert zigzag_grads.keys() == grads.keys()
    for param, grad in grads.items():
        check_close(f"{label} d{param}", zigzag_grads[param], grad, tol)


# --------------------------------------------------------------------------- unsupported options


def gdp_error(scenario):
    world = 2
    case = crossing_case(world)
    arrays, _ = gdp_case_data(case, world)
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in arrays)
    options = dict(mesh=mesh_of(world), global_seq_idx=seq_idx_from_lengths(case["lengths"]),
                   num_householder=case["num_householder"], layout="zigzag")
    if scenario == "scan":
        options["summary_exchange"] = "scan"
    elif scenario == "final-states":
        options["output_final_state"] = True
    elif scenario == "initial-states":
        options["initial_state"] = jnp.zeros((len(case["lengths"]), HEADS, KEY_DIM, VALUE_DIM))
    elif scenario == "unknown-layout":
        options["layout"] = "diagonal"
    elif scenario == "tokens-not-divisible-by-2cp":  # 20 tokens split over 4 ranks, but not into 8 chunks
        options.update(mesh=mesh_of(4), global_seq_idx=None)
        steps = 20 * case["num_householder"]
        q, g, k, v, beta = q[:, :20], g[:, :20], k[:, :steps], v[:, :steps], beta[:, :steps]
    gdp_chunkwise_context_parallel(q, k, v, g, beta, **options)


@pytest.mark.parametrize("scenario, expected", [
    pytest.param("scan", "summary_exchange='scan' is not supported", id="scan"),
    pytest.param("final-states", "does not support initial_state / output_final_state", id="final-states"),
    pytest.param("initial-states", "does not support initial_state / output_final_state", id="initial-states"),
    pytest.param("unknown-layout", "layout must be one of", id="unknown-layout"),
    pytest.param("tokens-not-divisible-by-2cp", r"T = 20 must be a positive multiple of 8 \(the zigzag layout",
                 id="tokens-not-divisible-by-2cp"),
])
def test_gdp_unsupported_zigzag_option_raises(scenario, expected):
    with pytest.raises(ValueError, match=expected):
        gdp_error(scenario)


def attention_error(scenario):
    world = 2
    doc_ids = np.ones(world * LOCAL_LEN, np.int64)
    q = jnp.zeros((1, world * LOCAL_LEN, 2, 8))
    if scenario in ("halo", "a2a"):
        blockdiag_attention(q, q, q, doc_ids, mesh=mesh_of(world), mode=scenario, layout="zigzag")
    elif scenario == "unknown-layout":
        blockdiag_attention(q, q, q, doc_ids, mesh=mesh_of(world), layout="diagonal")
    elif scenario == "plan-of-another-layout":
        blockdiag_attention(q, q, q, plan_blockdiag_exchange(doc_ids, world), mesh=mesh_of(world), layout="zigzag")
    elif scenario == "layout-halo":
        build_layout(total_len=world * LOCAL_LEN, doc_ids=doc_ids, cp_size=world, layout="zigzag",
                     attention_mode="halo")


@pytest.mark.parametrize("scenario, expected", [
    pytest.param("halo", "layout='zigzag' exchanges K/V by all-gather; mode='halo'", id="zigzag-halo"),
    pytest.param("a2a", "mode='a2a' is not supported", id="zigzag-a2a"),
    pytest.param("unknown-layout", "layout must be one of", id="unknown-layout"),
    pytest.param("plan-of-another-layout", "layout='zigzag' differs from the plan's layout='contiguous'",
                 id="plan-of-another-layout"),
    pytest.param("layout-halo", "mode='halo' is not supported", id="token-layout-with-halo"),
])
def test_attention_unsupported_zigzag_option_raises(scenario, expected):
    with pytest.raises(ValueError, match=expected):
        attention_error(scenario)


def test_gdp_layer_conv_longer_than_a_zigzag_chunk_raises():
    world = 2
    layer = GatedDeltaProduct(hidden_size=16, head_dim=8, num_heads=2, conv_size=LOCAL_LEN // 2 + 2,
                              rngs=nnx.Rngs(0))
    layout = build_layout(total_len=world * LOCAL_LEN, cp_size=world, layout="zigzag")
    tokens = P(None, "cp")
    run = jax.shard_map(lambda x: layer(x, layout=layout, axis_name="cp"), mesh=mesh_of(world), in_specs=tokens,
                        out_specs=tokens)
    x = jax.device_put(jnp.zeros((1, world * LOCAL_LEN, 16)), NamedSharding(mesh_of(world), tokens))
    with pytest.raises(ValueError, match=r"conv_size - 1 = 7 exceeds the zig-zag chunk length L / 2 = 6"):
        run(x)
