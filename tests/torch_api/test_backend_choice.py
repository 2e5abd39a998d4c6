"""backend=None: the CuTeDSL kernels on a Hopper GPU for a configuration they take, the reference
elsewhere; an explicit backend stays. The GPU is faked by replacing the capability query."""

import pytest
import torch

from torch_api.gdp import cutedsl
from torch_api.gdp.chunk import TorchGDPBackend
from torch_api.gdp.ops import resolve_backend
from torch_api.layers import GatedDeltaProduct

GPU = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A device that reports compute capability ``fake_gpu.capability`` (sm_90 unless changed),
    with the DSL installed; the choice's caches start empty."""
    class Fake:
        capability = (9, 0)

    monkeypatch.setattr(cutedsl, "device_capability", lambda device: Fake.capability)
    monkeypatch.setattr(cutedsl, "dsl_reason", lambda: None)
    monkeypatch.setattr(cutedsl, "_PLATFORM_REASONS", {})
    monkeypatch.setattr(cutedsl, "_AUTO_WARNED", set())
    return Fake


@pytest.mark.parametrize("dtype, key_dim, value_dim, n_h", [
    pytest.param(torch.bfloat16, 128, 128, 2, id="bf16-K128-V128-nh2"),
    pytest.param(torch.float16, 64, 128, 1, id="fp16-K64-V128-nh1"),
    pytest.param(torch.bfloat16, 64, 64, 3, id="bf16-K64-V64-nh3"),
])
def test_hopper_with_a_supported_configuration_gets_the_kernels(fake_gpu, recwarn, dtype, key_dim, value_dim, n_h):
    assert cutedsl.choose_backend_name(GPU, (dtype,) * 3, key_dim, value_dim, n_h) == ("cutedsl", None)
    assert not [w for w in recwarn.list if "backend=None" in str(w.message)]


@pytest.mark.parametrize("dtypes, key_dim, value_dim, n_h, match", [
    pytest.param((torch.float32,) * 3, 128, 128, 2, "bfloat16 or float16", id="float32"),
    pytest.param((torch.bfloat16, torch.bfloat16, torch.float16), 128, 128, 2, "one dtype", id="mixed-dtypes"),
    pytest.param((torch.bfloat16,) * 3, 96, 128, 2, r"K, V in \(64, 128\); received K = 96", id="K96"),
    pytest.param((torch.bfloat16,) * 3, 128, 256, 2, "V = 256", id="V256"),
    pytest.param((torch.bfloat16,) * 3, 128, 128, 4, r"num_householder in \(1, 2, 3\); received 4", id="nh4"),
])
def test_unsupported_configuration_falls_back_with_one_warning(fake_gpu, dtypes, key_dim, value_dim, n_h, match):
    with pytest.warns(UserWarning, match=match) as caught:
        name, reason = cutedsl.choose_backend_name(GPU, dtypes, key_dim, value_dim, n_h)
        cutedsl.choose_backend_name(GPU, dtypes, key_dim, value_dim, n_h)  # the same reason: said once
    assert name == "reference" and "\n" not in reason
    assert len([w for w in caught if "backend=None runs TorchGDPBackend" in str(w.message)]) == 1


def test_other_gpus_and_the_cpu_get_the_reference_silently(fake_gpu, recwarn):
    fake_gpu.capability = (8, 0)
    name, reason = cutedsl.choose_backend_name(GPU, (torch.bfloat16,) * 3, 128, 128, 2)
    assert name == "reference" and "compute capability 8.0" in reason
    name, reason = cutedsl.choose_backend_name(torch.device("cpu"), (torch.bfloat16,) * 3, 128, 128, 2)
    assert name == "reference" and "CUDA device" in reason
    assert not [w for w in recwarn.list if "backend=None" in str(w.message)]


def test_cpu_tensors_always_get_the_reference_backend():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(1, 4, 2, 128, dtype=dtype)
        k = v = torch.zeros(1, 8, 2, 128, dtype=dtype)
        assert type(resolve_backend(None, q, k, v, 2)) is TorchGDPBackend
        assert type(resolve_backend("auto", q, k, v, 2)) is TorchGDPBackend


def test_an_explicit_backend_is_kept_and_names_resolve():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    explicit = TorchGDPBackend(chunk_size=16)
    assert resolve_backend(explicit, q, k, v, 2) is explicit
    assert type(resolve_backend("reference", q, k, v, 2)) is TorchGDPBackend
    assert isinstance(resolve_backend("cutedsl", q, k, v, 2), cutedsl.CuTeDSLGatedDeltaProductCPBackend)
    with pytest.raises(ValueError, match="one of"):
        resolve_backend("fla", q, k, v, 2)


def test_the_layer_uses_the_automatic_choice(monkeypatch):
    """GatedDeltaProduct(backend=None) asks the same choice function as the ops, with its n_h."""
    asked = []

    def spy(q, k, v, num_householder):
        asked.append((q.shape[-1], v.shape[-1], num_householder))
        return TorchGDPBackend()

    monkeypatch.setattr(cutedsl, "auto_backend", spy)
    torch.manual_seed(0)
    layer = GatedDeltaProduct(hidden_size=16, head_dim=8, num_heads=2, expand_v=1.0, num_householder=3)
    layer(torch.randn(1, 9, 16), cu_seqlens=torch.tensor([0, 4, 9])).sum().backward()
    assert asked == [(8, 8, 3)]
