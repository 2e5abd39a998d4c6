"""Process-group plumbing shared by the torch frontend: group resolution and cross-rank agreement.

Every public CP entry point validates locally, then calls ``agree_or_raise`` *before* its first
data collective, so that bad input on one rank raises the same ValueError on every rank instead of
leaving the others blocked in a collective. The agreement header has one fixed size and travels on
every call whatever the flags (``check_inputs`` included), so ranks whose flags, shapes, ids or
call sequence differ meet in the same collective and raise together (docs/failure_modes.md).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from cp_linear.validation import (
    describe_failed,
    digest,
    nonfinite_flag,
    nonfinite_from_bounds,
    stacked_bounds,
    value_bounds,
)

HEADER_LEN = 32  # int64 per rank in every agreement header, whatever the call site
HEADER_MAGIC = 0x63706C696E  # "cplin": a header, not a stray data buffer of the same size

# torch >= 2.10 renamed all_gather_into_tensor to all_gather_single (the old name warns); same collective.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group(cp_group) -> dist.ProcessGroup:
    """Accept a ProcessGroup or a 1-D DeviceMesh; return the ProcessGroup."""
    if cp_group is None:
        raise ValueError("cp_group is required (a ProcessGroup or a 1-D DeviceMesh)")
    mesh_cls = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_cls is not None and isinstance(cp_group, mesh_cls):
        if cp_group.ndim != 1:
            raise ValueError(f"cp_group as a DeviceMesh must be 1-D; received a {cp_group.ndim}-D mesh")
        return cp_group.get_group()
    if not isinstance(cp_group, dist.ProcessGroup):
        raise ValueError(f"cp_group must be a ProcessGroup or a 1-D DeviceMesh; received {type(cp_group).__name__}")
    return cp_group


def group_rank_and_size(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where small control tensors must live for this group's backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def value_flags_tensor(flags) -> torch.Tensor:
    """0-d boolean tensors (True = a value check failed) -> one bool tensor [F], still on the device."""
    return torch.stack([torch.as_tensor(f).reshape(()) for f in flags]).to(torch.bool)


def nonfinite_flags(*tensors: torch.Tensor) -> torch.Tensor:
    """bool [n] on the tensors' device: True where a tensor holds NaN/Inf (no host read; one aminmax per tensor,
    the bounds stacked so that the flags take a few more operations in all)."""
    bounds = stacked_bounds(tensors, torch.aminmax)
    if bounds is None:  # an empty tensor: the flags one by one
        return value_flags_tensor([nonfinite_flag(x, value_bounds(x, torch.aminmax)) for x in tensors])
    return nonfinite_from_bounds(*bounds)


def read_value_flags(flags: torch.Tensor) -> list[bool]:
    """One host read of a flag tensor [F] (the single host sync of a one-device check)."""
    return [bool(x) for x in flags.tolist()]


def agree_or_raise(group: dist.ProcessGroup, error: str | None, signature: Sequence[int] = (),
                   *, what: str = "inputs", value_flags: torch.Tensor | None = None,
                   value_checks: Sequence[tuple[str, str]] = ()) -> None:
    """One fixed-size all-gather so that every rank learns whether any rank failed or disagrees.

    ``error``: this rank's local problem (None when fine). ``signature``: ints that must be equal on
    every rank (shapes, dtypes, flags, ids fingerprints; any length, it travels as a digest plus its
    first entries). ``what`` names the call site: ranks at different sites (a model that differs,
    a rank that skipped a layer) disagree too. ``value_flags`` bool [F] on the collective's device
    (``cp_linear.validation`` value checks, computed without a host read) ride in the same header,
    described by ``value_checks``.

    Every call moves exactly ``HEADER_LEN`` int64 per rank whatever its arguments, so two calls
    always match in size. On any failure every rank raises ValueError with the same message.
    Costs one collective and one host sync; messages travel only on the failure path.
    """
    signature = [int(s) for s in signature]
    shown = signature[:HEADER_LEN - 6]
    header = [HEADER_MAGIC, digest([what]), 1 if error else 0, 0, digest(signature), len(signature), *shown]
    header += [0] * (HEADER_LEN - len(header))
    device = collective_device(group)
    local = torch.tensor(header, dtype=torch.int64, device=device)
    if value_flags is not None and value_flags.numel():
        bits = value_flags.to(device=device, dtype=torch.int64).reshape(-1)
        local[3] = (bits << torch.arange(bits.numel(), device=device)).sum()  # stays on the device
    world = dist.get_world_size(group)
    gathered = torch.empty(world * HEADER_LEN, dtype=torch.int64, device=device)
    all_gather_single(gathered, local, group=group)
    rows = gathered.view(world, HEADER_LEN).tolist()
    sites = {tuple(row[:2]) for row in rows}
    failed = [rank for rank, row in enumerate(rows) if row[2] or row[3]]
    signatures = {tuple(row[4:6]) for row in rows}
    if len(sites) == 1 and not failed and len(signatures) == 1:
        return
    # failure path: every rank saw the same headers, so every rank takes it and gathers the texts
    flags_here = [bool(rows[dist.get_rank(group)][3] >> i & 1) for i in range(len(value_checks))]
    message = error or describe_failed(value_checks, flags_here)
    texts: list = [None] * world
    dist.all_gather_object(texts, (what, message, signature), group=group)
    if failed:  # a local failure explains a differing site too (that rank stopped early)
        detail = "; ".join(f"rank {rank}: {texts[rank][1]}" for rank in failed)
        raise ValueError(f"{texts[failed[0]][0]} rejected on {len(failed)} rank(s) — {detail}")
    if len(sites) > 1:
        detail = "; ".join(f"rank {rank}: {texts[rank][0]}" for rank in range(world))
        raise ValueError(f"ranks reached different collective steps ({detail}): the ranks run different code, "
                         "models or call sequences")
    detail = ", ".join(f"rank {rank}: {_shown(texts[rank][2])}" for rank in range(world))
    raise ValueError(f"{what} disagree across ranks ({detail})")


def _shown(signature: list[int]) -> str:
    return str(signature) if len(signature) <= 32 else f"{signature[:32]}... ({len(signature)} ints)"
