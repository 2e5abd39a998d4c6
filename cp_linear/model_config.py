"""Layer and model configurations and the parameter table both frameworks share (no torch, no jax).

The torch modules (``torch_api.layers``) and the Flax NNX modules (``jax_api.layers``) are built
from these dataclasses and hold *the same parameters under the same dotted names with the same
shapes* (linear weights ``[out, in]`` as in ``torch.nn.Linear``, conv weights ``[C, 1, W]`` as in
``torch.nn.Conv1d``). ``parameter_shapes(config)`` is that table; weight conversion in either
direction is a name-for-name copy checked against it (``check_state``).

Names follow flash-linear-attention (``fla/layers/gated_deltaproduct.py``, ``fla/layers/attn.py``,
``fla/models/*``), so an FLA ``GatedDeltaProduct`` state dict loads into ``GatedDeltaProduct`` as is.
This module is imported by both frontends, so it must not import torch or jax.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import MISSING, dataclass, field, fields

from cp_linear.validation import digest


def resolve_config(config_class, config, kwargs: dict):
    """A layer's config: the one given, or one built from keyword arguments (not both)."""
    if config is None:
        return config_class(**kwargs)
    if kwargs:
        raise ValueError(
            f"pass either a {config_class.__name__} or keyword arguments; received both ({sorted(kwargs)})"
        )
    return config


REQUIRED = inspect.Parameter.empty


def layer_signature(config_class, **options) -> inspect.Signature:
    """``(config=None, *, <every field of config_class with its default>, <options>)``: what ``help()``
    and ``inspect.signature`` show for a layer built from ``config_class`` (``options``: the layer's
    own keyword arguments and defaults, ``REQUIRED`` for none)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(f.name, keyword, default=REQUIRED if f.default is MISSING else f.default,
                                 annotation=f.type) for f in fields(config_class)]
    params += [inspect.Parameter(name, keyword, default=default) for name, default in options.items()]
    return inspect.Signature(params)


def document_layer_signature(layer_class, config_class, **options) -> None:
    """Give ``layer_class`` (and its ``__init__``) the keyword signature of ``layer_signature``, so
    that ``help()`` lists the config fields even where a metaclass hides ``__init__`` (Flax NNX)."""
    signature = layer_signature(config_class, **options)
    layer_class.__signature__ = signature
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    layer_class.__init__.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int; received {value!r}")


@dataclass(frozen=True)
class GDPConfig:
    """A Gated DeltaProduct mixer: flash-linear-attention's ``GatedDeltaProduct`` arguments with its
    defaults (``fla/layers/gated_deltaproduct.py``), so ``GDPConfig(hidden_size=256)`` gives FLA's shapes.

    hidden_size       model width D
    head_dim          key head dim K (q and k heads)
    num_heads         q/k heads
    num_v_heads       v heads (default num_heads); more v heads than q/k heads repeats q/k (GVA)
    expand_v          value head dim V = head_dim * expand_v
    num_householder   n_h keys and values per token
    conv_size         width W of the causal depthwise conv on q/k/v (W - 1 tokens of halo under CP)
    allow_neg_eigval  beta = 2 sigmoid(b) instead of sigmoid(b)
    """

    hidden_size: int = 2048
    head_dim: int = 256
    num_heads: int = 6
    num_v_heads: int | None = None
    expand_v: float = 2.0
    num_householder: int = 2
    use_output_gate: bool = True
    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    use_forget_gate: bool = True
    allow_neg_eigval: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "num_heads", "num_householder", "conv_size"):
            _positive_int(name, getattr(self, name))
        if self.num_v_heads is not None:
            _positive_int("num_v_heads", self.num_v_heads)
            if self.num_v_heads % self.num_heads:
                raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({self.num_heads})")
        head_v = self.head_dim * self.expand_v
        if not (self.expand_v > 0 and math.isclose(head_v, round(head_v), rel_tol=0, abs_tol=1e-6)):
            raise ValueError(f"head_dim * expand_v must be a positive integer; "
                             f"received {self.head_dim} * {self.expand_v}")

    @property
    def value_heads(self) -> int:
        return self.num_heads if self.num_v_heads is None else self.num_v_heads

    @property
    def head_v_dim(self) -> int:
        return int(round(self.head_dim * self.expand_v))

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.head_v_dim

    @property
    def conv_channels(self) -> tuple[int, int, int]:
        """Channels of the q, k and v convolutions (k and v carry n_h vectors per token)."""
        n = self.num_householder
        return self.key_dim, self.key_dim * n, self.value_dim * n


@dataclass(frozen=True)
class AttentionConfig:
    """GQA softmax attention with RoPE (flash-linear-attention's ``Attention`` names).

    num_heads q heads; num_kv_heads k/v heads (divides num_heads); head_dim even (RoPE rotates
    halves); rope_theta the RoPE base.
    """

    hidden_size: int
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self):
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("num_heads", self.num_heads)
        if self.num_kv_heads is not None:
            _positive_int("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                             "when head_dim is not given")
        if self.head_dim is not None:
            _positive_int("head_dim", self.head_dim)
        if self.dim_per_head % 2:
            raise ValueError(f"head_dim must be even for RoPE; received {self.dim_per_head}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive; received {self.rope_theta}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim


@dataclass(frozen=True)
class DecoderConfig:
    """The small hybrid decoder: blocks alternate GDP (even index) and block-diagonal attention (odd).

    Every block is pre-norm: ``h += mixer(attn_norm(h)); h += mlp(mlp_norm(h))`` with a SwiGLU MLP
    of width ``intermediate_size`` (default: 8/3 hidden rounded up to a multiple of 32).
    """

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    num_kv_heads: int = 1
    num_householder: int = 2
    expand_v: float = 1.0
    conv_size: int = 4
    allow_neg_eigval: bool = True
    intermediate_size: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_types: tuple[str, ...] = field(default=())

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers"):
            _positive_int(name, getattr(self, name))
        if self.intermediate_size is not None:
            _positive_int("intermediate_size", self.intermediate_size)
        types = tuple(self.layer_types) or tuple("gdp" if i % 2 == 0 else "attention" for i in range(self.num_layers))
        if len(types) != self.num_layers or any(t not in ("gdp", "attention") for t in types):
            raise ValueError(f"layer_types must list 'gdp' or 'attention' for each of the {self.num_layers} layers; "
                             f"received {self.layer_types!r}")
        object.__setattr__(self, "layer_types", types)
        self.gdp_config()
        self.attention_config()

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 32 * math.ceil(self.hidden_size * 8 / 3 / 32)

    def gdp_config(self) -> GDPConfig:
        return GDPConfig(hidden_size=self.hidden_size, head_dim=self.head_dim, num_heads=self.num_heads,
                         expand_v=self.expand_v, num_householder=self.num_householder, conv_size=self.conv_size,
                         allow_neg_eigval=self.allow_neg_eigval, norm_eps=self.norm_eps)

    def attention_config(self) -> AttentionConfig:
        return AttentionConfig(hidden_size=self.hidden_size, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta)


# --------------------------------------------------------------------------- cross-rank signatures

_KIND_CODES = {GDPConfig: 1, AttentionConfig: 2, DecoderConfig: 3}


def config_fingerprint(config) -> tuple[int, ...]:
    """Ints that differ whenever two configs would make ranks run different collectives or shapes.

    Kind, every field (floats as their repr's digest) and, for a decoder, the layer count and order
    with each layer's own fingerprint. Under CP the torch layers exchange these in their agreement
    header (``torch_api.layers.layout.ShardLayout``), so a rank with a different ``conv_size``,
    ``num_householder``, ``use_short_conv``, head count or layer order raises with the others
    before the first exchange.
    """
    if type(config) not in _KIND_CODES:
        raise ValueError(f"config must be one of {[t.__name__ for t in _KIND_CODES]}; received {type(config).__name__}")
    values = [getattr(config, f.name) for f in fields(config)]
    ints = [v if isinstance(v, int) else (-1 if v is None else digest([v])) for v in values if not isinstance(v, tuple)]
    fingerprint = [_KIND_CODES[type(config)], *ints]
    if isinstance(config, GDPConfig):
        fingerprint += [config.value_heads, config.head_v_dim, *config.conv_channels]
    if isinstance(config, DecoderConfig):
        layers = {"gdp": config_fingerprint(config.gdp_config()),
                  "attention": config_fingerprint(config.attention_config())}
        fingerprint += [len(config.layer_types)] + [digest(layers[kind]) for kind in config.layer_types]
    return tuple(int(x) for x in fingerprint)


# --------------------------------------------------------------------------- the parameter table


def _linear(prefix: str, out_features: int, in_features: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    table = {f"{prefix}.weight": (out_features, in_features)}
    if bias:
        table[f"{prefix}.bias"] = (out_features,)
    return table


def _gdp_shapes(c: GDPConfig) -> dict[str, tuple[int, ...]]:
    n, hidden = c.num_householder, c.hidden_size
    table = {}
    table |= _linear("q_proj", c.key_dim, hidden)
    table |= _linear("k_proj", c.key_dim * n, hidden)
    table |= _linear("v_proj", c.value_dim * n, hidden)
    table |= _linear("b_proj", c.value_heads * n, hidden)
    if c.use_forget_gate:
        table |= _linear("a_proj", c.value_heads, hidden)
        table["A_log"] = (c.value_heads,)
        table["dt_bias"] = (c.value_heads,)
    if c.use_short_conv:
        for name, channels in zip(("q_conv1d", "k_conv1d", "v_conv1d"), c.conv_channels):
            table[f"{name}.weight"] = (channels, 1, c.conv_size)
            if c.conv_bias:
                table[f"{name}.bias"] = (channels,)
    if c.use_output_gate:
        table |= _linear("g_proj", c.value_dim, hidden)
    table["o_norm.weight"] = (c.head_v_dim,)
    table |= _linear("o_proj", hidden, c.value_dim)
    return table


def _attention_shapes(c: AttentionConfig) -> dict[str, tuple[int, ...]]:
    d = c.dim_per_head
    table = {}
    table |= _linear("q_proj", c.num_heads * d, c.hidden_size, c.qkv_bias)
    table |= _linear("k_proj", c.kv_heads * d, c.hidden_size, c.qkv_bias)
    table |= _linear("v_proj", c.kv_heads * d, c.hidden_size, c.qkv_bias)
    table |= _linear("o_proj", c.hidden_size, c.num_heads * d)
    return table


def _decoder_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    hidden, width = c.hidden_size, c.mlp_width
    table = {"embeddings.weight": (c.vocab_size, hidden)}
    mixers = {"gdp": _gdp_shapes(c.gdp_config()), "attention": _attention_shapes(c.attention_config())}
    for i, kind in enumerate(c.layer_types):
        prefix = f"layers.{i}"
        table[f"{prefix}.attn_norm.weight"] = (hidden,)
        table |= {f"{prefix}.attn.{name}": shape for name, shape in mixers[kind].items()}
        table[f"{prefix}.mlp_norm.weight"] = (hidden,)
        table |= _linear(f"{prefix}.mlp.gate_proj", width, hidden)
        table |= _linear(f"{prefix}.mlp.up_proj", width, hidden)
        table |= _linear(f"{prefix}.mlp.down_proj", hidden, width)
    table["norm.weight"] = (hidden,)
    table |= _linear("lm_head", c.vocab_size, hidden)
    return table


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """``{dotted parameter name: shape}`` of the module built from ``config``, in a fixed order."""
    builders = {GDPConfig: _gdp_shapes, AttentionConfig: _attention_shapes, DecoderConfig: _decoder_shapes}
    if type(config) not in builders:
        raise ValueError(f"config must be one of {[t.__name__ for t in builders]}; received {type(config).__name__}")
    return builders[type(config)](config)


def check_state(expected: dict[str, tuple[int, ...]], received: dict[str, tuple[int, ...]], *, what: str) -> None:
    """Raise one ValueError listing every missing, unexpected or mis-shaped parameter."""
    missing = [name for name in expected if name not in received]
    unexpected = [name for name in received if name not in expected]
    wrong = [f"{name}: expected {expected[name]}, received {tuple(received[name])}"
             for name in expected if name in received and tuple(received[name]) != tuple(expected[name])]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if wrong:
            parts.append("wrong shapes: " + "; ".join(wrong))
        raise ValueError(f"{what} does not match the module's parameters: " + ", ".join(parts))


__all__ = ["AttentionConfig", "DecoderConfig", "GDPConfig", "REQUIRED", "check_state", "config_fingerprint",
           "document_layer_signature", "layer_signature", "parameter_shapes"]
