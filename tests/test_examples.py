"""The training examples run end to end with small flags (the CI smoke test of ./dev main).

Each runs in a fresh process as a user would start it: the torch one spawns 2 gloo ranks, the JAX
one asks XLA for host devices before importing jax. Both must print a parity line whose CP and
one-device numbers agree, write loss.png and history.json, and exit 0.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cp_linear.model_config import DecoderConfig
from examples.data import RecallTask
from tests.tolerance import assert_within, decoder_length, tolerance

REPO = Path(__file__).resolve().parents[1]
FAST = ["--steps", "3", "--seq-len", "96", "--layers", "2", "--hidden", "32", "--head-dim", "16"]
# the model FAST trains (the examples' defaults for the other flags): the bound of the parity line
FAST_CONFIG = DecoderConfig(vocab_size=RecallTask().vocab_size, hidden_size=32, num_layers=2, num_heads=2,
                            head_dim=16, num_kv_heads=1, num_householder=2)
PARITY = re.compile(r"parity \(step 0\): loss with CP over 2 ranks (\S+), on one device (\S+), \|diff\| (\S+); "
                    r"gradient rel\. diff (\S+)")


STEP0_LOSSES: dict[str, float] = {}  # module -> the step-0 loss on one device, filled by the runs below


@pytest.mark.parametrize("module", ["examples.train_torch", "examples.train_jax"])
def test_every_example_flag_has_help_text(module):
    import importlib

    parser = importlib.import_module(module).parser()
    missing = [action.option_strings for action in parser._actions if not action.help]
    assert not missing, missing


@pytest.mark.multirank
@pytest.mark.parametrize("module", [pytest.param("examples.main", id="torch-via-main"),
                                    pytest.param("examples.train_jax", id="jax")])
def test_example_trains_and_reports_parity(module, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", module, *FAST, "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = PARITY.search(result.stdout)
    assert match, result.stdout[-3000:]
    cp_loss, single_loss, diff, grad_rel = map(float, match.groups())
    # CP and one device: two float32 runs of the model, the loss a mean over every logit
    tol = tolerance(decoder_length(FAST_CONFIG, 96) + 96 * FAST_CONFIG.vocab_size, compared_with="rounded")
    tol += 1e-7 / abs(single_loss)  # the losses are printed to 7 decimals
    assert_within("loss", abs(cp_loss - single_loss) / abs(single_loss), tol)
    assert_within("printed |diff|", diff / abs(single_loss), tol)
    assert_within("parameter gradients", grad_rel, tol)
    STEP0_LOSSES[module] = single_loss
    history = json.loads((out / "history.json").read_text())
    # the printed loss is the stored one rounded to 7 decimals
    assert len(history["loss"]) == 3 and history["parity"]["cp_loss"] == pytest.approx(cp_loss, abs=0.5e-7)
    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "tokens/s" in result.stdout


@pytest.mark.multirank
def test_torch_and_jax_examples_start_from_the_same_weights():
    """Same --seed: the same initial weights (cp_linear.weights.initial_table) and the same batches, so
    the step-0 loss on one device agrees across the frameworks to float32 rounding of the model."""
    if len(STEP0_LOSSES) < 2:
        pytest.skip("needs both example runs of this session (test_example_trains_and_reports_parity)")
    torch_loss, jax_loss = STEP0_LOSSES["examples.main"], STEP0_LOSSES["examples.train_jax"]
    tol = tolerance(decoder_length(FAST_CONFIG, 96) + 96 * FAST_CONFIG.vocab_size, compared_with="rounded")
    printed = 1e-7 / abs(torch_loss)  # both losses are printed to 7 decimals
    assert_within("step-0 loss, torch against JAX", abs(torch_loss - jax_loss) / abs(torch_loss), tol + printed)
