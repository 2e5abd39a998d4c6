import os, sys
sys.path.insert(0, "benchmarks")
import jax
import bench_jax_kernels as b
import jax_api
import jax_api.gdp.cutedsl as jcd
from _bench_common import parse_case

for case in ("1x131072:2", "1x32768:2"):
    docs, doc_tokens, nh = parse_case(case)
    q, k, v, g, beta, cu, do = b.make_inputs(docs, doc_tokens, 16, 128, nh)
    arrays = [b.to_jax(x) for x in (q, k, v, g, beta, cu)]
    for zeroes in (True, False):
        jcd.CuTeDSLGatedDeltaProductCPBackend.zeroes_flagged_rows = zeroes
        backend = jcd.CuTeDSLGatedDeltaProductCPBackend()
        fwd = jax.jit(lambda q, k, v, g, beta, cu: jax_api.gated_delta_product(
            q, k, v, g, beta, cu_seqlens=cu, backend=backend, num_householder=nh, use_qk_l2norm_in_kernel=True))
        ms = b.wall_ms(lambda: fwd(*arrays), b.jax_sync, 30)
        print(f"{case} zeroes_flagged_rows={zeroes} jax fwd wall {ms:.3f} ms", flush=True)
        b._print_kernels(f"{case} zeroes={zeroes}", lambda: jax.block_until_ready(fwd(*arrays)), 10, top=8)
