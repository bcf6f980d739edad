"""The lookup-ids fuzz target: row ids of every dtype, shape, device and memory layout, through
`lookup`, `prefetch` and `lookup_into` on every tier. Accepted ids must give the exact rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from fuzz_cases import Case, Mutator, Target
from fuzz_targets import small_tables

__all__ = ["LookupIdsTarget"]

_NP_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
_NP_ODD = ("float32", "float64", "bool", "complex64", "object", "U3", "float16")
_TORCH = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16)
_TORCH_ODD = (torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.float64)


class LookupIdsTarget(Target):
    clear = (ValueError, IndexError)
    TIERS = ("device", "pinned", "mapped", "direct")

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import plestore
        from plestore.formats import get_format

        tf, rows = small_tables(root)[0]
        self.rows = tf.spec.rows
        fmt = get_format(tf.spec.format)
        self.want = torch.from_numpy(fmt.decode_numpy(rows, tf.spec.scale)).to(torch.bfloat16)
        self.dim = tf.spec.dim
        self.tables = {
            t: plestore.open_table(tf.meta_path, tier=t, device="cpu", cache_bytes=1 << 16)
            for t in self.TIERS
        }

    def close(self) -> None:
        for t in self.tables.values():
            t.close()

    def case(self, rng) -> Case:
        m = Mutator(rng)
        n = self.rows
        shape = m.pick([(4,), (2, 3), (0,), (1,), (3, 1, 2), (), (5, 0), (64,), (2, 300)])
        values = rng.integers(0, n, shape if shape else ()).astype(np.int64)
        r = rng.random()
        if r < 0.15:  # out of range somewhere
            values = np.array(values)
            if values.size:
                values.reshape(-1)[int(rng.integers(values.size))] = m.pick(
                    [-1, n, n + 1, 2**40, -(2**62), 2**63 - 1]
                )
        torch_ids = rng.random() < 0.4
        odd = rng.random() < 0.2
        if torch_ids:
            dt = m.pick(_TORCH_ODD if odd else _TORCH)
            ids = torch.from_numpy(np.array(values)).to(dt)
            view = int(rng.integers(4))
            if view == 1 and ids.dim() >= 2:
                ids = ids.transpose(0, -1)  # non-contiguous
            elif view == 2 and ids.dim() >= 1:
                ids = ids[::2]
            elif view == 3:
                ids = ids.to("meta") if rng.random() < 0.5 else ids.expand(2, *ids.shape)
        else:
            dt = m.pick(_NP_ODD if odd else _NP_DTYPES)
            with np.errstate(all="ignore"):
                ids = np.array(values).astype(dt) if dt != "object" else np.array(values, object)
            view = int(rng.integers(4))
            if view == 1 and ids.ndim >= 2:
                ids = ids.T
            elif view == 2 and ids.ndim >= 1:
                ids = ids[::-1]
            elif view == 3:
                ids = m.pick([ids.tolist(), [[1, 2], [3]], "12", None, [2**70], 3])
        how = m.pick(["lookup", "prefetch", "into", "into-bad"])
        return Case(how, (m.pick(self.TIERS), ids))

    def run(self, case: Case) -> None:
        tier, ids = case.data
        table = self.tables[tier]
        if case.kind == "lookup":
            got = table.lookup(ids)
        elif case.kind == "prefetch":
            got = table.prefetch(ids).result(timeout=30)
        else:
            shape = tuple(np.shape(ids))
            out_shape = (*shape[:-1], shape[-1] * self.dim) if shape else (self.dim,)
            out = torch.empty(out_shape, dtype=torch.bfloat16)
            if case.kind == "into-bad":
                out = torch.empty(out_shape[::-1] or (1,), dtype=torch.float32)
            got = table.lookup_into(ids, out)
        flat = torch.as_tensor(np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids))
        flat = flat.reshape(-1).to(torch.int64)
        want = self.want[flat].reshape(got.shape)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"{tier}: a lookup returned rows other than the table's")
