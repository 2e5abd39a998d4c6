"""Process-group plumbing shared by the torch frontend: group resolution and cross-rank agreement.

Every public CP entry point validates locally, then calls ``agree_or_raise`` *before* its first
data collective, so that bad input on one rank raises the same ValueError on every rank instead of
leaving the others blocked in a collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

SIGNATURE_LEN = 24  # ints per rank in the agreement header; enough for every caller's shapes

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


def agree_or_raise(group: dist.ProcessGroup, error: str | None, signature: Sequence[int] = (),
                   *, what: str = "inputs") -> None:
    """One small all-gather so that every rank learns whether any rank failed or disagrees.

    ``error`` is this rank's local validation message (None when fine); ``signature`` is a short
    list of ints that must be equal on every rank (shapes, flags). On any failure every rank
    raises ValueError with the same message. Costs one collective and one host sync; messages are
    exchanged only on the failure path.
    """
    signature = [int(s) for s in signature]
    if len(signature) > SIGNATURE_LEN - 2:
        raise ValueError(f"agreement signature too long ({len(signature)} > {SIGNATURE_LEN - 2})")
    header = [1 if error else 0, len(signature), *signature]
    header += [0] * (SIGNATURE_LEN - len(header))
    device = collective_device(group)
    local = torch.tensor(header, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = torch.empty(world * SIGNATURE_LEN, dtype=torch.int64, device=device)
    all_gather_single(gathered, local, group=group)
    rows = gathered.view(world, SIGNATURE_LEN).tolist()
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failed:
        messages: list[str | None] = [None] * world
        dist.all_gather_object(messages, error, group=group)
        detail = "; ".join(f"rank {rank}: {messages[rank]}" for rank in failed)
        raise ValueError(f"{what} rejected on {len(failed)} rank(s) — {detail}")
    signatures = [row[2:2 + row[1]] for row in rows]
    if any(sig != signatures[0] for sig in signatures):
        detail = ", ".join(f"rank {rank}: {sig}" for rank, sig in enumerate(signatures))
        raise ValueError(f"{what} disagree across ranks ({detail})")
