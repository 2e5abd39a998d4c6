"""``GatedDeltaProduct`` as a Flax NNX module: the same mixer, parameters and math as
``torch_api.layers.GatedDeltaProduct`` (see its docstring for the per-token formulas).

``__call__(hidden_states [B, L, D], *, layout=None, axis_name=None, cu_seqlens=None, seq_idx=None,
initial_state=None, output_final_state=False, num_sequences=None) -> [B, L, D]`` (or ``(out, final_state)``)
  one device   axis_name None; x holds all T tokens; packing from ``layout`` or the ids
  CP           call inside ``jax.shard_map`` over mesh axis ``axis_name`` with x this rank's
               L tokens and ``layout = build_layout(..., cp_size=cp)`` passed in replicated
               (``P()``); the conv halo is one ``ppermute``, the GDP is
               ``jax_api.gdp_chunkwise_context_parallel_shard`` (summaries exchanged as
               ``cp_summary_exchange`` says: "all_gather" | "scan" | "auto", docs/cp_options.md)

Sequence states, as the GDP op (docs/cp_options.md): sequence n is the n-th GDP sequence of the
layout (the n-th run of equal ids, padding runs included; batch row n when unpacked).
``initial_state`` float [N, Hv, K, V] (replicated under CP) enters sequence n where it starts;
``output_final_state=True`` returns ``(out, final_state float32 [N, Hv, K, V])``: every row on one
device; under CP this rank's rows (sequences ending here) and zeros elsewhere, as
``gdp_chunkwise_context_parallel_shard`` (``jax.lax.psum`` over the axis gives the one-device state).
N is static: ``initial_state.shape[0]``, else ``num_sequences`` (needed for a packed layout; the
layout's ids are data, so their count is not known at trace time). Only the recurrent state is
carried: the short conv of a continued sequence does not read the previous window's last
``conv_size - 1`` tokens (exact continuation needs ``use_short_conv=False`` or ``conv_size=1``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_api.layers.blocks import GatedRMSNorm, Linear, RMSNorm, ShortConvolution
from jax_api.layers.conv import conv_halos, conv_window, short_conv_kernel_reason, zigzag_conv_windows
from jax_api.layers.layout import resolve_layout
from cp_linear.model_config import GDPConfig, REQUIRED, document_layer_signature, resolve_config
from cp_linear.summary_exchange import SUMMARY_EXCHANGES
from jax_api.layers.convert import StateTableMixin


def _init_decay(rngs: nnx.Rngs, heads: int) -> tuple[jax.Array, jax.Array]:
    """A_log = log(U(0, 16)), dt_bias = inverse softplus of dt ~ logU(1e-3, 0.1) (as FLA)."""
    a_log = jnp.log(jax.random.uniform(rngs.params(), (heads,), jnp.float32, 0.0, 16.0))
    u = jax.random.uniform(rngs.params(), (heads,), jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)), 1e-4)
    return a_log, dt + jnp.log(-jnp.expm1(-dt))


class GatedDeltaProduct(StateTableMixin, nnx.Module):
    """Gated DeltaProduct mixer; keyword arguments as ``GDPConfig``; ``rngs`` for the initial weights.

    ``backend``: a GDP backend of the four-function protocol, or None: the CuTeDSL kernels where they
    run the activations (a Hopper GPU, bf16/fp16, head sizes 64 or 128), else ``JaxGDPBackend``.
    ``cp_summary_exchange``: how the CP op exchanges its summaries, "all_gather" | "scan" | "auto"
    (docs/cp_options.md). The short conv runs on the fused kernels where ``conv.short_conv_kernel_reason``
    allows (a Hopper GPU, bf16 / fp16 activations, conv_size 2-4, channels in multiples of 8), else on
    jnp ops over a padded window."""

    def __init__(self, config: GDPConfig | None = None, *, rngs: nnx.Rngs, backend=None,
                 cp_summary_exchange: str = "all_gather", **kwargs):
        if cp_summary_exchange not in SUMMARY_EXCHANGES:
            raise ValueError(f"cp_summary_exchange must be one of {SUMMARY_EXCHANGES}; received {cp_summary_exchange!r}")
        self.config = config = resolve_config(GDPConfig, config, kwargs)
        self.backend = backend
        self.cp_summary_exchange = cp_summary_exchange
        c, n = config, config.num_householder
        self.q_proj = Linear(c.hidden_size, c.key_dim, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, c.key_dim * n, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, c.value_dim * n, rngs=rngs)
        self.b_proj = Linear(c.hidden_size, c.value_heads * n, rngs=rngs)
        if c.use_forget_gate:
            self.a_proj = Linear(c.hidden_size, c.value_heads, rngs=rngs)
            a_log, dt_bias = _init_decay(rngs, c.value_heads)
            self.A_log = nnx.Param(a_log)
            self.dt_bias = nnx.Param(dt_bias)
        if c.use_short_conv:
            q_ch, k_ch, v_ch = c.conv_channels
            self.q_conv1d = ShortConvolution(q_ch, c.conv_size, bias=c.conv_bias, rngs=rngs)
            self.k_conv1d = ShortConvolution(k_ch, c.conv_size, bias=c.conv_bias, rngs=rngs)
            self.v_conv1d = ShortConvolution(v_ch, c.conv_size, bias=c.conv_bias, rngs=rngs)
        if c.use_output_gate:
            self.g_proj = Linear(c.hidden_size, c.value_dim, rngs=rngs)
            self.o_norm = GatedRMSNorm(c.head_v_dim, eps=c.norm_eps)
        else:
            self.o_norm = RMSNorm(c.head_v_dim, eps=c.norm_eps)
        self.o_proj = Linear(c.value_dim, c.hidden_size, rngs=rngs)

    def _short_conv(self, x, layout, axis_name):
        c = self.config
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if not c.use_short_conv:
            return jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        positions = layout.local(layout.position, axis_name)
        zigzag = axis_name is not None and layout.zigzag
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        if short_conv_kernel_reason(q, c.conv_size, c.conv_channels) is None:
            # the fused kernels: one call per projection, reading only a small halo (no padded window of
            # the concatenated projections); P = 2 pieces for the zig-zag chunks
            halos = conv_halos((q, k, v), c.conv_size - 1, axis_name, zigzag=zigzag)
            return tuple(conv.fused(part, halo, positions) for conv, part, halo in zip(convs, (q, k, v), halos))
        qkv = jnp.concatenate([q, k, v], axis=-1)
        if zigzag:  # one window per chunk, each with its chunk's positions
            pieces = zip(zigzag_conv_windows(qkv, c.conv_size - 1, axis_name), jnp.split(positions, 2))
        else:
            pieces = [(conv_window(qkv, c.conv_size - 1, axis_name), positions)]
        q_ch, k_ch, _ = c.conv_channels
        outputs = [[conv(part, piece_positions) for conv, part in zip(convs, jnp.split(window, [q_ch, q_ch + k_ch],
                                                                                      axis=-1))]
                   for window, piece_positions in pieces]
        return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*outputs))

    def __call__(self, hidden_states: jax.Array, *, layout=None, axis_name: str | None = None, cu_seqlens=None,
                 seq_idx=None, initial_state=None, output_final_state: bool = False, num_sequences: int | None = None):
        x = hidden_states
        c, n = self.config, self.config.num_householder
        layout = resolve_layout(x, layout=layout, axis_name=axis_name, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
        if x.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states must have D = {c.hidden_size}; received shape {tuple(x.shape)}")
        if axis_name is not None and c.use_short_conv and c.conv_size - 1 > layout.conv_reach:
            piece = "the zig-zag chunk length L / 2" if layout.zigzag else "the local length L"
            raise ValueError(f"conv_size - 1 = {c.conv_size - 1} exceeds {piece} = {layout.conv_reach}")
        batch, length, _ = x.shape
        q, k, v = self._short_conv(x, layout, axis_name)
        q = q.reshape(batch, length, c.num_heads, c.head_dim)
        k = k.reshape(batch, length * n, c.num_heads, c.head_dim)
        v = v.reshape(batch, length * n, c.value_heads, c.head_v_dim)
        if c.value_heads > c.num_heads:
            groups = c.value_heads // c.num_heads
            q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
        beta = jax.nn.sigmoid(self.b_proj(x))
        if c.allow_neg_eigval:
            beta = beta * 2.0
        beta = beta.reshape(batch, length * n, c.value_heads)
        if c.use_forget_gate:
            a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]
            g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        else:
            g = None  # no gate, as flash-linear-attention passes it

        options = dict(num_householder=n, use_qk_l2norm_in_kernel=True, backend=self.backend)
        sequences = None
        if initial_state is not None or output_final_state:
            sequences = _state_rows(initial_state, num_sequences, layout, batch, (c.value_heads, c.head_dim,
                                                                                 c.head_v_dim))
        final_state = None
        if axis_name is not None:
            from jax_api.gdp.cp import gdp_chunkwise_context_parallel_shard

            o = gdp_chunkwise_context_parallel_shard(
                q, k, v, g, beta, axis_name=axis_name, global_seq_idx=layout.seq_idx if layout.packed else None,
                max_sequences=layout.max_shard_sequences, initial_state=initial_state,
                output_final_state=bool(output_final_state), num_sequences=sequences,
                summary_exchange=self.cp_summary_exchange, layout=layout.shard_layout, **options)
            if output_final_state:
                o, final_state = o
        else:
            from jax_api.gdp.ops import gated_delta_product

            if initial_state is not None and layout.cu_seqlens is not None:
                # the layout's cu_seqlens ends in empty padding sequences: their rows enter as zeros
                padding = layout.cu_seqlens.shape[0] - 1 - sequences
                initial_state = jnp.pad(initial_state, ((0, padding), (0, 0), (0, 0), (0, 0)))
            o, final_state = gated_delta_product(q, k, v, g, beta, cu_seqlens=layout.cu_seqlens,
                                                 initial_state=initial_state, **options)
            final_state = None if sequences is None else final_state[:sequences]
        if c.use_output_gate:
            gate = self.g_proj(x).reshape(batch, length, c.value_heads, c.head_v_dim)
            o = self.o_norm(o, gate)
        else:
            o = self.o_norm(o)
        out = self.o_proj(o.reshape(batch, length, c.value_dim))
        return (out, final_state) if output_final_state else out


def _state_rows(initial_state, num_sequences, layout, batch: int, state_dims: tuple[int, int, int]) -> int:
    """N of the layer's sequence states (static), with the initial state's shape checked."""
    if not layout.packed:
        sequences = batch
    elif initial_state is not None:
        sequences = getattr(initial_state, "shape", (None,))[0]
    elif isinstance(num_sequences, int) and not isinstance(num_sequences, bool) and num_sequences >= 1:
        sequences = num_sequences
    else:
        raise ValueError("output_final_state without initial_state on a packed layout needs num_sequences (static N, "
                         f"the layout's GDP sequences); received {num_sequences!r}")
    capacity = None if layout.cu_seqlens is None else layout.cu_seqlens.shape[0] - 1
    shape = tuple(getattr(initial_state, "shape", ())) if initial_state is not None else None
    if (shape is not None and shape != (sequences, *state_dims)) or (capacity is not None and sequences > capacity):
        raise ValueError(f"initial_state must be [N, Hv, K, V] = ({sequences}, {', '.join(map(str, state_dims))}) with "
                         f"N the layout's GDP sequences (at most {capacity or 'the runs of its ids'}); received "
                         f"{shape if shape is not None else num_sequences}")
    return int(sequences)


# help() and inspect.signature list every keyword argument (a metaclass hides __init__ from them)
document_layer_signature(GatedDeltaProduct, GDPConfig, rngs=REQUIRED, backend=None, cp_summary_exchange="all_gather")

__all__ = ["GatedDeltaProduct"]
