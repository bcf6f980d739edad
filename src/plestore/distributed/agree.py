"""Ranks agree before they depend on each other: a fixed-size record from every rank (a digest
of what it opened, or the error it hit), exchanged through the group's store with a bounded wait.

Every collective after this one relies on all ranks having opened the same table the same way;
a rank that disagrees would otherwise hang its peers inside a collective of another size, or
sum rows of another table into theirs. Every rank reads every record and raises the same error
naming the ranks at odds. The exchange goes through the group's key-value store (TCPStore),
not a collective: its wait takes a timeout, so a rank that never arrives (crashed, or not
calling) is waited for at most `timeout_s`, and no NCCL communicator has to exist yet (one
created lazily would wait for every rank without a bound). Where the store cannot be reached
(a torch without the accessor), a fixed-size all-gather polled with the same bound stands in.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RECORD_BYTES", "GroupDisagrees", "agree", "collective_device", "digest"]

RECORD_BYTES = 512  # status (1) + digest (32) + text (utf-8, truncated)
_OK, _FAILED = 1, 2
_calls: dict[int, int] = {}  # agreements so far per group: the n-th has the same n on every rank


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
    equal and no rank failed, TimeoutError if a rank does not arrive within timeout_s."""
    group = dist.group.WORLD if group is None else group
    world = dist.get_world_size(group)
    mine = bytearray(RECORD_BYTES)
    mine[0] = _FAILED if failed else _OK
    if not failed:
        mine[1:33] = record
    msg = text.encode()[: RECORD_BYTES - 33]
    mine[33 : 33 + len(msg)] = msg
    late = (
        f"plestore: {what}: not every one of the {world} ranks arrived within {timeout_s} s "
        "(one crashed, or does not call this); the group is out of step now"
    )
    store = _store(group)
    if store is not None:
        records = _exchange_store(store, group, bytes(mine), world, timeout_s, late)
    else:
        records = _exchange_gather(group, bytes(mine), world, timeout_s, late)
    texts = [r[33:].rstrip(b"\0").decode(errors="replace") for r in records]
    bad = [r for r in range(world) if records[r][0] != _OK]
    if bad:
        reasons = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
        raise GroupDisagrees(f"plestore: {what} failed on rank(s) {bad}: {reasons}")
    groups: dict[bytes, list[int]] = {}
    for r, rec in enumerate(records):
        groups.setdefault(rec[1:33], []).append(r)
    if len(groups) > 1:
        sides = " vs ".join(f"ranks {ranks}: {texts[ranks[0]]}" for ranks in groups.values())
        raise GroupDisagrees(
            f"plestore: {what}: the ranks disagree ({sides}); every rank must open the same "
            "table (same spec and data) with the same shard mode"
        )


def _store(group: Any) -> Any:
    get = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    try:
        return get(group) if get is not None else None
    except (KeyError, RuntimeError):
        return None


def _exchange_store(store, group, mine: bytes, world: int, timeout_s: float, late: str):
    n = _calls[id(group)] = _calls.get(id(group), -1) + 1
    keys = [f"plestore/agree/{n}/{r}" for r in range(world)]
    store.set(keys[dist.get_rank(group)], mine)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:  # DistStoreError: the wait timed out
        raise TimeoutError(late) from e
    return [bytes(store.get(k)) for k in keys]


def _exchange_gather(group, mine: bytes, world: int, timeout_s: float, late: str):
    device = collective_device(group)
    send = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)  # [RECORD_BYTES]
    recv = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(recv, send, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():  # bounded: a peer that never comes is an error, not a hang
        if time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.002)
    work.wait()
    flat = recv.cpu().numpy().tobytes()
    return [flat[r * RECORD_BYTES : (r + 1) * RECORD_BYTES] for r in range(world)]
