"""Tolerances derived from the rounding error of the quantity compared, not from one machine.

The model and the chain lengths live in the core (``cp_linear.rounding``, which the examples'
parity check uses too); this module adds the measurements of cancellation the tests need.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3, and the probabilistic bound
of Higham & Mary, 2019): a value computed with unit roundoff ``u`` (float32: 2^-24) through a chain
of ``n`` rounded accumulations carries a relative error of about ``u * sqrt(n)`` times the
*cancellation* of the computation, ``kappa = sum|terms| / |sum terms|`` (1 when the terms do not
cancel). A test therefore allows

    tolerance(length=n, cancellation=kappa) = SAFETY * u * sqrt(n) * kappa

where ``n`` is the length of the longest chain of accumulations that feeds the compared value
(a K-term dot product: K; a recurrence over S steps of K-term updates: S * K; see the
``*_length`` helpers) and ``SAFETY`` is how many expected errors a difference may reach before
it is not rounding. Two results that both carry rounding (two float32 implementations, or two
float64 ones) each bring their own error: ``compared_with="rounded"`` doubles the bound. ``kappa``
is measured where a reduction is known to cancel (``cancellation``, ``magnitude_cancellation``,
``token_cancellation``), e.g. a parameter gradient summed over tokens.

Nothing here depends on the machine: the bound moves with the sizes of the test, not with the
BLAS build, the thread count or the order a library happens to add in.
"""

from __future__ import annotations

import math
import os

import numpy as np

from cp_linear.rounding import (  # noqa: F401  (re-exported for the tests)
    SAFETY,
    attention_length,
    decoder_length,
    gdp_length,
    layer_length,
    unit_roundoff,
)
from cp_linear.rounding import rounding_tolerance as tolerance


def _kappa(magnitude: float, total: float) -> float:
    if total == 0.0:
        return 1.0 if magnitude == 0.0 else math.inf
    return max(1.0, float(magnitude / total))


def cancellation(terms, axis: int = 0) -> float:
    """kappa = ||sum |terms| || / ||sum terms|| of the reduction over ``axis`` (float64 terms)."""
    terms = np.asarray(terms, np.float64)
    return _kappa(np.linalg.norm(np.sum(np.abs(terms), axis=axis)), np.linalg.norm(np.sum(terms, axis=axis)))


def magnitude_cancellation(fn, *arrays) -> float:
    """kappa of an expression built from sums and products: ||fn(|x|)|| / ||fn(x)||, in float64.

    This is the standard componentwise error bound ``|fl(f(x)) - f(x)| <= gamma_n f(|x|)`` turned
    into a norm-wise ratio (matrix products, affine summary folds).
    """
    exact = [np.asarray(a, np.float64) for a in arrays]
    return _kappa(np.linalg.norm(fn(*(np.abs(a) for a in exact))), np.linalg.norm(fn(*exact)))


def token_cancellation(grad_fn, cotangent, token_axes: int = 2) -> dict[str, float]:
    """kappa of every gradient of a sum over tokens, e.g. a parameter gradient of ``sum(out * cotangent)``.

    ``grad_fn(cotangent) -> {name: array}`` must be linear in the cotangent ([B, T, ...], tokens on
    the first ``token_axes`` axes): it is called once per token with the cotangent kept on that
    token only, and kappa = ||sum_t |g_t| || / ||sum_t g_t||. kappa needs one digit, so float32
    gradients serve.
    """
    cot = np.asarray(cotangent)
    magnitude: dict[str, np.ndarray] = {}
    for index in np.ndindex(*cot.shape[:token_axes]):
        masked = np.zeros_like(cot)
        masked[index] = cot[index]
        for name, grad in grad_fn(masked).items():
            part = np.abs(np.asarray(grad, np.float64))
            magnitude[name] = magnitude[name] + part if name in magnitude else part
    totals = grad_fn(cot)
    return {name: _kappa(np.linalg.norm(magnitude[name]), np.linalg.norm(np.asarray(grad, np.float64)))
            for name, grad in totals.items()}


# --------------------------------------------------------------------------- lengths of the computations


def summary_length(count: int, key_dim: int) -> int:
    """A fold of ``count`` summaries: ``count`` chained K-term matrix products."""
    return max(1, count) * key_dim


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


REPORT_ENV = "CP_LINEAR_TOLERANCE_REPORT"  # a file path: every check appends "err tol name" to it


def assert_close(name: str, ref, out, tol: float) -> None:
    """Norm-wise relative error of ``out`` against ``ref`` within ``tol`` (message names both)."""
    assert_within(name, rel_err(out, ref), tol)


def assert_within(name: str, err: float, tol: float) -> None:
    """An already computed relative error within ``tol`` (e.g. one measured on a worker rank)."""
    report = os.environ.get(REPORT_ENV)
    if report:
        with open(report, "a") as handle:
            handle.write(f"{err:.3e} {tol:.3e} {name}\n")
    assert err <= tol, f"{name}: relative error {err:.3e} exceeds the derived tolerance {tol:.3e}"


__all__ = ["SAFETY", "assert_close", "assert_within", "attention_length", "cancellation", "decoder_length",
           "gdp_length", "layer_length", "magnitude_cancellation", "rel_err", "summary_length", "token_cancellation",
           "tolerance", "unit_roundoff"]
