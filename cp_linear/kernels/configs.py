"""Compile-time configuration of every GDP forward kernel (no cutlass import here).

Each kernel is compiled once per config; the frozen dataclass *is* the in-process cache key
(``cp_linear.kernels.cache``), so a field cannot be forgotten in the key. Everything else —
sequence length T, the number of sequences N, the number of heads H, the Householder count
n_h, the qk l2norm switch and the scale — is a run-time argument and never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from cp_linear.chunking import CHUNK_SIZE  # interleaved steps per chunk; every chunk starts at its sequence's start
HEAD_DIMS = (64, 128)  # supported K and V
INPUT_DTYPES = ("bfloat16", "float16", "float32")
STATE_TILE = 16  # state columns per CTA in the sequential state pass and in folds
OUTPUT_TILE = 64  # value columns per CTA in the output kernel


def _check_head_dim(name: str, value: int) -> None:
    if value not in HEAD_DIMS:
        raise ValueError(f"{name} must be one of {HEAD_DIMS}; received {value}")


def _check_dtype(dtype: str) -> None:
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dtype must be one of {INPUT_DTYPES}; received {dtype!r}")


@dataclass(frozen=True)
class ChunkIndexConfig:
    """Per-sequence chunk offsets and the chunk -> sequence table (no shape parameter)."""

    threads: int = 1024

    def validate(self) -> None:
        if self.threads != 1024:
            raise ValueError(f"ChunkIndexConfig.threads must be 1024; received {self.threads}")


@dataclass(frozen=True)
class WYPrepareConfig:
    """Per-chunk UT transform: w = T diag(beta e^G) k, u = T diag(beta) v, cumulative gates."""

    dtype: str
    key_dim: int
    value_dim: int

    def validate(self) -> None:
        _check_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)


@dataclass(frozen=True)
class StatePassConfig:
    """Sequential chunk-to-chunk state recurrence over [K, W] states (W = V, or K for transitions)."""

    dtype: str
    key_dim: int

    def validate(self) -> None:
        _check_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)


@dataclass(frozen=True)
class OutputConfig:
    """Per-chunk output o = scale (e^G q h + (q k^T * decay) v_new) on the tokens' last steps."""

    dtype: str
    key_dim: int
    value_dim: int

    def validate(self) -> None:
        _check_dtype(self.dtype)
        _check_head_dim("key_dim", self.key_dim)
        _check_head_dim("value_dim", self.value_dim)


@dataclass(frozen=True)
class AffineFoldConfig:
    """Ascending fold S <- M_j S + E_j over stacked float32 summaries (or transitions)."""

    key_dim: int

    def validate(self) -> None:
        _check_head_dim("key_dim", self.key_dim)


KERNEL_CONFIGS = (ChunkIndexConfig, WYPrepareConfig, StatePassConfig, OutputConfig, AffineFoldConfig)


def all_forward_configs() -> list:
    """Every config the forward uses, for ahead-of-time compilation (the CLI and CI)."""
    configs: list = [ChunkIndexConfig()]
    for key_dim in HEAD_DIMS:
        configs.append(AffineFoldConfig(key_dim))
        for dtype in INPUT_DTYPES:
            configs.append(StatePassConfig(dtype, key_dim))
            for value_dim in HEAD_DIMS:
                configs.append(WYPrepareConfig(dtype, key_dim, value_dim))
                configs.append(OutputConfig(dtype, key_dim, value_dim))
    return configs


def describe(config) -> str:
    """Short human-readable form, e.g. ``OutputConfig(bfloat16, K=128, V=64)``."""
    labels = {"dtype": "", "key_dim": "K=", "value_dim": "V=", "threads": "threads="}
    parts = [f"{labels.get(f.name, f.name + '=')}{getattr(config, f.name)}" for f in fields(config)]
    return f"{type(config).__name__}({', '.join(parts)})"
