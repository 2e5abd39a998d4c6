"""Diag (session 2026-12-07 seventh): the 131k one-device forward's chunk kernels, four variants in one process.
A torch checked (plain kernels), B torch backend with zero token flags (contained kernels), C JAX (contained),
D JAX with zeroes_flagged_rows=False (copies, plain kernels). --ncu: one forward of each inside a profiler range."""
import argparse, sys
sys.path.insert(0, "benchmarks")
import torch, jax
import bench_jax_kernels as b
import jax_api, torch_api
import jax_api.gdp.cutedsl as jcd
import torch_api.gdp.cutedsl as tcd
from _bench_common import parse_case, kernel_times

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="1x131072:2")
parser.add_argument("--ncu", action="store_true")
parser.add_argument("--only", default="ABCD")
args = parser.parse_args()
docs, doc_tokens, nh = parse_case(args.case)
q, k, v, g, beta, cu, do = b.make_inputs(docs, doc_tokens, 16, 128, nh)
arrays = [b.to_jax(x) for x in (q, k, v, g, beta, cu)]
opts = dict(num_householder=nh, use_qk_l2norm_in_kernel=True)
tb = tcd.CuTeDSLGatedDeltaProductCPBackend()


def torch_checked():
    with torch.no_grad():
        return torch_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, backend=tb, **opts)[0]


def torch_contained():  # check_inputs=False: the flags route (token flags, contained kernels) since a559456
    with torch.no_grad():
        return torch_api.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, backend=tb, check_inputs=False,
                                             **opts)[0]


def jax_fn(zeroes):
    cls = jcd.CuTeDSLGatedDeltaProductCPBackend
    cls.zeroes_flagged_rows = zeroes
    backend = cls()
    fwd = jax.jit(lambda q, k, v, g, beta, cu: jax_api.gated_delta_product(
        q, k, v, g, beta, cu_seqlens=cu, backend=backend, **opts)[0])
    out = fwd(*arrays)  # trace now, with this class flag
    jax.block_until_ready(out)
    return lambda: jax.block_until_ready(fwd(*arrays))


variants = {"A": ("torch checked", torch_checked), "B": ("torch contained (flags)", torch_contained),
            "C": ("jax contained", jax_fn(True)), "D": ("jax copies", jax_fn(False))}
o_ref = torch_checked()
o_b = torch_contained()
print("torch contained == checked bits:", torch.equal(o_ref, o_b), flush=True)
if args.ncu:
    for key in args.only:
        name, fn = variants[key]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{key} {name}: profiled", flush=True)
    sys.exit(0)
for key in args.only:
    name, fn = variants[key]
    print(f"{key} {name}: wall {b.wall_ms(fn, b.torch_sync, 30):.3f} ms", flush=True)
# interleaved rounds: an order or clock effect shows up as a drift between rounds
for round_ in range(3):
    for key in (args.only if round_ % 2 == 0 else args.only[::-1]):
        name, fn = variants[key]
        times = kernel_times(fn, 20)
        scan = sum(t for n, t in times.items() if "chunk_scan" in n)
        prep = sum(t for n, t in times.items() if "chunk_prep" in n)
        print(f"round {round_} {key} {name}: kernels {sum(times.values()):.3f} scan {scan:.3f} prep {prep:.3f}",
              flush=True)
    if round_ == 0:
        for key in args.only:
            times = sorted(kernel_times(variants[key][1], 5).items(), key=lambda item: -item[1])
            print(key, "  ".join(f"{n[40:90]} {t:.3f}" for n, t in times[:8]), flush=True)
