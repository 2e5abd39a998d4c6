import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_core_imports_neither_torch_nor_jax():
    code = ("import sys, cp_linear, cp_linear.reference, cp_linear.plan, cp_linear.summary, cp_linear.chunking, "
            "cp_linear.gdp, cp_linear.weights, cp_linear.model_config, cp_linear.packing; "
            "bad = [m for m in ('torch', 'jax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def imported_packages(package: str) -> dict[str, set[str]]:
    """{file: top-level packages it imports} over every module of ``package`` (read as text, not run)."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names
    return found


@pytest.mark.parametrize("package, forbidden", [
    pytest.param("cp_linear", {"torch_api", "jax_api"}, id="core-imports-no-frontend"),
    pytest.param("torch_api", {"jax_api", "jax", "flax"}, id="torch-imports-no-jax"),
    pytest.param("jax_api", {"torch_api", "torch"}, id="jax-imports-no-torch"),
])
def test_the_house_is_core_then_two_frontends_with_no_arrow_between_them(package, forbidden):
    offending = {path: sorted(names & forbidden) for path, names in imported_packages(package).items()
                 if names & forbidden}
    assert not offending, offending
