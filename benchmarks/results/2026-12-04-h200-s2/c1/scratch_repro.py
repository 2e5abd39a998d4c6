# K = 64 output_states bug hunt (device scratch; not committed)
import sys, torch, numpy as np
import torch_api.gdp.cutedsl as cutedsl
from cp_linear.gdp import GDPInputs
from cp_linear.reference import naive_gated_delta_product
mode = sys.argv[1]
print(mode, cutedsl.__file__, flush=True)
if "force" in mode:
    cutedsl.kl.keeps_chunk_states = lambda requested, key_dim: requested
def run(lengths, K, V, nh, save, **backend_args):
    gen = torch.Generator(device="cuda").manual_seed(1)
    T = sum(lengths); H = 2
    q = torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T*nh, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T*nh, H, V, device="cuda", generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda", generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(1, T*nh, H, device="cuda", generator=gen))
    cu = torch.tensor(np.cumsum([0] + list(lengths)), dtype=torch.int32, device="cuda")
    inputs = GDPInputs(q, k, v, g, beta, K ** -0.5, nh, False, cu, save_for_backward=save)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(**backend_args)
    f64 = lambda x: x.double().cpu().numpy()
    ro, rf = naive_gated_delta_product(f64(q), f64(k), f64(v), f64(g), f64(beta), scale=K ** -0.5, num_householder=nh,
                                       cu_seqlens=cu.cpu().numpy())
    errs = []
    for rep in range(3):
        o, final, _ = backend.one_device_forward(inputs)
        torch.cuda.synchronize()
        eo = float(np.linalg.norm(o.double().cpu().numpy() - ro) / np.linalg.norm(ro))
        ef = float(np.linalg.norm(final.double().cpu().numpy() - rf) / np.linalg.norm(rf))
        errs.append(f"{eo:.1e}/{ef:.1e}")
    bad = "BAD" if max(float(e.split('/')[0]) for e in errs) > 2e-2 else "ok"
    print(f"{mode} {bad} lengths {lengths} K{K} V{V} nh{nh} save {save} {backend_args}: o/final {' '.join(errs)}", flush=True)
if mode == "matrix":
    for K, V in [(64, 64), (64, 128), (128, 64), (128, 128)]:
        for nh in (1, 2, 3):
            for save in (False, True):
                run((5, 129, 64), K, V, nh, save)
    run((300,), 64, 64, 2, True, segment_chunks=2)
else:
    run((5, 129, 64), 64, 64, 1, True)
    run((5, 129, 64), 64, 64, 2, True)
    run((300,), 64, 64, 2, True)
    run((5, 129, 64), 64, 64, 2, True, save_prep=False)
    run((5, 129, 64), 64, 64, 3, True)
    run((5, 129, 64), 128, 64, 2, True)
    run((5, 129, 64), 64, 128, 2, True)
