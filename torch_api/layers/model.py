"""``HybridDecoder``: a small language model alternating GDP and block-diagonal attention blocks.

    input_ids [B, L] -> embeddings -> N x block -> norm -> lm_head -> logits [B, L, vocab]
    block:  h = h + mixer(attn_norm(h));  h = h + mlp(mlp_norm(h))     (mixer: GDP or attention)

The residual stream h has the embeddings' dtype, or ``compute_dtype`` (e.g. bf16, as the JAX model's).

Parameter names follow flash-linear-attention's models (``embeddings``, ``layers.{i}.attn_norm``,
``layers.{i}.attn``, ``layers.{i}.mlp_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head``), without FLA's ``model.`` prefix. Under CP every rank holds its shard of the tokens
and a full replica of the weights; the layers exchange what they need, so the caller only has to
sum the loss pieces and all-reduce the weight gradients (see examples/train_torch.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_api._dist import resolve_group
from torch_api.layers.attention import BlockDiagAttention
from torch_api.layers.blocks import GatedMLP, Linear, RMSNorm
from cp_linear.model_config import DecoderConfig, config_fingerprint
from cp_linear.validation import digest
from torch_api.layers.convert import StateTableMixin
from torch_api.layers.gdp import GatedDeltaProduct
from torch_api.layers.layout import ShardLayout, build_shard_layout, compiling


class HybridBlock(nn.Module):
    def __init__(self, config: DecoderConfig, kind: str, **mixer_options):
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        if kind == "gdp":
            self.attn = GatedDeltaProduct(config.gdp_config(), **mixer_options.get("gdp", {}))
        else:
            self.attn = BlockDiagAttention(config.attention_config(), **mixer_options.get("attention", {}))
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.mlp_width)

    def forward(self, h: torch.Tensor, layout: ShardLayout, initial_state=None, output_final_state: bool = False):
        """h -> h, or (h, the GDP mixer's final state) with ``output_final_state`` (GDP blocks only)."""
        if self.kind == "gdp" and (initial_state is not None or output_final_state):
            mixed, final_state = self.attn(self.attn_norm(h), layout=layout, initial_state=initial_state,
                                           output_final_state=True)
        else:
            mixed, final_state = self.attn(self.attn_norm(h), layout=layout), None
        h = h + mixed
        h = h + self.mlp(self.mlp_norm(h))
        return (h, final_state) if output_final_state else h


class HybridDecoder(StateTableMixin, nn.Module):
    """The hybrid decoder of ``DecoderConfig``.

    ``forward(input_ids [B, L], *, doc_ids=None, cp_group=None, layout=None) -> logits [B, L, V]``
    (in the residual stream's dtype: float32 with float32 weights, unless autocast or ``compute_dtype``
    lowers it). ``doc_ids`` int [T] are the *global* document ids (0 =
    padding; B = 1), replicated on every rank under CP; without them each row is one document.
    ``layout`` (``build_shard_layout``) replaces doc_ids/cp_group when built once per step.
    ``gdp_options`` / ``attention_options`` go to every mixer (e.g. ``{"mode": "a2a"}``).

    ``compute_dtype`` (a floating torch dtype, e.g. ``torch.bfloat16``; None: the embeddings' dtype) is
    the JAX model's option: the embeddings' output is cast to it, so the residual stream, every block's
    input and output and the logits are in it, while the weights stay as they are (float32), cast at
    each matmul by autocast or, without autocast, by the layers (``blocks.Linear``). Norms and gates
    compute in float32 and round once. Under bf16 autocast it spares the float32 residual's traffic
    and autocast's per-linear casts of float32 activations (docs/models.md "Precision").

    Continuing long documents across training windows: ``gdp_states`` maps a GDP layer's index in
    ``layers`` to its ``initial_state`` float [N, Hv, K, V] (``GatedDeltaProduct``'s; N the layout's
    GDP sequences; a layer left out starts from zeros), and ``output_gdp_states=True`` returns
    ``(logits, {index: final_state})`` for every GDP layer. Under CP the final states follow the GDP
    op's rule (rows of the sequences ending on this rank, zeros elsewhere): sum them over the group
    (``dist.all_reduce``; detach for truncated backpropagation) before passing them to the next
    window. Attention layers see only their window, and the short conv does not carry its
    ``conv_size - 1`` tokens (docs/cp_options.md "Sequence states in the layers").
    """

    def __init__(self, config: DecoderConfig, *, gdp_options: dict | None = None,
                 attention_options: dict | None = None, init_std: float = 0.02,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating torch dtype (e.g. torch.bfloat16) or None; "
                             f"received {compute_dtype!r}")
        self.config = config
        self.compute_dtype = compute_dtype
        options = {"gdp": gdp_options or {}, "attention": attention_options or {}}
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, kind, **options) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name in ("embeddings.weight", "lm_head.weight"):
                nn.init.normal_(param, std=init_std)

    def forward(self, input_ids: torch.Tensor, *, doc_ids=None, cp_group=None, layout: ShardLayout | None = None,
                gdp_states: dict | None = None, output_gdp_states: bool = False):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be an int tensor [B, L]; received shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        if layout is None:
            world = 1 if cp_group is None else torch.distributed.get_world_size(resolve_group(cp_group))
            layout = build_shard_layout(total_len=input_ids.shape[1] * world, doc_ids=doc_ids, cp_group=cp_group)
        elif doc_ids is not None or cp_group is not None:
            raise ValueError("pass either layout or doc_ids / cp_group, not both")
        states_error = self._gdp_states_error(gdp_states)
        if layout.is_cp and not compiling():  # a compiled step agreed eagerly (``agree``)
            self._agree(input_ids, layout, explicit=False, error=states_error)
        elif states_error:
            raise ValueError(f"model inputs: {states_error}")
        gdp_states = gdp_states or {}
        final_states = {}
        h = self.embeddings(input_ids)
        if self.compute_dtype is not None:
            h = h.to(self.compute_dtype)
        for index, block in enumerate(self.layers):
            if output_gdp_states and block.kind == "gdp":
                h, final_states[index] = block(h, layout, gdp_states.get(index), True)
            else:
                h = block(h, layout, gdp_states.get(index))
        logits = self.lm_head(self.norm(h))
        return (logits, final_states) if output_gdp_states else logits

    @property
    def residual_dtype(self) -> torch.dtype:
        """The residual stream's dtype: ``compute_dtype``, else the embeddings' (autocast leaves both alone)."""
        return self.compute_dtype if self.compute_dtype is not None else self.embeddings.weight.dtype

    def _gdp_states_error(self, gdp_states) -> str | None:
        if gdp_states is None:
            return None
        gdp_layers = [i for i, block in enumerate(self.layers) if block.kind == "gdp"]
        if not isinstance(gdp_states, dict) or any(key not in gdp_layers for key in gdp_states):
            keys = list(gdp_states) if isinstance(gdp_states, dict) else type(gdp_states).__name__
            return f"gdp_states must be a dict keyed by GDP layer indices {gdp_layers}; received {keys}"
        return None

    def agree(self, input_ids: torch.Tensor, *, layout: ShardLayout) -> None:
        """One header for the whole model before its first exchange: the input (token ids in range),
        the layout and every layer's kind, configuration, options and grad requirement, in order (so a
        rank with another layer count, order, conv_size, num_householder, ... raises with the others);
        it covers every mixer's own header. Every mixer input has the residual stream's shape and dtype
        (``residual_dtype``: the norms keep it). ``forward`` runs it on
        every eager call; a step compiled with ``torch.compile`` cannot (a header reads the host), so
        call it eagerly once per batch before the compiled call, under the same grad and autocast
        modes, with the layers' checks off (``cp_check_inputs`` / ``check_inputs`` False).

        Called explicitly, the agreement is recorded on ``layout``: later eager calls with the same
        signature on that layout send no header (a steady-state step without host synchronisation,
        which a CUDA graph can capture), and a call that differs raises on its rank. The token-range
        check ran on the ``input_ids`` given here: agree again for every batch."""
        self._agree(input_ids, layout, explicit=True)

    def _agree(self, input_ids: torch.Tensor, layout: ShardLayout, *, explicit: bool, error: str | None = None) -> None:
        hidden = (*input_ids.shape, self.config.hidden_size)
        dtype, device = self.residual_dtype, input_ids.device
        layers = [(layout.signature_of(hidden, dtype, device, block.attn.cp_signature()), block.attn.AGREEMENT)
                  for block in self.layers]
        params = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in self.named_parameters()]
        signature = (*layout.signature_of(hidden, dtype, device, config_fingerprint(self.config)), len(self.layers),
                     digest([sig for sig, _ in layers]), digest(params))
        if not explicit and layout.agreed_model(signature):
            if error:
                raise ValueError(f"model inputs: {error}")
            return  # an explicit agree covered this call: no header, no host read
        # ``error`` (a bad gdp_states) travels in the header too, so that every rank raises
        if error is None and input_ids.dtype not in (torch.int32, torch.int64):
            error = f"input_ids must be int32 or int64; received {input_ids.dtype}"
        elif error is None and input_ids.shape[1] != layout.local_len or (layout.packed.packed and input_ids.shape[0] != 1):
            error = (f"input_ids must be [B, L = {layout.local_len}] (B = 1 when packed); "
                     f"received {tuple(input_ids.shape)}")
        out_of_range = None if error else ((input_ids < 0) | (input_ids >= self.config.vocab_size)).any().view(1)
        layout.agree_model(error, signature, layers, value_flags=out_of_range,
                           value_checks=(("input_ids", f"token ids outside [0, {self.config.vocab_size})"),))
        if explicit:
            layout.record_model_agreement(signature)


__all__ = ["HybridBlock", "HybridDecoder"]
