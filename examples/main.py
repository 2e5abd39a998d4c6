"""The README's main job: train the hybrid GDP + attention decoder with context parallelism.

Runs examples/train_torch.py (2 CP ranks over gloo on the CPU, about two minutes): a progress bar
with loss and tokens/s, the step-0 parity line (CP vs one device), out/train_torch/loss.png.
Arguments go to train_torch (``./dev main --steps 50``, ``./dev main --help``); exits 1 when the
parity check fails. The earlier summary-fold demo is examples/summary_demo.py.
"""

import sys

from examples.train_torch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
