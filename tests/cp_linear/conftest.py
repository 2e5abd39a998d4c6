"""Fixtures shared by the kernel tests of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture
def emulated_launches(monkeypatch):
    """Runs the torch kernel paths on CPU tensors: the platform gate passes (``validation._kernel_platform_ready``),
    launches are carried out by the emulation and recorded in the returned list, in order."""
    import torch_api.gdp.cutedsl as cutedsl
    from cp_linear.kernels import launch as kl
    from cp_linear.kernels.emulation import run_emulated
    from torch_api.gdp import validation

    launches = []

    def run(launch):
        launches.append(launch)
        run_emulated(launch)

    monkeypatch.setattr(validation, "_kernel_platform_ready", lambda device: True)
    monkeypatch.setattr(kl._Launch, "run", run)
    monkeypatch.setattr(cutedsl, "_sm_count", lambda device: 132)
    return launches
