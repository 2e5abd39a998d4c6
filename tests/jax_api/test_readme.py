"""The README's JAX snippet runs as written, on meshes with Explicit axes (``jax.make_mesh`` on JAX
>= 0.10) and with Auto axes, and the results index and differentiate eagerly outside a mesh context."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

from tests.conftest import child_xla_flags  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def readme_jax_snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## JAX"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("axis_types", [pytest.param(None, id="make_mesh-default-explicit-on-jax-0.10"),
                                        pytest.param("Auto", id="auto")])
def test_readme_jax_snippet_runs_eagerly_and_under_jit_and_grad(axis_types):
    code = readme_jax_snippet()
    if axis_types is not None:
        mesh_line = 'mesh = jax.make_mesh((4,), ("cp",))'
        assert mesh_line in code
        code = code.replace(mesh_line, f'mesh = jax.make_mesh((4,), ("cp",), '
                                       f'axis_types=(jax.sharding.AxisType.{axis_types},))')
    # the results are ordinary arrays: index them, differentiate eagerly, compare with one device
    code += """
from jax_api import gated_delta_product
from tests.tolerance import assert_close, gdp_length, tolerance
tol = tolerance(gdp_length(T, n_h, K), compared_with="rounded")
assert_close("eager grad against jit grad", dq, jax.grad(lambda q: gdp(q).sum())(q), tol)
one, _ = gated_delta_product(q, k, v, g, beta, seq_idx=seq_idx, num_householder=n_h, use_qk_l2norm_in_kernel=True)
assert_close("CP against one device", one, o, tol)
print("README snippet OK")
"""
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(4), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "README snippet OK" in result.stdout, (result.stdout[-2000:]
                                                                             + result.stderr[-4000:])
