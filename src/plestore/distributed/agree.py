"""Ranks agree before they depend on each other: a fixed-size record from every rank (a digest
of what it opened, or the error it hit), gathered with a bounded wait.

Every collective after this one relies on all ranks having opened the same table the same way;
a rank that disagrees would otherwise hang its peers inside a collective of another size, or
sum rows of another table into theirs. The record is a fixed 512 bytes whatever happened, so
the gather itself always matches, and every rank raises the same error naming the ranks at odds.
A rank that never arrives (crashed, or not calling) is waited for at most `timeout_s`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RECORD_BYTES", "GroupDisagrees", "agree", "collective_device", "digest"]

RECORD_BYTES = 512  # status (1) + digest (32) + message (utf-8, truncated)
_OK, _FAILED = 1, 2


class GroupDisagrees(ValueError):
    """Ranks of a group opened different tables, or differently, or one of them failed."""


def digest(*parts: Any) -> bytes:
    """SHA-256 of the parts' reprs (JSON-like values: str, int, dict, list, tuple)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def collective_device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(
    group: Any,
    what: str,
    record: bytes | None,
    text: str,
    failed: bool = False,
    timeout_s: float = 60.0,
) -> None:
    """Every rank passes its 32-byte `record` and a `text` saying what it holds (or, with
    `failed`, what went wrong there); raises GroupDisagrees on every rank unless all records are
    equal and no rank failed."""
    world = dist.get_world_size(group)
    mine = bytearray(RECORD_BYTES)
    mine[0] = _FAILED if failed else _OK
    if not failed:
        mine[1:33] = record
    msg = text.encode()[: RECORD_BYTES - 33]
    mine[33 : 33 + len(msg)] = msg
    device = collective_device(group)
    send = torch.frombuffer(mine, dtype=torch.uint8).to(device)  # [RECORD_BYTES]
    recv = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(recv, send, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():  # bounded: a peer that never comes is an error, not a hang
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"plestore: {what}: not every one of the {world} ranks arrived within "
                f"{timeout_s} s (one crashed, or does not call this); the group is unusable now"
            )
        time.sleep(0.002)
    work.wait()
    records = recv.cpu().numpy().reshape(world, RECORD_BYTES)
    texts = [bytes(records[r, 33:]).rstrip(b"\0").decode(errors="replace") for r in range(world)]
    bad = [r for r in range(world) if records[r, 0] != _OK]
    if bad:
        reasons = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
        raise GroupDisagrees(f"plestore: {what} failed on rank(s) {bad}: {reasons}")
    digests = [bytes(records[r, 1:33]) for r in range(world)]
    if len(set(digests)) > 1:
        groups: dict[bytes, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        sides = " vs ".join(f"ranks {ranks}: {texts[ranks[0]]}" for ranks in groups.values())
        raise GroupDisagrees(
            f"plestore: {what}: the ranks disagree ({sides}); every rank must open the same "
            "table (same spec and data) with the same shard mode"
        )
