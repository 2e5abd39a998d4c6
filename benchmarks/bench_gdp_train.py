"""GDP forward + backward: cp_linear's kernels vs flash-linear-attention, time and peak memory.

    python benchmarks/bench_gdp_train.py [--out DIR] [--tokens 8192 32768 131072] [--nh 2]

One sequence of T tokens, H = 16, K = V = 128 (``--dim``), bf16, qk l2norm; the loss is <o, dO> + <S_T, dS>,
so both the output and the final state carry gradients. Variants: ``ours`` (the forward and the
backward kernels, ``backward="kernels"``), ``ours-torch-bwd`` (kernel forward, TorchGDPBackend
backward; 8k only, it is slow), and FLA's ``chunk_gated_delta_product`` (its gated backward
refuses Triton 3.6 on Hopper, FLA#640: the guard is switched off for *timing only*, its
gradients are not used). Wall time (CUDA events around the eager step, median), kernel time
(torch.profiler sum per step), peak memory above the inputs, and "b2b": ms per step over ten steps
queued back to back, as a training loop runs them (``--check-read-ab`` adds ``ours-read-first``: the
value checks read before the forward is queued; ``--unchecked`` adds ``ours-unchecked``:
``check_inputs=False``, no host read, non-finite inputs contained; ``--graph`` adds ``ours-graph``: the
unchecked step captured in a CUDA graph and replayed, the step without its host work). Writes a table,
CSV and PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re

import torch

from _bench_common import back_to_back_ms, kernel_times, time_ms
from torch_api import gated_delta_product
from torch_api.gdp.cutedsl import CuTeDSLGatedDeltaProductCPBackend


class _ChecksReadFirst:
    """``PendingValueChecks`` replaced by a read before the forward is queued (the previous behaviour),
    for the A/B of ``--check-read-ab``."""

    def __enter__(self):
        import torch_api.gdp.ops as ops
        from torch_api.gdp.validation import raise_failed_checks

        class ReadNow:
            def __init__(self, checks, flags, what):
                raise_failed_checks(checks, flags, what)

            def raise_if_failed(self):
                pass

        self.ops, self.original = ops, ops.PendingValueChecks
        ops.PendingValueChecks = ReadNow
        return self

    def __exit__(self, *exc):
        self.ops.PendingValueChecks = self.original


def _graphed(step):
    """``step`` captured in a CUDA graph (warmed up on a side stream, as the PyTorch docs describe);
    returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _kernel_ms(fn, repeat: int) -> tuple[float, list[tuple[str, float]]]:
    """GPU kernel time per call (ms) and the ten largest kernels (name, ms per call)."""
    events = sorted(kernel_times(fn, repeat).items(), key=lambda item: -item[1])
    return sum(ms for _, ms in events), events[:10]


def _short_name(key: str) -> str:
    """A CuTeDSL kernel's class name (its symbol also spells out every argument type), else the key's start."""
    match = re.search(r"([A-Z][A-Za-z]*Kernel)_object", key)
    return match.group(1) if match else key[:48]


def _print_kernels(name: str, largest: list[tuple[str, float]]) -> None:
    parts = "  ".join(f"{_short_name(key)} {ms:.3f}" for key, ms in largest)
    print(f"{'':>8} {name:>15} kernels (ms/step): {parts}", flush=True)


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _fla_step(nh):
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product

        from fla_baseline import bypass_fla_hopper_guard  # benchmarks/, the script's directory
    except Exception as err:  # FLA is an optional anchor
        print(f"flash-linear-attention unavailable ({type(err).__name__}: {err})")
        return None
    bypass_fla_hopper_guard()  # the FLA#640 guard: timing only

    def step(leaves, do, dfinal):
        o, final = chunk_gated_delta_product(*leaves, num_householder=nh, use_qk_l2norm_in_kernel=True,
                                             output_final_state=True)
        torch.autograd.backward([o, final], [do, dfinal])
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--nh", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128, help="K = V (64 or 128)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="out/bench_gdp_train")
    parser.add_argument("--no-torch-backward", action="store_true", help="skip the torch-backward variant")
    parser.add_argument("--kernels", action="store_true", help="print each variant's largest kernels")
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention")
    parser.add_argument("--check-read-ab", action="store_true",
                        help="also time ours with the value checks read before the forward is queued")
    parser.add_argument("--unchecked", action="store_true", help="also time ours with check_inputs=False")
    parser.add_argument("--recompute-states", action="store_true",
                        help="also time ours with save_chunk_states=False (the backward recomputes the chunk states)")
    parser.add_argument("--graph", action="store_true",
                        help="also time ours (check_inputs=False) captured in a CUDA graph and replayed")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    nh, heads, dim = args.nh, args.heads, args.dim
    fla_step = None if args.no_fla else _fla_step(nh)
    rows = []
    print(f"GDP fwd+bwd, H={heads}, K=V={dim}, n_h={nh}, bf16, l2norm; ms per step (median of {args.repeat})")
    print(f"{'T':>8} {'variant':>15} {'wall ms':>9} {'kernel ms':>10} {'peak MB':>9} {'b2b ms':>9}", flush=True)
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
        q = rand(1, tokens, heads, dim).bfloat16()
        k = rand(1, tokens * nh, heads, dim).bfloat16()
        v = rand(1, tokens * nh, heads, dim).bfloat16()
        g = torch.nn.functional.logsigmoid(rand(1, tokens, heads) + 3.0)
        beta = torch.sigmoid(rand(1, tokens * nh, heads))
        do = rand(1, tokens, heads, dim).bfloat16()
        dfinal = rand(1, heads, dim, dim)
        variants = {"ours": CuTeDSLGatedDeltaProductCPBackend(backward="kernels")}
        if args.check_read_ab:
            variants["ours-read-first"] = variants["ours"]
        if args.recompute_states:  # the backward reruns the scan for the chunk states (less saved memory)
            variants["ours-recompute"] = CuTeDSLGatedDeltaProductCPBackend(backward="kernels", save_chunk_states=False)
        if args.unchecked:
            variants["ours-unchecked"] = variants["ours"]
        if args.graph:
            variants["ours-graph"] = variants["ours"]
        if tokens <= 8192 and not args.no_torch_backward:
            variants["ours-torch-bwd"] = CuTeDSLGatedDeltaProductCPBackend(backward="torch")
        for name, backend in variants.items():
            def step(read_first=name == "ours-read-first", check=name not in ("ours-unchecked", "ours-graph")):
                leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
                with _ChecksReadFirst() if read_first else contextlib.nullcontext():
                    o, final = gated_delta_product(*leaves, num_householder=nh, use_qk_l2norm_in_kernel=True,
                                                   backend=backend, check_inputs=check)
                torch.autograd.backward([o, final], [do, dfinal])
            try:
                if name == "ours-graph":
                    step = _graphed(step)
                wall_ms = time_ms(step, args.repeat, warmup=2)
                kernel_ms, largest = _kernel_ms(step, args.repeat)
                row = [tokens, name, wall_ms, kernel_ms, _peak_mb(step), back_to_back_ms(step)]
            except Exception as err:  # report and keep measuring the others
                print(f"{tokens:>8} {name:>15} failed: {type(err).__name__}: {err}", flush=True)
                continue
            rows.append(row)
            print(f"{row[0]:>8} {row[1]:>15} {row[2]:>9.3f} {row[3]:>10.3f} {row[4]:>9.0f} {row[5]:>9.3f}", flush=True)
            if args.kernels:
                _print_kernels(name, largest)
        if fla_step is not None:
            def fla():
                leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
                fla_step(leaves, do, dfinal)
            try:
                wall_ms = time_ms(fla, args.repeat, warmup=2)
                kernel_ms, largest = _kernel_ms(fla, args.repeat)
                row = [tokens, "FLA", wall_ms, kernel_ms, _peak_mb(fla), back_to_back_ms(fla)]
                rows.append(row)
                print(f"{row[0]:>8} {row[1]:>15} {row[2]:>9.3f} {row[3]:>10.3f} {row[4]:>9.0f} {row[5]:>9.3f}", flush=True)
                if args.kernels:
                    _print_kernels("FLA", largest)
            except Exception as err:
                print(f"{tokens:>8} {'FLA':>15} failed: {type(err).__name__}: {err}", flush=True)
        del q, k, v, g, beta, do, dfinal
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_gdp_train.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["tokens", "variant", "wall_ms", "kernel_ms", "peak_mb", "back_to_back_ms"])
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in sorted({r[1] for r in rows}):
            points = [(r[0], r[3]) for r in rows if r[1] == name]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("fwd+bwd kernel ms")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_gdp_train.png"), dpi=120)
    except Exception as err:
        print(f"no plot: {err}")


if __name__ == "__main__":
    main()
