"""``GatedDeltaProduct``: the GDP token mixer (projections, short conv, gates, GDP, gated norm, output).

Mirrors flash-linear-attention's ``fla/layers/gated_deltaproduct.py`` (same parameter names and
shapes, so its state dicts load as is), in chunk mode, with three differences:
  * the short conv never crosses a sequence start and, under CP, reads the previous rank's last
    ``conv_size - 1`` tokens (``torch_api.layers.conv``; on a Hopper GPU in bf16 / fp16 the fused
    kernels, ``kernel_short_conv``, else torch ops);
  * no inference cache (``past_key_values``) and no ``attention_mask`` unpadding: pass packed
    sequences (``cu_seqlens`` / ``seq_idx``) instead; the GDP recurrent state can be carried from one
    training window to the next (``initial_state=`` / ``output_final_state=True``), the conv's
    ``conv_size - 1`` tokens cannot (docs/cp_options.md "Sequence states in the layers");
  * the forward returns the output tensor only (FLA returns ``(o, None, cache)``), or
    ``(o, final_state)`` with ``output_final_state=True``.

Per token (x [B, L, D] -> [B, L, D]), with n = num_householder::

    q = silu(conv(q_proj x))  [H, K]       k = silu(conv(k_proj x))  [n, H, K]   (n keys per token)
    v = silu(conv(v_proj x))  [n, Hv, V]   beta = sigmoid(b_proj x) (x2 with allow_neg_eigval) [n, Hv]
    g = -exp(A_log) * softplus(a_proj x + dt_bias)  [Hv]   (log decay, float32)
    o = GDP(q, k, v, g, beta) with q/k l2-normalised in the kernel
    y = o_proj(RMSNorm(o) * silu(g_proj x))
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_api.layers.blocks import GatedRMSNorm, Linear, RMSNorm, ShortConvolution
from cp_linear.model_config import GDPConfig, config_fingerprint, document_layer_signature, resolve_config
from cp_linear.validation import digest
from torch_api.layers.convert import StateTableMixin
from torch_api.layers.conv import conv_window, kernel_short_conv, short_conv_kernel_reason, zigzag_conv_windows
from torch_api.layers.layout import compiling, resolve_layout


def _init_decay(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log (log of A ~ U(0, 16)) and dt_bias (inverse softplus of dt ~ logU(1e-3, 0.1)), as FLA does."""
    a_log = torch.log(torch.empty(heads).uniform_(0, 16))
    dt = torch.exp(torch.rand(heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return a_log, dt + torch.log(-torch.expm1(-dt))


def _kernel_conv_halos(projections, halo_len: int, layout) -> list[torch.Tensor]:
    """Each projection's halo [B, P, W - 1, C] for ``kernel_short_conv``: the W - 1 tokens before each of
    its P pieces (P = 2 under zig-zag CP, one per chunk, else 1). One device: zeros (nothing precedes the
    shard). Under CP one exchange moves the three projections' tails, the last W - 1 tokens of each piece
    (``conv_window`` / ``zigzag_conv_windows`` on a [B, P (W - 1), C_total] tensor): the windows' first
    W - 1 tokens are the halos, and their backward returns the halos' gradients to the senders' tails."""
    batch, length, _ = projections[0].shape
    channels = [projection.shape[-1] for projection in projections]
    if not layout.is_cp:
        return [projection.new_zeros((batch, 1, halo_len, projection.shape[-1])) for projection in projections]
    if layout.zigzag:
        chunk = length // 2
        tails = torch.cat([torch.cat((projection[:, chunk - halo_len:chunk], projection[:, length - halo_len:]), dim=1)
                           for projection in projections], dim=-1)  # [B, 2 (W - 1), C_total]
        windows = zigzag_conv_windows(tails, halo_len, layout.group, layout.cp_rank, layout.cp_size)
        halo = torch.stack([window[:, :halo_len] for window in windows], dim=1)  # [B, 2, W - 1, C_total]
    else:
        tails = torch.cat([projection[:, length - halo_len:] for projection in projections], dim=-1)
        window = conv_window(tails, halo_len, layout.group_name, gathered=layout.static_shapes)
        halo = window[:, :halo_len].unsqueeze(1)  # [B, 1, W - 1, C_total]
    return list(halo.split(channels, dim=-1))


class GatedDeltaProduct(StateTableMixin, nn.Module):
    """Gated DeltaProduct mixer; keyword arguments as ``GDPConfig`` (FLA's names and defaults).

    ``forward(hidden_states [B, L, D], *, cu_seqlens=None, seq_idx=None, cp_group=None,
    layout=None, initial_state=None, output_final_state=False) -> [B, L, D]`` (or ``(out, final_state)``).

    One device: ``cu_seqlens`` int [N + 1] or ``seq_idx`` int [1, T] for a packed batch (B = 1), or
    neither (each row one sequence). Under CP (``cp_group``): hidden_states is this rank's shard of
    L tokens and the ids describe the *global* packed sequence (replicated on every rank), or pass
    ``layout`` = ``build_shard_layout(...)`` built once per step for all layers.
    ``backend``: an instance or a name; None picks the CuTeDSL kernels on a Hopper GPU for a
    configuration they take, else ``TorchGDPBackend`` (``torch_api.gdp.ops.resolve_backend``).
    ``cp_check_inputs`` is handed to the GDP op (``check_inputs``, on one device too): value checks
    with a ValueError, or containment of non-finite values when False (docs/failure_modes.md).
    ``cp_summary_exchange``: how the CP op exchanges its summaries, "all_gather" | "scan" | "auto"
    (docs/cp_options.md); a call that scans runs the op's autograd.Function rather than the custom op.
    Under CP the layer agrees with the other ranks (fixed-size header) on its input, its layout and
    ``cp_signature`` before its first exchange (the conv halo), unless a ``HybridDecoder`` covered it;
    a covered call with ``cp_check_inputs=False`` runs the GDP custom op with no header at all
    (``torch_api.gdp.cp.run_cp_op``), which ``torch.compile(fullgraph=True)`` traces.

    Sequence states, as the GDP op (docs/cp_options.md): sequence n is the n-th GDP sequence of the
    layout (the n-th run of equal ids, padding runs included; batch row n when unpacked).
    ``initial_state`` float [N, Hv, K, V] (Hv = num_v_heads, V = head_v_dim; None: zeros), replicated
    under CP, enters sequence n where it starts; ``output_final_state=True`` returns
    ``(out, final_state float32 [N, Hv, K, V])``. One device: every row. CP: row n on the rank holding
    sequence n's last token, zeros on the others (their sum over the group, e.g. ``dist.all_reduce``,
    is the one-device final state: what the next window's ``initial_state`` takes). States run the
    op's autograd.Function (not the custom op) and need ``cp_check_inputs=True`` under CP. Only the
    recurrent state is carried: the short conv of a continued sequence does not read the previous
    window's last ``conv_size - 1`` tokens, so a continuation equals one long run exactly only without
    the conv's reach (``use_short_conv=False`` or ``conv_size=1``).
    """

    AGREEMENT = "GatedDeltaProduct inputs"

    def __init__(self, config: GDPConfig | None = None, *, backend=None, cp_check_inputs: bool = True,
                 cp_summary_exchange: str = "all_gather", **kwargs):
        super().__init__()
        from cp_linear.summary_exchange import SUMMARY_EXCHANGES

        if cp_summary_exchange not in SUMMARY_EXCHANGES:
            raise ValueError(f"cp_summary_exchange must be one of {SUMMARY_EXCHANGES}; received {cp_summary_exchange!r}")
        self.config = config = resolve_config(GDPConfig, config, kwargs)
        self.backend = backend
        from torch_api.gdp.library import register_backend

        register_backend(backend)  # its op name exists before any torch.compile trace reads it
        self.cp_check_inputs = cp_check_inputs
        self.cp_summary_exchange = cp_summary_exchange
        c, n = config, config.num_householder
        self.q_proj = Linear(c.hidden_size, c.key_dim, bias=False)
        self.k_proj = Linear(c.hidden_size, c.key_dim * n, bias=False)
        self.v_proj = Linear(c.hidden_size, c.value_dim * n, bias=False)
        self.b_proj = Linear(c.hidden_size, c.value_heads * n, bias=False)
        if c.use_forget_gate:
            self.a_proj = Linear(c.hidden_size, c.value_heads, bias=False)
            a_log, dt_bias = _init_decay(c.value_heads)
            self.A_log = nn.Parameter(a_log)
            self.dt_bias = nn.Parameter(dt_bias)
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        if c.use_short_conv:
            q_ch, k_ch, v_ch = c.conv_channels
            self.q_conv1d = ShortConvolution(q_ch, c.conv_size, c.conv_bias)
            self.k_conv1d = ShortConvolution(k_ch, c.conv_size, c.conv_bias)
            self.v_conv1d = ShortConvolution(v_ch, c.conv_size, c.conv_bias)
        if c.use_output_gate:
            self.g_proj = Linear(c.hidden_size, c.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(c.head_v_dim, eps=c.norm_eps)
        else:
            self.o_norm = RMSNorm(c.head_v_dim, eps=c.norm_eps)
        self.o_proj = Linear(c.value_dim, c.hidden_size, bias=False)

    def _short_conv(self, x, layout):
        """q, k, v before head reshape: [B, L, key_dim], [B, L, key_dim*n], [B, L, value_dim*n]."""
        c = self.config
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if not c.use_short_conv:
            return F.silu(q), F.silu(k), F.silu(v)
        positions = layout.positions(x.device)
        # conv_size 1 has no halo: the torch path is one multiply
        if c.conv_size > 1 and short_conv_kernel_reason(q, c.conv_size, c.conv_channels) is None:
            return self._kernel_short_conv((q, k, v), positions, layout)
        # one halo exchange for all three projections
        qkv = torch.cat((q, k, v), dim=-1)
        if layout.zigzag and layout.is_cp:  # one window per chunk, each with its chunk's positions
            windows = zigzag_conv_windows(qkv, c.conv_size - 1, layout.group, layout.cp_rank, layout.cp_size)
            pieces = zip(windows, positions.chunk(2))
        else:
            pieces = [(conv_window(qkv, c.conv_size - 1, layout.group_name, gathered=layout.static_shapes), positions)]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        outputs = [[conv(part, piece_positions) for conv, part in zip(convs, window.split(c.conv_channels, dim=-1))]
                   for window, piece_positions in pieces]
        return tuple(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*outputs))

    def _kernel_short_conv(self, projections, positions, layout):
        """The fused conv kernels, one launch per projection on the projection in place: no [B, L, C_total]
        concatenation and no padded window; only each piece's last W - 1 tokens travel for the halos."""
        halos = _kernel_conv_halos(projections, self.config.conv_size - 1, layout)
        positions = positions.to(torch.int32)  # once for the three launches
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return tuple(kernel_short_conv(projection.contiguous(), halo, conv.weight, conv.bias, positions)
                     for projection, halo, conv in zip(projections, halos, convs))

    def cp_signature(self) -> tuple[int, ...]:
        """Configuration, flags, backend and grad requirement: what the ranks must share."""
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        backend = "default" if self.backend is None else type(self.backend).__name__
        return (*config_fingerprint(self.config), int(bool(self.cp_check_inputs)), digest([backend]), int(needs_grad),
                digest([self.cp_summary_exchange]))

    def _gated_delta_product(self, q, k, v, g, beta, layout, agreed: bool = False, initial_state=None,
                             output_final_state: bool = False):
        """The GDP op (CP or one device) -> (o, final_state or None); it keeps its own math float32 under
        autocast, and q/k/v/beta enter in the autocast dtype so that a kernel backend sees one input dtype."""
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v, beta = (t.to(dtype) for t in (q, k, v, beta))
        from torch_api.gdp.library import has_op_layout
        from torch_api.gdp.ops import gate_or_zeros, gated_delta_product, resolve_backend, run_gated_delta_product

        n = self.config.num_householder
        backend = resolve_backend(self.backend, q, k, v, n)
        checks = self.cp_check_inputs
        scan = False
        if layout.is_cp:
            from cp_linear.summary_exchange import resolve_summary_exchange

            scan = resolve_summary_exchange(self.cp_summary_exchange, layout.cp_size) == "scan"
        with_states = initial_state is not None or output_final_state
        # the custom op gathers one summary per rank and has no states: the scan, the states and
        # zig-zag (two summaries per rank) run through the autograd.Function path
        if layout.is_cp and (checks or not agreed or not has_op_layout(backend) or scan or with_states
                             or layout.zigzag):
            from torch_api.gdp.cp import context_parallel_gdp

            result = context_parallel_gdp(
                q, k, v, g, beta, cp_group=layout.group, metadata=layout.gdp_metadata, num_householder=n,
                use_qk_l2norm_in_kernel=True, backend=backend, check_inputs=checks, agreed=agreed,
                summary_exchange=self.cp_summary_exchange, initial_state=initial_state,
                output_final_state=output_final_state, layout=layout.shard_layout)
            return result if output_final_state else (result, None)
        if with_states:  # one device (CP with states returned above)
            return self._one_device_with_states(q, k, v, g, beta, layout, backend, initial_state)
        if checks:
            o, _ = gated_delta_product(q, k, v, g, beta, num_householder=n, cu_seqlens=layout.cu_seqlens(q.device),
                                       use_qk_l2norm_in_kernel=True, backend=backend, check_inputs=True)
            return o, None
        # no value checks, and under CP covered by the model's agreement: no host read, no header
        g = g if g is not None else gate_or_zeros(g, q)
        scale = q.shape[-1] ** -0.5
        if layout.is_cp:
            from torch_api.gdp.cp import run_cp_op

            cu_seqlens, rank_range = layout.gdp_arrays(q.device)
            return run_cp_op(q, k, v, g, beta, cu_seqlens=cu_seqlens, rank_range=rank_range,
                             group_name=layout.group_name, backend=backend, scale=scale, num_householder=n,
                             use_qk_l2norm_in_kernel=True, contain=True), None
        o, _ = run_gated_delta_product(q, k, v, g, beta, backend=backend, scale=scale, num_householder=n,
                                       cu_seqlens=layout.cu_seqlens(q.device), use_qk_l2norm_in_kernel=True,
                                       contain=True)
        return o, None

    def _one_device_with_states(self, q, k, v, g, beta, layout, backend, initial_state):
        """One-device GDP with sequence states [N, Hv, K, V]. A graph-ready layout's cu_seqlens ends in
        empty padding sequences: their rows enter as zeros and leave unread."""
        from torch_api.gdp.ops import gated_delta_product, gate_or_zeros, run_gated_delta_product

        cu_seqlens = layout.cu_seqlens(q.device)
        sequences = layout.gdp_sequences(q.shape[0])
        expected = (sequences, v.shape[2], q.shape[3], v.shape[3])
        if initial_state is not None:
            if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
                raise ValueError(f"initial_state must be [N, Hv, K, V] = {expected} (one row per GDP sequence of the "
                                 f"layout); received {tuple(getattr(initial_state, 'shape', ()))}")
            padding = (0 if cu_seqlens is None else cu_seqlens.shape[0] - 1) - sequences
            if padding > 0:
                initial_state = torch.cat([initial_state, initial_state.new_zeros((padding, *expected[1:]))])
        options = dict(num_householder=self.config.num_householder, cu_seqlens=cu_seqlens, initial_state=initial_state,
                       use_qk_l2norm_in_kernel=True, backend=backend)
        if self.cp_check_inputs:
            o, final = gated_delta_product(q, k, v, g, beta, check_inputs=True, **options)
        else:
            o, final = run_gated_delta_product(q, k, v, gate_or_zeros(g, q), beta, scale=q.shape[-1] ** -0.5,
                                               contain=True, **options)
        return o, final[:sequences]

    def forward(self, hidden_states: torch.Tensor, *, cu_seqlens=None, seq_idx=None, cp_group=None,
                layout=None, initial_state=None, output_final_state: bool = False):
        c, n = self.config, self.config.num_householder
        layout = resolve_layout(hidden_states, layout=layout, cp_group=cp_group, seq_idx=seq_idx,
                                cu_seqlens=cu_seqlens)
        error = layout.hidden_error(hidden_states, c.hidden_size)
        if error is None and layout.is_cp and c.use_short_conv and c.conv_size - 1 > layout.conv_reach:
            error = (f"conv_size - 1 = {c.conv_size - 1} exceeds the {layout.shard_layout} layout's shard or chunk "
                     f"length {layout.conv_reach} (halo)")
        # under torch.compile no header runs (the batch agreed eagerly, ``HybridDecoder.agree``)
        signature = layout.signature(hidden_states, self.cp_signature()) if layout.is_cp and not compiling() else ()
        agreed = layout.agree(error, signature, self.AGREEMENT)

        x = hidden_states
        batch, length, _ = x.shape
        q, k, v = self._short_conv(x, layout)
        q = q.reshape(batch, length, c.num_heads, c.head_dim)
        k = k.reshape(batch, length * n, c.num_heads, c.head_dim)  # token-major: the n keys of t are adjacent
        v = v.reshape(batch, length * n, c.value_heads, c.head_v_dim)
        if c.value_heads > c.num_heads:
            groups = c.value_heads // c.num_heads
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        beta = self.b_proj(x).sigmoid()
        if c.allow_neg_eigval:
            beta = beta * 2.0
        beta = beta.view(batch, length * n, c.value_heads)
        if c.use_forget_gate:
            g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        else:
            g = None  # no gate, as flash-linear-attention passes it

        o, final_state = self._gated_delta_product(q, k, v, g, beta, layout, agreed, initial_state,
                                                   bool(output_final_state))
        if c.use_output_gate:
            gate = self.g_proj(x).view(batch, length, c.value_heads, c.head_v_dim)
            o = self.o_norm(o, gate)
        else:
            o = self.o_norm(o)
        out = self.o_proj(o.reshape(batch, length, c.value_dim))
        return (out, final_state) if output_final_state else out


# help() and inspect.signature list every keyword argument (a metaclass hides __init__ from them)
document_layer_signature(GatedDeltaProduct, GDPConfig, backend=None, cp_check_inputs=True, cp_summary_exchange="all_gather")

__all__ = ["GatedDeltaProduct"]
