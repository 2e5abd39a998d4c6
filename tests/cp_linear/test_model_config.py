"""The shared layer configs: flash-linear-attention's GatedDeltaProduct defaults and parameter shapes,
and the keyword signatures the layers of both frontends show in help()."""

import inspect
import pydoc

import pytest

from cp_linear.model_config import GDPConfig, parameter_shapes

# fla/layers/gated_deltaproduct.py (flash-linear-attention): GatedDeltaProduct(hidden_size=2048, expand_v=2,
# head_dim=256, num_heads=6, num_v_heads=None, use_output_gate=True, use_short_conv=True, conv_size=4,
# conv_bias=False, norm_eps=1e-5, use_forget_gate=True, allow_neg_eigval=True, num_householder=2)
FLA_DEFAULTS = dict(hidden_size=2048, expand_v=2, head_dim=256, num_heads=6, num_v_heads=None, use_output_gate=True,
                    use_short_conv=True, conv_size=4, conv_bias=False, norm_eps=1e-5, use_forget_gate=True,
                    allow_neg_eigval=True, num_householder=2)


def fla_shapes(hidden_size):
    """The parameter shapes FLA's layer builds, written out from its __init__ with the defaults above:
    key_dim = 6 * 256, value_dim = 6 * 512, k and v carry num_householder = 2 vectors per token."""
    key_dim, value_dim, heads, head_v_dim, n = 6 * 256, 6 * 512, 6, 512, 2
    return {
        "q_proj.weight": (key_dim, hidden_size), "k_proj.weight": (key_dim * n, hidden_size),
        "v_proj.weight": (value_dim * n, hidden_size), "b_proj.weight": (heads * n, hidden_size),
        "a_proj.weight": (heads, hidden_size), "A_log": (heads,), "dt_bias": (heads,),
        "q_conv1d.weight": (key_dim, 1, 4), "k_conv1d.weight": (key_dim * n, 1, 4),
        "v_conv1d.weight": (value_dim * n, 1, 4), "g_proj.weight": (value_dim, hidden_size),
        "o_norm.weight": (head_v_dim,), "o_proj.weight": (hidden_size, value_dim),
    }


def test_gdp_config_defaults_are_flash_linear_attentions():
    config = GDPConfig()
    assert {name: getattr(config, name) for name in FLA_DEFAULTS} == FLA_DEFAULTS


def test_gdp_config_of_hidden_256_builds_flas_parameter_shapes():
    assert parameter_shapes(GDPConfig(hidden_size=256)) == fla_shapes(256)


def test_torch_layer_of_hidden_256_builds_flas_parameter_shapes():
    torch_layers = pytest.importorskip("torch_api.layers")
    layer = torch_layers.GatedDeltaProduct(hidden_size=256)
    assert {name: tuple(p.shape) for name, p in layer.named_parameters()} == fla_shapes(256)


def test_nnx_layer_of_hidden_256_builds_flas_parameter_shapes():
    nnx = pytest.importorskip("flax.nnx")
    jax_layers = pytest.importorskip("jax_api.layers")
    layer = jax_layers.GatedDeltaProduct(hidden_size=256, rngs=nnx.Rngs(0))
    assert {name: a.shape for name, a in layer.state_table().items()} == fla_shapes(256)


@pytest.mark.parametrize("frontend", ["torch_api.layers", "jax_api.layers"])
@pytest.mark.parametrize("layer, fields", [
    pytest.param("GatedDeltaProduct", ("hidden_size", "head_dim", "num_heads", "expand_v", "num_householder"), id="gdp"),
    pytest.param("BlockDiagAttention", ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "mode"), id="attention"),
])
def test_help_of_every_layer_shows_its_keyword_arguments(frontend, layer, fields):
    module = pytest.importorskip(frontend)
    cls = getattr(module, layer)
    parameters = inspect.signature(cls).parameters
    assert set(fields) <= set(parameters), sorted(parameters)
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in fields)
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert all(f"{name}" in text.split("\n |  \n")[0] for name in fields), text[:600]


@pytest.mark.parametrize("frontend", ["torch_api.layers", "jax_api.layers"])
@pytest.mark.parametrize("layer", ["GatedDeltaProduct", "BlockDiagAttention"])
def test_help_of_every_layer_lists_each_keyword_argument_of_its_init(frontend, layer):
    module = pytest.importorskip(frontend)
    cls = getattr(module, layer)
    code = cls.__init__.__code__  # the function itself: its __signature__ is the documented one
    own = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    assert set(own) <= set(inspect.signature(cls).parameters), (own, sorted(inspect.signature(cls).parameters))
