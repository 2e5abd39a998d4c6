import sys, os, torch, numpy as np
from dataclasses import replace
import torch_api.gdp.cutedsl as cutedsl
from torch_api.gdp.types import GDPInputs
from cp_linear.reference import naive_gated_delta_product
only = sys.argv[1:] and sys.argv[1] == "one"
def run(lengths, K, V, nh, save, segment_chunks=None, **backend_args):
    gen = torch.Generator(device="cuda").manual_seed(1)
    T = sum(lengths); H = 2
    q = torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T*nh, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T*nh, H, V, device="cuda", generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda", generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(1, T*nh, H, device="cuda", generator=gen))
    cu = torch.tensor(np.cumsum([0] + list(lengths)), dtype=torch.int32, device="cuda")
    inputs = GDPInputs(q, k, v, g, beta, K ** -0.5, nh, False, cu, save_for_backward=save)
    backend = cutedsl.CuTeDSLGatedDeltaProductCPBackend(segment_chunks=segment_chunks, **backend_args)
    o, final, _ = backend.one_device_forward(inputs)
    torch.cuda.synchronize()
    f64 = lambda x: x.double().cpu().numpy()
    ro, rf = naive_gated_delta_product(f64(q), f64(k), f64(v), f64(g), f64(beta), scale=K ** -0.5, num_householder=nh,
                                       cu_seqlens=cu.cpu().numpy())
    eo = float(np.linalg.norm(o.double().cpu().numpy() - ro) / np.linalg.norm(ro))
    ef = float(np.linalg.norm(final.double().cpu().numpy() - rf) / np.linalg.norm(rf))
    print(f"lengths {lengths} K{K} V{V} nh{nh} save {save} seg {segment_chunks} {backend_args}: o {eo:.2e} final {ef:.2e}", flush=True)
if sys.argv[1:] == ["split"]:
    run((5, 129, 64), 64, 64, 2, True, save_chunk_states=False)
    run((5, 129, 64), 64, 64, 2, True, save_prep=False)
    run((5, 129, 64), 64, 64, 2, True, save_prep=False, save_chunk_states=False)
    run((5, 129, 64), 64, 64, 2, True, mma="sync")
    run((300,), 64, 64, 2, True)
    run((5, 129, 64), 64, 64, 2, True)
elif sys.argv[1:] == ["one2"]:
    run((5, 129, 64), 64, 64, 2, False)
    run((5, 129, 64), 64, 64, 2, True)
elif only:
    run((5, 129, 64), 64, 64, 3, True)
else:
    for K, V in [(64, 64), (64, 128), (128, 64), (128, 128)]:
        for nh in (1, 2, 3):
            for save in (False, True):
                run((5, 129, 64), K, V, nh, save)
    run((300,), 64, 64, 2, True, 2)
