import subprocess
import sys


def test_importing_the_core_imports_neither_torch_nor_jax():
    code = ("import sys, cp_linear, cp_linear.reference, cp_linear.plan, cp_linear.summary; "
            "bad = [m for m in ('torch', 'jax') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
