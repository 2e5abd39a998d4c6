"""The README's main job."""

import sys

from examples.summary_demo import main

if __name__ == "__main__":
    sys.exit(0 if main() < 1e-5 else 1)
