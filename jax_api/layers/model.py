"""``HybridDecoder`` as a Flax NNX module (same blocks, names and math as ``torch_api.layers.HybridDecoder``).

    input_ids [B, L] -> embeddings -> N x block -> norm -> lm_head -> logits [B, L, vocab]
    block:  h = h + attn(attn_norm(h));  h = h + mlp(mlp_norm(h))     (attn: GDP or attention)

CP: run the model inside ``jax.shard_map`` with the weights replicated (``P()``), tokens split
along T (``P(None, "cp")``) and the ``TokenLayout`` replicated; ``cp_apply`` does exactly that for
global arrays. Weight gradients of a replicated model come out summed over ranks (shard_map's
transpose of an unvarying input), so ``jax.grad`` of a psum-ed loss is the full gradient.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_api._mesh import is_explicit, place, run_mesh
from jax_api.layers.attention import BlockDiagAttention
from jax_api.layers.blocks import Embedding, GatedMLP, Linear, RMSNorm
from jax_api.layers.gdp import GatedDeltaProduct
from jax_api.layers.layout import TokenLayout, build_layout
from cp_linear.model_config import DecoderConfig
from jax_api.layers.convert import StateTableMixin


class HybridBlock(nnx.Module):
    def __init__(self, config: DecoderConfig, kind: str, *, rngs: nnx.Rngs, gdp_options=None, attention_options=None):
        self.kind = kind
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        if kind == "gdp":
            self.attn = GatedDeltaProduct(config.gdp_config(), rngs=rngs, **(gdp_options or {}))
        else:
            self.attn = BlockDiagAttention(config.attention_config(), rngs=rngs, **(attention_options or {}))
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.mlp_width, rngs=rngs)

    def __call__(self, h, layout, axis_name, initial_state=None, output_final_state: bool = False,
                 num_sequences: int | None = None):
        """h -> h, or (h, the GDP mixer's final state) with ``output_final_state`` (GDP blocks only)."""
        if self.kind == "gdp" and (initial_state is not None or output_final_state):
            mixed, final_state = self.attn(self.attn_norm(h), layout=layout, axis_name=axis_name,
                                           initial_state=initial_state, output_final_state=True,
                                           num_sequences=num_sequences)
        else:
            mixed, final_state = self.attn(self.attn_norm(h), layout=layout, axis_name=axis_name), None
        h = h + mixed
        h = h + self.mlp(self.mlp_norm(h))
        return (h, final_state) if output_final_state else h


class HybridDecoder(StateTableMixin, nnx.Module):
    """``__call__(input_ids [B, L], *, layout=None, axis_name=None, doc_ids=None) -> logits [B, L, V]``.

    One device: ``doc_ids`` int [T] (0 = padding, B = 1) or a ``layout``; neither: each row one
    document. Inside a shard_map: ``axis_name`` and a replicated ``layout`` built for the cp size.
    ``compute_dtype`` (e.g. ``jnp.bfloat16``) casts the activations; norms and gates compute in float32.

    Continuing long documents across training windows: ``gdp_states`` maps a GDP layer's index in
    ``layers`` to its ``initial_state`` float [N, Hv, K, V] (``GatedDeltaProduct``'s; a layer left out
    starts from zeros); ``output_gdp_states=True`` returns ``(logits, {index: final_state})`` for every
    GDP layer. N is static: the states' first dimension, else ``num_sequences`` (the layout's GDP
    sequences, needed for a packed layout without states). Inside a shard_map the final states are
    this rank's rows (``gdp_chunkwise_context_parallel_shard``); ``cp_apply`` sums them over the axis.
    Attention layers see only their window, and the short conv does not carry its ``conv_size - 1``
    tokens (docs/cp_options.md "Sequence states in the layers").
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, gdp_options: dict | None = None,
                 attention_options: dict | None = None, init_std: float = 0.02, compute_dtype=None):
        self.config = config
        self.compute_dtype = compute_dtype  # e.g. jnp.bfloat16: activations in it, weights stay float32
        self.embeddings = Embedding(config.vocab_size, config.hidden_size, rngs=rngs, std=init_std)
        self.layers = nnx.List([HybridBlock(config, kind, rngs=rngs, gdp_options=gdp_options,
                                            attention_options=attention_options) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, rngs=rngs)
        # the same initial distribution as the torch model: N(0, init_std) for projections
        for path, param in nnx.iter_graph(self):
            if isinstance(param, nnx.Param) and path and path[-1] == "weight" and len(path) >= 2 and (
                    str(path[-2]).endswith("proj") or path[-2] == "lm_head"):
                param[...] = init_std * jax.random.normal(rngs.params(), param.shape, param.dtype)

    def __call__(self, input_ids: jax.Array, *, layout: TokenLayout | None = None, axis_name: str | None = None,
                 doc_ids=None, gdp_states: dict | None = None, output_gdp_states: bool = False,
                 num_sequences: int | None = None):
        if getattr(input_ids, "ndim", None) != 2:
            raise ValueError(f"input_ids must be an int array [B, L]; "
                             f"received shape {getattr(input_ids, 'shape', None)}")
        if layout is None:
            if axis_name is not None:
                raise ValueError("under CP (axis_name given) pass layout=build_layout(..., cp_size=...)")
            layout = build_layout(total_len=input_ids.shape[1], doc_ids=doc_ids)
        elif doc_ids is not None:
            raise ValueError("pass either layout or doc_ids, not both")
        gdp_layers = [i for i, block in enumerate(self.layers) if block.kind == "gdp"]
        gdp_states = {} if gdp_states is None else gdp_states
        if not isinstance(gdp_states, dict) or any(key not in gdp_layers for key in gdp_states):
            keys = list(gdp_states) if isinstance(gdp_states, dict) else type(gdp_states).__name__
            raise ValueError(f"gdp_states must be a dict keyed by GDP layer indices {gdp_layers}; received {keys}")
        if num_sequences is None and gdp_states:
            num_sequences = next(iter(gdp_states.values())).shape[0]
        final_states = {}
        h = self.embeddings(input_ids)
        if self.compute_dtype is not None:
            h = h.astype(self.compute_dtype)
        for index, block in enumerate(self.layers):
            if output_gdp_states and block.kind == "gdp":
                h, final_states[index] = block(h, layout, axis_name, gdp_states.get(index), True, num_sequences)
            else:
                h = block(h, layout, axis_name, gdp_states.get(index))
        logits = self.lm_head(self.norm(h))
        return (logits, final_states) if output_gdp_states else logits


def cp_apply(model: nnx.Module, input_ids: jax.Array, layout: TokenLayout, *, mesh, axis_name: str = "cp",
             gdp_states: dict | None = None, output_gdp_states: bool = False, num_sequences: int | None = None):
    """Logits [B, T, V] of ``model`` on global ``input_ids`` [B, T], split along T over ``mesh[axis_name]``.

    Runs the model once per shard inside ``jax.shard_map`` (weights and layout replicated).
    Differentiable with respect to the model's state through ``nnx.split`` / ``nnx.merge``.
    ``gdp_states`` / ``output_gdp_states`` / ``num_sequences``: as ``HybridDecoder``, with the states
    replicated in and out: ``(logits, {index: final_state [N, Hv, K, V]})``, each the one-device final
    state (summed over the axis), ready to be the next window's ``gdp_states``.
    """
    graphdef, state = nnx.split(model)
    tokens = P(None, axis_name)
    mesh = run_mesh(mesh)  # Explicit axes outside a mesh context: their Auto twin (jax_api/_mesh.py)
    if is_explicit(mesh, axis_name):  # the types must match shard_map's in_specs
        input_ids = place(input_ids, mesh, tokens)

    def per_shard(state, ids, layout, gdp_states):
        result = nnx.merge(graphdef, state)(ids, layout=layout, axis_name=axis_name, gdp_states=gdp_states,
                                            output_gdp_states=output_gdp_states, num_sequences=num_sequences)
        if not output_gdp_states:
            return result
        logits, final_states = result  # each rank holds the rows of the sequences ending on it
        return logits, {index: jax.lax.psum(final, axis_name) for index, final in final_states.items()}

    out_specs = (tokens, P()) if output_gdp_states else tokens
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), tokens, P(), P()), out_specs=out_specs)(
        state, input_ids, layout, gdp_states)


__all__ = ["HybridBlock", "HybridDecoder", "cp_apply"]
