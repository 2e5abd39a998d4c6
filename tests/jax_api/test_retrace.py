"""A new packing of the same shapes never retraces: GDP (one device and CP), block-diagonal attention
(one device and CP) and the Flax NNX layers and decoder, jitted once and called with three packings.

The packing (document boundaries: ``cu_seqlens``, ``seq_idx``, ``doc_ids``, plans, layouts) is
data; what a program is specialised on is the tensor shapes plus a few static bounds the caller
can pin (``max_sequences`` / ``min_shard_sequences`` for the GDP chunk layout, an exchange shape
for attention). Each test counts traces with a Python counter inside the jitted function (it runs
once per trace) and compiled programs with ``_cache_size()``, and checks that the results follow
the packing (so the packing really reached the program). ``test_the_counters_see_a_retrace`` shows
that the counting fails when a shape changes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cp_linear import reference as ref  # noqa: E402
from cp_linear.plan import ExchangeShape, widest_exchange_shape  # noqa: E402
from jax_api import blockdiag_attention, gated_delta_product, gdp_chunkwise_context_parallel  # noqa: E402
from jax_api.attention.blockdiag import plan_blockdiag_exchange  # noqa: E402
from jax_api.gdp.chunk import JaxGDPBackend  # noqa: E402
from jax_api.layers import DecoderConfig, HybridDecoder, build_layout, cp_apply  # noqa: E402
from tests.cp_linear.gdp_cases import random_gdp_inputs, rel_err, seq_idx_from_lengths  # noqa: E402
from tests.tolerance import assert_close, attention_length, decoder_length, gdp_length, tolerance  # noqa: E402

TOKENS, HEADS, KEY_DIM, VALUE_DIM, NUM_HOUSEHOLDER = 32, 2, 8, 6, 2  # cp 4: L = 8
GDP_TOLERANCE = tolerance(gdp_length(TOKENS, NUM_HOUSEHOLDER, KEY_DIM))

# Three packings of T = 32 with three sequences each (one-device cu_seqlens [4]); over cp = 4 every
# shard holds at most 3 sequences (max_sequences 4 covers them): one sequence over all ranks,
# sequences ending on rank boundaries, one-token sequences.
GDP_PACKINGS = ([3, 22, 7], [8, 16, 8], [1, 1, 30])


class TraceCount:
    """``jax.jit(fn)`` that counts its traces (the Python body runs once per trace, never per call)."""

    def __init__(self, fn, **jit_options):
        self.traces = 0

        def traced(*args):
            self.traces += 1
            return fn(*args)

        self.jitted = jax.jit(traced, **jit_options)

    def __call__(self, *args):
        return self.jitted(*args)

    @property
    def compiled(self) -> int:
        return self.jitted._cache_size()


def gdp_arrays(seed=0, tokens=TOKENS):
    inputs = random_gdp_inputs(np.random.default_rng(seed), tokens=tokens, heads=HEADS, key_dim=KEY_DIM,
                               value_dim=VALUE_DIM, num_householder=NUM_HOUSEHOLDER)
    return inputs, [jnp.asarray(x, jnp.float32) for x in inputs]


def cp_mesh(cp_size):
    return jax.make_mesh((cp_size,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:cp_size])


def assert_outputs_follow_the_packing(outputs, tol):
    """Different packings gave different results: the packing reached the compiled program as data."""
    for first, second in zip(outputs, outputs[1:]):
        assert rel_err(first, second) > 100 * tol


# --------------------------------------------------------------------------- GDP


def test_one_device_gdp_value_and_grad_traces_once_for_every_packing():
    """cu_seqlens is an argument: a new packing with N sequences reuses the program; fewer documents
    ride along as empty sequences at the end (FLA's convention), so N can be a fixed bound."""
    inputs, arrays = gdp_arrays()
    backend = JaxGDPBackend(chunk_size=8)

    def loss(q, k, v, g, beta, cu_seqlens):
        o, final_state = gated_delta_product(q, k, v, g, beta, cu_seqlens=cu_seqlens, num_householder=NUM_HOUSEHOLDER,
                                             use_qk_l2norm_in_kernel=True, backend=backend)
        return jnp.sum(o) + jnp.sum(final_state), o

    step = TraceCount(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    outputs = []
    for lengths in (*GDP_PACKINGS, [12, 20, 0]):  # the last: two documents and an empty sequence
        cu_seqlens = np.r_[0, np.cumsum(lengths)].astype(np.int32)
        (_, o), _ = step(*arrays, cu_seqlens)
        o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=NUM_HOUSEHOLDER, cu_seqlens=cu_seqlens,
                                                 use_qk_l2norm_in_kernel=True)
        assert_close(f"output {lengths}", o_ref, o, GDP_TOLERANCE)
        outputs.append(o)
    assert (step.traces, step.compiled) == (1, 1)
    assert_outputs_follow_the_packing(outputs, GDP_TOLERANCE)


def test_cp_gdp_value_and_grad_traces_once_for_every_packing():
    """global_seq_idx is an argument (replicated ids): the rank ranges and local offsets are computed
    on the device, so only T, the shapes and max_sequences are static."""
    inputs, arrays = gdp_arrays(1)
    mesh = cp_mesh(4)
    backend = JaxGDPBackend(chunk_size=8)

    def loss(q, k, v, g, beta, seq_idx):
        o = gdp_chunkwise_context_parallel(q, k, v, g, beta, mesh=mesh, global_seq_idx=seq_idx, max_sequences=4,
                                           num_householder=NUM_HOUSEHOLDER, use_qk_l2norm_in_kernel=True,
                                           backend=backend)
        return jnp.sum(o * o), o

    step = TraceCount(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    outputs = []
    for lengths in GDP_PACKINGS:
        (_, o), _ = step(*arrays, seq_idx_from_lengths(lengths).astype(np.int32))
        o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=NUM_HOUSEHOLDER,
                                                 cu_seqlens=np.r_[0, np.cumsum(lengths)], use_qk_l2norm_in_kernel=True)
        assert_close(f"output {lengths}", o_ref, o, GDP_TOLERANCE)
        outputs.append(o)
    assert (step.traces, step.compiled) == (1, 1)
    assert_outputs_follow_the_packing(outputs, GDP_TOLERANCE)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, so each test gets its own programs
class ForwardTraceCountingBackend(JaxGDPBackend):
    """The reference backend, counting the traces of its forward (``cp_forward_prepare`` runs once per
    trace of the op): it sees the library's own jitted program, which an eager caller cannot wrap."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "forward_traces", 0)

    def cp_forward_prepare(self, inputs):
        object.__setattr__(self, "forward_traces", self.forward_traces + 1)
        return super().cp_forward_prepare(inputs)


def test_eager_cp_gdp_with_concrete_ids_reuses_its_program():
    """Eager calls check concrete ids on the host, then run one cached jitted program per configuration:
    with ``max_sequences`` fixed, every packing runs the program traced for the first."""
    inputs, arrays = gdp_arrays(2)
    mesh = cp_mesh(4)
    backend = ForwardTraceCountingBackend(chunk_size=8)
    outputs = []
    for lengths in GDP_PACKINGS:
        o = gdp_chunkwise_context_parallel(*arrays, mesh=mesh, global_seq_idx=seq_idx_from_lengths(lengths),
                                           max_sequences=4, num_householder=NUM_HOUSEHOLDER, backend=backend)
        o_ref, _ = ref.naive_gated_delta_product(*inputs, num_householder=NUM_HOUSEHOLDER,
                                                 cu_seqlens=np.r_[0, np.cumsum(lengths)])
        assert_close(f"output {lengths}", o_ref, o, GDP_TOLERANCE)
        outputs.append(o)
        if len(outputs) == 1:
            first_traces = backend.forward_traces
    assert first_traces >= 1 and backend.forward_traces == first_traces
    assert_outputs_follow_the_packing(outputs, GDP_TOLERANCE)


# --------------------------------------------------------------------------- block-diagonal attention

ATTENTION_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
ATTENTION_TOLERANCE = tolerance(attention_length(TOKENS, HEAD_DIM))


def doc_ids_from_runs(*runs):
    return np.concatenate([np.full(n, d, np.int32) for d, n in runs])


# T = 32 over cp = 4 (L = 8); 0 = padding. auto resolves SPANS_THREE_RANKS to a2a, the other two to
# a halo of 8 rows (the same bucketed shape class).
SPANS_THREE_RANKS = doc_ids_from_runs((1, 3), (2, 19), (0, 2), (3, 1), (4, 5), (0, 2))
HALO_OF_EIGHT = doc_ids_from_runs((1, 10), (2, 10), (3, 12))
STARTS_ON_A_BOUNDARY = doc_ids_from_runs((1, 5), (0, 3), (2, 16), (3, 8))


def attention_arrays(seed=0, tokens=TOKENS):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, tokens, ATTENTION_HEADS, HEAD_DIM))
    k, v = (rng.normal(size=(1, tokens, KV_HEADS, HEAD_DIM)) for _ in range(2))
    return (q, k, v), [jnp.asarray(x, jnp.float32) for x in (q, k, v)]


def attention_step(mesh):
    """jit(value_and_grad) of sum(o^2) through the global op, the plan an argument; counts traces."""

    def loss(q, k, v, plan):
        o = blockdiag_attention(q, k, v, plan, mesh=mesh)
        return jnp.sum(o * o), o

    return TraceCount(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def run_attention_packings(step, inputs, arrays, plans_and_ids):
    outputs = []
    for plan, doc_ids in plans_and_ids:
        (_, o), _ = step(*arrays, plan)
        assert_close(f"output {doc_ids.tolist()}", ref.blockdiag_attention(*inputs, doc_ids), o, ATTENTION_TOLERANCE)
        outputs.append(o)
    assert_outputs_follow_the_packing(outputs, ATTENTION_TOLERANCE)


@pytest.mark.parametrize("cp_size", [1, 4])
def test_attention_with_a_fixed_exchange_shape_traces_once_for_every_packing(cp_size):
    """A plan built with a fixed shape (``widest_exchange_shape``) has one shape class: halo-able and
    a2a-only packings alike run the first program. On one device every plan has the same class."""
    inputs, arrays = attention_arrays(cp_size)
    step = attention_step(cp_mesh(cp_size))
    fixed = widest_exchange_shape("a2a", cp_size, TOKENS // cp_size, a2a_impl="ppermute") if cp_size > 1 else None
    packings = (SPANS_THREE_RANKS, HALO_OF_EIGHT, STARTS_ON_A_BOUNDARY)
    run_attention_packings(step, inputs, arrays,
                           [(plan_blockdiag_exchange(ids, cp_size, shape=fixed), ids) for ids in packings])
    assert (step.traces, step.compiled) == (1, 1)


def test_attention_with_bucketed_plans_traces_once_per_shape_class():
    """Default plans: packings whose rounded exchange sizes agree share a program."""
    inputs, arrays = attention_arrays(5)
    step = attention_step(cp_mesh(4))
    plans = [plan_blockdiag_exchange(ids, 4) for ids in (HALO_OF_EIGHT, STARTS_ON_A_BOUNDARY)]
    assert {plan.shape for plan in plans} == {ExchangeShape("halo", halo_len=8)}
    run_attention_packings(step, inputs, arrays, zip(plans, (HALO_OF_EIGHT, STARTS_ON_A_BOUNDARY)))
    assert (step.traces, step.compiled) == (1, 1)


def test_a_fixed_exchange_shape_rejects_a_packing_it_cannot_serve():
    halo = widest_exchange_shape("halo", 4, 8)
    assert plan_blockdiag_exchange(HALO_OF_EIGHT, 4, shape=halo).shape == halo
    with pytest.raises(ValueError, match="does not fit the fixed exchange shape"):
        plan_blockdiag_exchange(SPANS_THREE_RANKS, 4, shape=halo)  # a document over three ranks: no halo
    with pytest.raises(ValueError, match="does not fit the fixed exchange shape"):
        plan_blockdiag_exchange(HALO_OF_EIGHT, 4, shape=ExchangeShape("halo", halo_len=4))


# --------------------------------------------------------------------------- layers and decoder

DECODER = DecoderConfig(vocab_size=13, hidden_size=16, num_layers=2, num_heads=2, head_dim=4, num_kv_heads=1)
# two GDP sequences / attention documents more or fewer: before the one-device cu_seqlens was
# padded to a static bound, each count compiled its own program
DECODER_PACKINGS = (HALO_OF_EIGHT, STARTS_ON_A_BOUNDARY, SPANS_THREE_RANKS)


def decoder_and_tokens():
    model = HybridDecoder(DECODER, rngs=nnx.Rngs(0), gdp_options={"backend": JaxGDPBackend(chunk_size=8)})
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, DECODER.vocab_size, size=(1, TOKENS)), jnp.int32)
    return model, tokens


def test_decoder_on_one_device_and_under_cp_traces_once_for_every_packing():
    """HybridDecoder (GDP and attention layers) jitted with the layout as an argument: on one device,
    and under CP (``cp_apply``) with the static bounds pinned (``min_shard_sequences``, a fixed
    attention shape). Logits and parameter gradients per packing; CP logits equal one device's."""
    model, tokens = decoder_and_tokens()
    graphdef, state = nnx.split(model)
    mesh = cp_mesh(4)

    def one_device_loss(state, layout):
        logits = nnx.merge(graphdef, state)(tokens, layout=layout)
        return jnp.mean(logits * logits), logits

    def cp_loss(state, layout):
        logits = cp_apply(nnx.merge(graphdef, state), tokens, layout, mesh=mesh)
        return jnp.mean(logits * logits), logits

    one_device = TraceCount(jax.value_and_grad(one_device_loss, has_aux=True))
    cp = TraceCount(jax.value_and_grad(cp_loss, has_aux=True))
    fixed = widest_exchange_shape("a2a", 4, TOKENS // 4, a2a_impl="ppermute")
    tol = tolerance(decoder_length(DECODER, TOKENS), compared_with="rounded")
    outputs = []
    for doc_ids in DECODER_PACKINGS:
        (_, logits), _ = one_device(state, build_layout(total_len=TOKENS, doc_ids=doc_ids, min_shard_sequences=8))
        layout = build_layout(total_len=TOKENS, doc_ids=doc_ids, cp_size=4, min_shard_sequences=4,
                              attention_shape=fixed)
        (_, cp_logits), _ = cp(state, layout)
        assert_close(f"CP logits {doc_ids.tolist()}", logits, cp_logits, tol)
        outputs.append(logits)
    assert (one_device.traces, one_device.compiled) == (1, 1)
    assert (cp.traces, cp.compiled) == (1, 1)
    assert_outputs_follow_the_packing(outputs, tol)


def test_one_device_layout_pads_the_sequence_offsets_to_a_static_bound():
    """The regression behind the decoder test: a layout's cu_seqlens has a static length (the bound,
    rounded up to a power of two), whatever the number of documents."""
    shapes = {build_layout(total_len=TOKENS, doc_ids=ids).cu_seqlens.shape for ids in (HALO_OF_EIGHT,
                                                                                      STARTS_ON_A_BOUNDARY)}
    assert shapes == {(5,)}  # 3 and 4 runs: bound 4
    layout = build_layout(total_len=TOKENS, doc_ids=HALO_OF_EIGHT)
    np.testing.assert_array_equal(layout.cu_seqlens, [0, 10, 20, 32, 32])


# --------------------------------------------------------------------------- the counters can fail


def test_the_counters_see_a_retrace():
    """A change of shape (T) or of shape class (the exchange plan of another mode) traces and compiles
    again, and the counters say so: the assertions above can fail."""
    _, arrays = attention_arrays(7)
    step = attention_step(cp_mesh(4))
    step(*arrays, plan_blockdiag_exchange(HALO_OF_EIGHT, 4))
    step(*arrays, plan_blockdiag_exchange(SPANS_THREE_RANKS, 4))  # auto: a2a, another static shape
    assert (step.traces, step.compiled) == (2, 2)
    longer = [jnp.concatenate([x, x], axis=1) for x in arrays]
    step(*longer, plan_blockdiag_exchange(np.concatenate([HALO_OF_EIGHT, HALO_OF_EIGHT + 3]), 4))
    assert (step.traces, step.compiled) == (3, 3)
