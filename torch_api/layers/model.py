"""``HybridDecoder``: a small language model alternating GDP and block-diagonal attention blocks.

    input_ids [B, L] -> embeddings -> N x block -> norm -> lm_head -> logits [B, L, vocab]
    block:  h = h + mixer(attn_norm(h));  h = h + mlp(mlp_norm(h))     (mixer: GDP or attention)

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
from torch_api.layers.blocks import GatedMLP, RMSNorm
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

    def forward(self, h: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), layout=layout)
        return h + self.mlp(self.mlp_norm(h))


class HybridDecoder(StateTableMixin, nn.Module):
    """The hybrid decoder of ``DecoderConfig``.

    ``forward(input_ids [B, L], *, doc_ids=None, cp_group=None, layout=None) -> logits [B, L, V]``
    (float32 when the weights are). ``doc_ids`` int [T] are the *global* document ids (0 =
    padding; B = 1), replicated on every rank under CP; without them each row is one document.
    ``layout`` (``build_shard_layout``) replaces doc_ids/cp_group when built once per step.
    ``gdp_options`` / ``attention_options`` go to every mixer (e.g. ``{"mode": "a2a"}``).
    """

    def __init__(self, config: DecoderConfig, *, gdp_options: dict | None = None,
                 attention_options: dict | None = None, init_std: float = 0.02):
        super().__init__()
        self.config = config
        options = {"gdp": gdp_options or {}, "attention": attention_options or {}}
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, kind, **options) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name in ("embeddings.weight", "lm_head.weight"):
                nn.init.normal_(param, std=init_std)

    def forward(self, input_ids: torch.Tensor, *, doc_ids=None, cp_group=None, layout: ShardLayout | None = None):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be an int tensor [B, L]; received shape "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        if layout is None:
            world = 1 if cp_group is None else torch.distributed.get_world_size(resolve_group(cp_group))
            layout = build_shard_layout(total_len=input_ids.shape[1] * world, doc_ids=doc_ids, cp_group=cp_group)
        elif doc_ids is not None or cp_group is not None:
            raise ValueError("pass either layout or doc_ids / cp_group, not both")
        if layout.is_cp and not compiling():  # a compiled step agreed eagerly (``agree``)
            self._agree(input_ids, layout, explicit=False)
        h = self.embeddings(input_ids)
        for block in self.layers:
            h = block(h, layout)
        return self.lm_head(self.norm(h))

    def agree(self, input_ids: torch.Tensor, *, layout: ShardLayout) -> None:
        """One header for the whole model before its first exchange: the input (token ids in range),
        the layout and every layer's kind, configuration, options and grad requirement, in order (so a
        rank with another layer count, order, conv_size, num_householder, ... raises with the others);
        it covers every mixer's own header. Every mixer input has the embeddings' shape and dtype (the
        residual stream keeps the embedding dtype and the norms keep it too). ``forward`` runs it on
        every eager call; a step compiled with ``torch.compile`` cannot (a header reads the host), so
        call it eagerly once per batch before the compiled call, under the same grad and autocast
        modes, with the layers' checks off (``cp_check_inputs`` / ``check_inputs`` False).

        Called explicitly, the agreement is recorded on ``layout``: later eager calls with the same
        signature on that layout send no header (a steady-state step without host synchronisation,
        which a CUDA graph can capture), and a call that differs raises on its rank. The token-range
        check ran on the ``input_ids`` given here: agree again for every batch."""
        self._agree(input_ids, layout, explicit=True)

    def _agree(self, input_ids: torch.Tensor, layout: ShardLayout, *, explicit: bool) -> None:
        hidden = (*input_ids.shape, self.config.hidden_size)
        dtype, device = self.embeddings.weight.dtype, input_ids.device
        layers = [(layout.signature_of(hidden, dtype, device, block.attn.cp_signature()), block.attn.AGREEMENT)
                  for block in self.layers]
        params = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in self.named_parameters()]
        signature = (*layout.signature_of(hidden, dtype, device, config_fingerprint(self.config)), len(self.layers),
                     digest([sig for sig, _ in layers]), digest(params))
        if not explicit and layout.agreed_model(signature):
            return  # an explicit agree covered this call: no header, no host read
        error = None
        if input_ids.dtype not in (torch.int32, torch.int64):
            error = f"input_ids must be int32 or int64; received {input_ids.dtype}"
        elif input_ids.shape[1] != layout.local_len or (layout.packed.packed and input_ids.shape[0] != 1):
            error = (f"input_ids must be [B, L = {layout.local_len}] (B = 1 when packed); "
                     f"received {tuple(input_ids.shape)}")
        out_of_range = None if error else ((input_ids < 0) | (input_ids >= self.config.vocab_size)).any().view(1)
        layout.agree_model(error, signature, layers, value_flags=out_of_range,
                           value_checks=(("input_ids", f"token ids outside [0, {self.config.vocab_size})"),))
        if explicit:
            layout.record_model_agreement(signature)


__all__ = ["HybridBlock", "HybridDecoder"]
