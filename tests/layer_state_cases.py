"""The two-window cases shared by the torch and JAX layer-state tests (tests/*/test_layer_states.py):
the same models and packing in both frontends, so their checks read alike."""

import numpy as np

from cp_linear.model_config import DecoderConfig

# no conv reach: the short conv does not carry its conv_size - 1 tokens across windows
GDP = dict(hidden_size=16, head_dim=4, num_heads=1, num_v_heads=2, expand_v=1.5, num_householder=2,
           use_short_conv=False)
DECODER = DecoderConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, head_dim=4, conv_size=1,
                        layer_types=("gdp", "gdp"))
# 24 tokens in two windows of 12: document 2 spans the window boundary, document 3 starts in window 2
DOC_IDS = np.array([1] * 5 + [2] * 11 + [3] * 8)
WINDOW = 12
