"""GPU check of the tensor-core GDP forward kernels, stage by stage, then end to end.

    python benchmarks/check_tc_kernels.py [--quick]

Each kernel runs on the GPU and, on copies of the *same* input buffers, in
``cp_linear.kernels.emulation`` on the CPU; the outputs are compared buffer by buffer (so a
wrong stage is named, not just a wrong result). Then the whole backend (one device, and CP
prepare/apply over two shards on this GPU) is compared with the float64 reference, side by side
with flash-linear-attention's forward on the same bf16 inputs when FLA is installed. Prints one
line per check and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import sys
import traceback
from dataclasses import replace

import numpy as np
import torch

import torch_api.gdp.cutedsl as cutedsl
from cp_linear.kernels import configs as kcfg
from cp_linear.kernels import launch as kl
from cp_linear.kernels.emulation import run_emulated
from cp_linear.reference import naive_gated_delta_product
from torch_api.gdp.types import GDPInputs

FAILURES: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / max(b.norm(), 1e-30))


def check(name: str, value: float, limit: float) -> None:
    ok = value <= limit and np.isfinite(value)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3e} (limit {limit:.0e})", flush=True)
    if not ok:
        FAILURES.append(name)


def make_inputs(lengths, heads, key_dim, value_dim, n_h, dtype, seed, rows=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    tokens = sum(lengths)
    q = r(rows, tokens, heads, key_dim).to(dtype)
    k = r(rows, tokens * n_h, heads, key_dim).to(dtype)
    v = r(rows, tokens * n_h, heads, value_dim).to(dtype)
    g = torch.nn.functional.logsigmoid(r(rows, tokens, heads) + 3.0)
    beta = torch.sigmoid(r(rows, tokens * n_h, heads))
    return q, k, v, g, beta


def to_cpu(launch):
    """A copy of ``launch`` with every tensor on the CPU (outputs included, so the emulation can
    write its own results there)."""
    out = copy.copy(launch)
    for name, _ in launch.argument_specs():
        value = getattr(launch, name)
        if isinstance(value, torch.Tensor):
            setattr(out, name, value.detach().cpu().clone())
    return out


class Recorder:
    """Runs each launch on the GPU, then its emulation on CPU copies of the inputs it saw."""

    def __init__(self, tag: str):
        self.tag = tag
        self.original = kl._Launch.run

    def __enter__(self):
        recorder = self

        def run(launch):
            before = to_cpu(launch)  # inputs as the kernel sees them (outputs are overwritten by both)
            recorder.original(launch)
            torch.cuda.synchronize()
            run_emulated(before)
            recorder.compare(launch, before)

        kl._Launch.run = run
        return self

    def __exit__(self, *exc):
        kl._Launch.run = self.original

    def compare(self, gpu, emulated) -> None:
        kind = type(gpu).__name__.replace("Launch", "")
        mode = getattr(gpu.config, "mode", "")
        outputs = {"ChunkPrep": ("ta", "tb", "p", "scalars"), "SegmentFold": ("incoming",),
                   "ChunkScan": {"output": ("state_out", "o"), "summary": ("state_out",), "states": ("chunk_states",),
                                 "output_states": ("state_out", "o", "chunk_states")}.get(mode),
                   "ChunkGamma": ("summaries",),
                   "ChunkReverseScan": ("grad_in", "chunk_grads"),
                   "ChunkReverse": ("dv", "dq_scan", "dk_scan", "d_ta", "d_tb", "d_p", "d_scalars"),
                   "ChunkPrepBackward": ("dq", "dk", "dg", "dbeta"), "ValueChecks": ("flags",),
                   "ForwardLayout": kl.LAYOUT_TABLES + ("trailing",)}[kind]
        if kind in ("ValueChecks", "ForwardLayout"):  # flags and int32 tables: exact
            differ = [name for name in outputs if not torch.equal(getattr(gpu, name).cpu(), getattr(emulated, name))]
            check(f"{self.tag} {kind} {', '.join(outputs)} equal the emulation's (differ: {differ})",
                  float(len(differ)), 0.0)
            return
        for name in outputs:
            a, b = getattr(gpu, name), getattr(emulated, name)
            if kind == "ChunkGamma":
                # written: the gamma rows of the flagged segments, and the transition rows of those without
                # FORWARD_TRANSITION_FLAG (the others' hold the forward's copy, untouched by either)
                count = int(gpu.num_segments[0])
                flags = gpu.seg_flags[:count].cpu()
                summarised = (flags & kl.SUMMARY_FLAG) != 0
                computed = summarised & ((flags & kl.FORWARD_TRANSITION_FLAG) == 0)
                if not bool(summarised.any()):
                    continue
                value_dim = gpu.config.value_dim
                a, b = (torch.cat([x[:count][summarised.to(x.device), :, :value_dim].flatten(),
                                   x[:count][computed.to(x.device), :, value_dim:].flatten()]) for x in (a, b))
            if kind == "ChunkReverseScan" and name == "grad_in":
                count = int(gpu.num_segments[0])
                a, b = a[:count], b[:count]
            if (kind, name) in (("ChunkReverseScan", "chunk_grads"), ("ChunkScan", "chunk_states")) \
                    or kind == "ChunkReverse" and name in ("d_ta", "d_tb", "d_p", "d_scalars"):
                count = int(gpu.chunk_steps.ne(0).sum())  # per-chunk buffers: the real chunks
                a, b = a[:count], b[:count]
            if kind == "ChunkReverse" and name == "d_scalars":  # written: db, dc (query tile), dd (column 0)
                tile = gpu.d_p.shape[2]
                a, b = (torch.cat([x[:, :, 0], x[:, :, 1, :tile], x[:, :, 2, :1]], 2) for x in (a, b))
            if kind == "ChunkScan" and name == "state_out":
                count = int(gpu.num_segments[0])
                if mode == "summary":
                    flags = gpu.seg_flags[:count].cpu() & 1
                    idx = torch.nonzero(flags).flatten()
                    if idx.numel() == 0:
                        continue
                    a, b = a[idx.to(a.device)], b[idx]
                # the output modes: final states [N, H, K, V] (empty sequences' rows keep what both started with)
            if kind == "ChunkPrep":
                count = int(gpu.num_chunks[0])
                a, b = a[:count], b[:count]
            if kind == "SegmentFold" and mode == "fold":  # apply_affine writes every row (unused ones zero)
                count = int(gpu.seq_first_segment[-1])
                a, b = a[:count], b[:count]
            limit = 2e-2 if name in ("ta", "tb", "p") else 1e-4 if kind == "SegmentFold" else 1e-2  # fold: float32 only
            bad = ~torch.isfinite(a.float())
            if bool(bad.any()):  # where a kernel writes non-finite values says which loop is wrong
                where = torch.nonzero(bad)
                print(f"     {self.tag} {kind} {name}: {int(bad.sum())} of {a.numel()} not finite; shape "
                      f"{tuple(a.shape)}; first at {where[0].tolist()}, last at {where[-1].tolist()}; "
                      f"emulation finite: {bool(torch.isfinite(b.float()).all())}", flush=True)
            check(f"{self.tag} {kind}{'/' + mode if mode else ''} {name} vs emulation", rel(a, b), limit)


def layout_cases(seed: int = 0) -> None:
    """The layout kernel (one launch) against ``kl.forward_layout`` (array ops on the same device), table
    for table, exactly: random packed shards with empty sequences (leading, inside, trailing, all), N from
    1 to LAYOUT_MAX_SEQUENCES, each n_h, segment sizes, and every summary / gradient-flag option."""
    gen = np.random.default_rng(seed)
    counts = [1, 2, 3, 7, 64, 300, kcfg.LAYOUT_MAX_SEQUENCES]
    for index in range(40):
        sequences = counts[index % len(counts)]
        lengths = gen.integers(0, 3000 if sequences < 64 else 200, size=sequences)
        lengths[gen.random(sequences) < 0.2] = 0  # empty sequences anywhere
        if index % 10 == 9:
            lengths[:] = 0  # no tokens at all
        padding = int(gen.integers(0, 100)) if index % 3 == 0 else 0  # tokens after the last sequence
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
        n_h = 1 + index % 3
        total_tokens = int(cu[-1]) + padding
        segment_chunks = [1, 3, 8, 33, None][index % 5]
        summary = [None, kcfg.TRAILING_SEQUENCE, 0][index % 3]
        grad = [None, 0][(index // 3) % 2]
        every, every_grad = index % 7 == 3, index % 11 == 5
        values_only = [None, 1, 0][(index // 2) % 3]
        sizes = kl.layout_sizes(total_tokens=max(total_tokens, 1), num_householder=n_h, num_sequences=sequences,
                                heads=16, row_blocks=2, sm_count=132, segment_chunks=segment_chunks)
        tables = {name: torch.full((size,), -7, dtype=torch.int32, device="cuda")
                  for name, size in sizes.table_sizes().items()}
        trailing = torch.full((1,), -7, dtype=torch.int32, device="cuda")
        kl.ForwardLayoutLaunch.of(cu, tables, trailing, num_householder=n_h, sizes=sizes, summary_sequence=summary,
                                  grad_summary_sequence=grad, every_segment_summary=every,
                                  every_segment_grad_summary=every_grad, values_only_from=values_only).run()
        nonempty = torch.nonzero(cu[1:] > cu[:-1]).flatten()
        last = int(nonempty[-1]) if nonempty.numel() else 0
        expected = kl.forward_layout(
            cu, total_tokens=max(total_tokens, 1), num_householder=n_h, heads=16, row_blocks=2, sm_count=132,
            segment_chunks=sizes.segment_chunks,
            summary_sequence=last if summary == kcfg.TRAILING_SEQUENCE else summary,
            grad_summary_sequence=grad, every_segment_summary=every, every_segment_grad_summary=every_grad,
            values_only_from=values_only)
        differ = [name for name in kl.LAYOUT_TABLES if not torch.equal(tables[name], getattr(expected, name))]
        if int(trailing[0]) != last:
            differ.append("trailing")
        check(f"layout kernel [N{sequences} nh{n_h} seg{sizes.segment_chunks} summary {summary} grad {grad} every "
              f"{int(every)}{int(every_grad)} values-only {values_only} T{total_tokens}] tables equal "
              f"forward_layout's (differ: {differ})",
              float(len(differ)), 0.0)


def reference(q, k, v, g, beta, n_h, cu, initial=None):
    f64 = lambda x: x.double().cpu().numpy()  # noqa: E731
    return naive_gated_delta_product(f64(q), f64(k), f64(v), f64(g), f64(beta), scale=q.shape[-1] ** -0.5,
                                     num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                     initial_state=None if initial is None else f64(initial))


def fla_forward(q, k, v, g, beta, n_h, cu):
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product
    except Exception:  # optional oracle
        return None
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    return chunk_gated_delta_product(q, k, v, g, beta, num_householder=n_h, use_qk_l2norm_in_kernel=True,
                                     cu_seqlens=cu_t)[0]


def one_device_case(lengths, heads, key_dim, value_dim, n_h, dtype, segment_chunks, stages: bool, mma="sync"):
    tag = (f"[{'+'.join(map(str, lengths))} H{heads} K{key_dim} V{value_dim} nh{n_h} {dtype} seg{segment_chunks}"
           f" {mma}]")
    q, k, v, g, beta = make_inputs(lengths, heads, key_dim, value_dim, n_h, dtype, seed=sum(lengths) + n_h)
    cu = np.cumsum([0] + lengths)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    initial = torch.randn(len(lengths), heads, key_dim, value_dim, device="cuda") * 0.1
    inputs = GDPInputs(q, k, v, g, beta, key_dim ** -0.5, n_h, True, cu_t)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, mma=mma)
    if stages:
        with Recorder(tag):
            backend.one_device_forward(inputs, initial)
    o, final, _ = backend.one_device_forward(inputs, initial)
    o2, final2, _ = backend.one_device_forward(inputs, initial)
    check(f"{tag} bitwise repeat (o, final)", float(not (torch.equal(o, o2) and torch.equal(final, final2))), 0.0)
    o_ref, final_ref = reference(q, k, v, g, beta, n_h, cu, initial)
    o_ref, final_ref = torch.from_numpy(o_ref), torch.from_numpy(final_ref)
    check(f"{tag} o vs float64", rel(o, o_ref), 8e-3)
    check(f"{tag} final state vs float64", rel(final, final_ref), 8e-3)
    floor = rel(o_ref.to(dtype), o_ref)
    print(f"     {tag} dtype rounding of the exact output: {floor:.3e}", flush=True)
    # the inference plan (save_for_backward False: one V-row fold from the initial states, no apply_affine)
    o_lean, final_lean, _ = backend.one_device_forward(replace(inputs, save_for_backward=False), initial)
    check(f"{tag} inference plan o vs float64", rel(o_lean, o_ref), 8e-3)
    check(f"{tag} inference plan final state vs float64", rel(final_lean, final_ref), 8e-3)
    check(f"{tag} inference plan o vs the saving forward", rel(o_lean, o), 1e-3)
    check(f"{tag} inference plan final state vs the saving forward", rel(final_lean, final), 1e-4)
    # FLA side by side from a zero initial state (same bf16 inputs for both)
    o0, _, _ = backend.one_device_forward(inputs)
    ref0 = torch.from_numpy(reference(q, k, v, g, beta, n_h, cu)[0])
    ours = rel(o0, ref0)
    o_fla = fla_forward(q, k, v, g, beta, n_h, cu)
    if o_fla is None:
        print(f"     {tag} zero-init o vs float64: ours {ours:.3e} (FLA unavailable)", flush=True)
        return
    theirs = rel(o_fla, ref0)
    print(f"     {tag} zero-init o vs float64: ours {ours:.3e}, FLA {theirs:.3e}", flush=True)
    check(f"{tag} ours / FLA error ratio", ours / max(theirs, 1e-30), 1.0)


def backward_case(lengths, heads, dim, n_h, segment_chunks, mma="auto"):
    """The kernel backward stage by stage against its emulation, then every gradient against float64."""
    from cp_linear.kernels import backward_algorithm as ba
    from torch_api import gated_delta_product

    tag = f"[bwd {'+'.join(map(str, lengths))} H{heads} K=V={dim} nh{n_h} seg{segment_chunks} {mma}]"
    q, k, v, g, beta = make_inputs(lengths, heads, dim, dim, n_h, torch.bfloat16, seed=7 + n_h)
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(1, sum(lengths), heads, dim, device="cuda", generator=gen).bfloat16()
    dfinal = torch.randn(len(lengths), heads, dim, dim, device="cuda", generator=gen)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels", mma=mma)
    # the backward that recomputes the chunk states (chunk_scan mode "states") instead of reading the forward's
    recompute = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, backward="kernels", mma=mma,
                                                          save_chunk_states=False)

    def grads(with_backend=backend):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        o, final = gated_delta_product(*leaves, num_householder=n_h, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                       backend=with_backend)
        torch.autograd.backward([o, final], [do, dfinal])
        return [leaf.grad for leaf in leaves]

    with Recorder(tag):
        got = grads()
    again = grads()
    check(f"{tag} bitwise repeat (all gradients)", float(not all(torch.equal(a, b) for a, b in zip(got, again))), 0.0)
    with Recorder(tag + "[recomputed chunk states]"):
        recomputed = grads(recompute)
    check(f"{tag} stored vs recomputed chunk states: bitwise equal gradients",
          float(not all(torch.equal(a, b) for a, b in zip(got, recomputed))), 0.0)
    starts = np.cumsum([0] + lengths)
    ref = [[] for _ in range(5)]
    for n, (t0, t1) in enumerate(zip(starts[:-1], starts[1:])):
        parts = [x[0].double().cpu() for x in (q[:, t0:t1], k[:, t0 * n_h:t1 * n_h], v[:, t0 * n_h:t1 * n_h],
                                               g[:, t0:t1], beta[:, t0 * n_h:t1 * n_h])]
        out = ba.sequence_backward(*parts, do[0, t0:t1].double().cpu(), dfinal[n].double().cpu(),
                                   num_householder=n_h, scale=dim ** -0.5, use_l2=True)
        for slot in range(5):
            ref[slot].append(out[slot])
    for name, grad, parts in zip(("dq", "dk", "dv", "dg", "dbeta"), got, ref):
        expected = torch.cat(parts, 0)
        check(f"{tag} {name} vs float64", rel(grad.reshape(expected.shape), expected), 1e-2 if name == "dg" else 5e-3)


def fold_case(key_dim: int, value_dim: int, init_count: int) -> None:
    """segment_fold alone: the sequential fold (double-buffered M^T) and prepare's prefix fold +
    mode "apply_affine" against their emulation (through the Recorder) and against each other; the
    unused segments' rows zero; bitwise repeatable."""
    tag = f"[fold K{key_dim} V{value_dim} init{init_count}]"
    gen = torch.Generator().manual_seed(key_dim + value_dim + init_count)
    counts, heads, spare = [3, 0, 9, 1, 0], 3, 2  # sequences 3 and 4 are the trailing ones
    starts = torch.tensor(np.cumsum([0] + counts), dtype=torch.int32, device="cuda")
    total = sum(counts) + spare
    summaries = torch.randn(total, heads, value_dim + key_dim, key_dim, generator=gen) * 0.5
    summaries[:, :, value_dim:] = 0.9 * torch.eye(key_dim) + torch.randn(total, heads, key_dim, key_dim,
                                                                         generator=gen) * 0.01
    summaries = summaries.cuda()
    init = torch.randn(len(counts), heads, value_dim, key_dim, generator=gen).cuda()

    def both_ways():
        f32 = dict(dtype=torch.float32, device="cuda")
        sequential = torch.zeros(total, heads, value_dim, key_dim, **f32)
        kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim), summaries=summaries, seq_first_segment=starts,
                             init=init, addend=summaries.new_zeros(1, 1, key_dim, 1),
                             incoming=sequential, final=sequential[:1], init_count=init_count,
                             value_rows=value_dim, identity_row=value_dim, transition_count=0, add_mode=kl.ADD_NONE,
                             write_final=0,
                             descending=0).run()
        # 16-row CTAs (kl.fold_config's choice for few chains) sum in the same order: bitwise the 32-row fold's,
        # ascending and descending (the backward's), final rows included
        for descending in (0, 1):
            folds = []
            for rows in kcfg.FOLD_ROWS:
                folds.append((torch.zeros(total, heads, value_dim, key_dim, **f32),
                              torch.full((len(counts), heads, value_dim, key_dim), float("nan"), **f32)))
                kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim, "fold", rows), summaries=summaries,
                                     seq_first_segment=starts, init=init, addend=summaries.new_zeros(1, 1, key_dim, 1),
                                     incoming=folds[-1][0], final=folds[-1][1],
                                     init_count=init_count, value_rows=value_dim, identity_row=value_dim,
                                     transition_count=0, add_mode=kl.ADD_NONE, write_final=kl.FINAL_EVERY,
                                     descending=descending).run()
            check(f"{tag} rows {kcfg.FOLD_ROWS} bitwise equal (descending={descending})",
                  float(not (torch.equal(folds[0][0], folds[1][0]) and torch.equal(folds[0][1], folds[1][1]))), 0.0)
        finals = []
        for write_final in (kl.FINAL_EVERY, kl.FINAL_TRAILING):  # the latter is what prepare runs
            prefix = torch.empty(total, heads, value_dim + key_dim, key_dim, **f32)
            finals.append(torch.full((len(counts), heads, value_dim + key_dim, key_dim), float("nan"), **f32))
            kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim), summaries=summaries, seq_first_segment=starts,
                                 init=prefix[:1], addend=summaries.new_zeros(1, 1, key_dim, 1),
                                 incoming=prefix, final=finals[-1], init_count=0,
                                 value_rows=value_dim, identity_row=value_dim, transition_count=len(counts),
                                 add_mode=kl.ADD_NONE,
                                 write_final=write_final, descending=0).run()
        check(f"{tag} FINAL_TRAILING final rows as FINAL_EVERY's, the others unwritten",
              float(not (torch.equal(finals[0][3:], finals[1][3:]) and bool(torch.isnan(finals[1][:3]).all()))), 0.0)
        via_prefix = torch.full((total, heads, value_dim, key_dim), float("nan"), **f32)
        kl.SegmentFoldLaunch(kcfg.SegmentFoldConfig(key_dim, "apply_affine"), summaries=prefix,
                             seq_first_segment=starts, init=init, addend=summaries.new_zeros(1, 1, key_dim, 1),
                             incoming=via_prefix, final=via_prefix[:1],
                             init_count=init_count, value_rows=value_dim, identity_row=value_dim, transition_count=0,
                             add_mode=kl.ADD_NONE,
                             write_final=0, descending=0).run()
        return sequential, via_prefix

    with Recorder(tag):
        sequential, via_prefix = both_ways()
    again = both_ways()
    real = sum(counts)
    check(f"{tag} bitwise repeat", float(not (torch.equal(sequential, again[0]) and torch.equal(via_prefix, again[1]))),
          0.0)
    check(f"{tag} apply_affine vs sequential fold", rel(via_prefix[:real], sequential[:real]), 1e-5)
    check(f"{tag} unused rows zero", float(torch.count_nonzero(via_prefix[real:])), 0.0)


def cp_case(layout: str, n_h: int, dtype):
    heads, dim = 4, 128
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=4)
    half = 1024
    if layout == "rows":
        q, k, v, g, beta = make_inputs([2 * half], heads, dim, dim, n_h, dtype, seed=11, rows=2)
        cu_local = [None, None]
        o_ref = np.concatenate([reference(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], n_h,
                                          None)[0] for i in range(2)])
    else:
        lengths = [2 * half] if layout == "spanning" else [300, 1500, 248]
        q, k, v, g, beta = make_inputs(lengths, heads, dim, dim, n_h, dtype, seed=12)
        cu_local = ([[0, half], [0, half]] if layout == "spanning" else [[0, 300, half], [0, 776, half]])
        cu_local = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in cu_local]
        o_ref = reference(q, k, v, g, beta, n_h, np.cumsum([0] + lengths))[0]
    shards = []
    for rank in range(2):
        tok = slice(rank * half, (rank + 1) * half)
        stp = slice(rank * half * n_h, (rank + 1) * half * n_h)
        shards.append(GDPInputs(q[:, tok], k[:, stp], v[:, stp], g[:, tok], beta[:, stp], dim ** -0.5, n_h, True,
                                cu_local[rank]))
    prepared = [backend.cp_forward_prepare(shard) for shard in shards]
    out0 = backend.cp_forward_apply(prepared[0][1], None).output
    with Recorder(f"[CP 2 shards {layout} nh{n_h} rank 1 apply]"):  # apply_affine from S_in vs its emulation
        out1 = backend.cp_forward_apply(prepared[1][1], prepared[0][0].packed[None]).output
    o = torch.cat([out0, out1], dim=1)
    check(f"[CP 2 shards {layout} nh{n_h}] o vs float64", rel(o, torch.from_numpy(o_ref)), 8e-3)


def _guarded(label: str, check, *args) -> None:
    """Run one check; an exception is printed and counted as a failure, and the next check runs."""
    try:
        check(*args)
    except Exception:
        traceback.print_exc()
        FAILURES.append(f"exception in {label}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per stage check")
    parser.add_argument("--cases", type=int, nargs="*", default=None, help="run only these one-device cases")
    parser.add_argument("--no-cp", action="store_true", help="skip the two-shard CP cases")
    parser.add_argument("--backward", action="store_true", help="also check the backward kernels")
    parser.add_argument("--fold-only", action="store_true", help="only the segment_fold checks (both modes)")
    parser.add_argument("--layout-only", action="store_true", help="only the layout kernel checks")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = [([700, 1300, 64, 33], 4, 128, 128, 2, torch.bfloat16, 8, True),
             ([2048], 2, 128, 128, 1, torch.bfloat16, 4, True),
             ([999, 1049], 2, 128, 128, 3, torch.bfloat16, None, True),
             ([700, 1300, 64, 33], 4, 128, 128, 2, torch.bfloat16, 8, True, "wgmma"),
             ([2048], 2, 128, 128, 1, torch.bfloat16, 4, True, "wgmma")]
    if not args.quick:
        cases += [([700, 1348], 2, 64, 64, 2, torch.bfloat16, 4, True),
                  ([700, 1348], 2, 64, 128, 2, torch.bfloat16, 4, True),
                  ([700, 1348], 2, 128, 64, 1, torch.bfloat16, 4, True),
                  ([1500, 548], 2, 128, 128, 2, torch.float16, 4, True),
                  ([4096], 4, 128, 128, 2, torch.bfloat16, None, False)]
    if args.cases is not None:
        cases = [cases[i] for i in args.cases]
    _guarded("layout kernel", layout_cases)
    if args.layout_only:
        print(f"\n{len(FAILURES)} failed checks" + (": " + "; ".join(FAILURES) if FAILURES else ""), flush=True)
        return 1 if FAILURES else 0
    for fold in ((128, 128, 0), (128, 128, 1), (128, 128, 4), (64, 64, 4), (64, 128, 1), (128, 64, 4)):
        _guarded(f"fold {fold}", fold_case, *fold)
    if args.fold_only:
        cases, args.backward, args.no_cp = [], False, True
    for case in cases:
        _guarded(f"{case}", one_device_case, *case)
    if args.backward:
        for case in (([700, 1300, 64], 2, 128, 2, 4), ([1024], 2, 128, 1, None), ([500, 548], 2, 64, 3, 3),
                     ([999, 1049], 2, 128, 3, 4), ([700, 1300, 64], 2, 128, 2, 4, "sync")):
            _guarded(f"backward {case}", backward_case, *case)
    for layout in () if args.no_cp else ("spanning", "packed", "rows"):
        _guarded(f"CP {layout}", cp_case, layout, 2, torch.bfloat16)
    print(f"\n{len(FAILURES)} failed checks" + (": " + "; ".join(FAILURES) if FAILURES else ""), flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
