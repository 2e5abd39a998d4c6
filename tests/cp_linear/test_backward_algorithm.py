"""The blocked backward the kernels will implement (``cp_linear.kernels.backward_algorithm``),
checked in float64 against torch autograd through its own forward, and that forward against the
float64 reference recurrence."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cp_linear.kernels import backward_algorithm as ba  # noqa: E402
from cp_linear.reference import naive_gated_delta_product  # noqa: E402
from tests.cp_linear.gdp_cases import rel_err  # noqa: E402


def _inputs(tokens, heads, key_dim, value_dim, n_h, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(tokens, heads, key_dim), r(tokens * n_h, heads, key_dim), r(tokens * n_h, heads, value_dim)
    k = k / k.norm(dim=-1, keepdim=True) * 1.1  # near-unit keys keep the recurrence bounded without l2norm
    g = torch.nn.functional.logsigmoid(r(tokens, heads) + 2.0)
    beta = torch.sigmoid(r(tokens * n_h, heads)) * 1.5
    initial = r(heads, key_dim, value_dim) * 0.3
    return q, k, v, g, beta, initial


@pytest.mark.parametrize("n_h, use_l2", [(1, True), (2, True), (3, False), (2, False)])
def test_forward_matches_the_reference_recurrence(n_h, use_l2):
    q, k, v, g, beta, initial = _inputs(150, 2, 16, 12, n_h, seed=n_h)
    o, final = ba.sequence_forward(q, k, v, g, beta, num_householder=n_h, scale=0.3, use_l2=use_l2,
                                   initial_state=initial)
    ref_o, ref_final = naive_gated_delta_product(*(x.numpy()[None] for x in (q, k, v, g, beta)), scale=0.3,
                                                 num_householder=n_h, initial_state=initial.numpy()[None],
                                                 use_qk_l2norm_in_kernel=use_l2)
    assert rel_err(o.numpy(), ref_o[0]) < 1e-12
    assert rel_err(final.numpy(), ref_final[0]) < 1e-12


@pytest.mark.parametrize("n_h, use_l2, segment_chunks", [(1, True, None), (2, True, 2), (3, False, 1),
                                                         (2, False, 3)])
def test_explicit_backward_matches_autograd(n_h, use_l2, segment_chunks):
    q, k, v, g, beta, initial = _inputs(150, 2, 16, 12, n_h, seed=10 + n_h)
    gen = torch.Generator().manual_seed(99)
    do = torch.randn(150, 2, 12, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(2, 16, 12, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, initial)]
    o, final = ba.sequence_forward(*leaves[:5], num_householder=n_h, scale=0.3, use_l2=use_l2,
                                   initial_state=leaves[5])
    torch.autograd.backward([o, final], [do, dfinal])
    got = ba.sequence_backward(q, k, v, g, beta, do, dfinal, num_householder=n_h, scale=0.3, use_l2=use_l2,
                               initial_state=initial, segment_chunks=segment_chunks)
    for name, leaf, grad in zip(("q", "k", "v", "g", "beta", "initial"), leaves, got):
        assert grad.shape == leaf.shape, name
        assert rel_err(grad.numpy(), leaf.grad.numpy()) < 1e-10, name
