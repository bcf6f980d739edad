"""vLLM 0.34's own PLE offload paths as `plestore bench vllm` step lookups, beside plestore's
tiers — written from their description (shared/spec/vllm.md "vLLM 0.33 / 0.34"), not copied:

| name              | where it runs   | what                                                      |
|-------------------|-----------------|-----------------------------------------------------------|
| vllm-pinned-uva   | in the graph    | `cpu_offload` (default on): the table in pinned host      |
|                   |                 | memory; each id's row gathered through UVA (one Triton    |
|                   |                 | program an id), then dequantised                          |
| vllm-disk-offload | before the graph| `disk_offload`, in input preparation: the GPU hash's ids  |
|                   |                 | copied to pinned memory, a full stream sync, the host's   |
|                   |                 | staging (methods.DiskOffloadStaging), a non-blocking copy |
|                   |                 | into fixed device buffers the step's graph decodes        |
| vllm-engram-      | eager breaks    | DeepSeek-V4.1's Engram `cpu_offload`: both layers' tables |
| pinned-uva        |                 | pinned; each layer's lookup starts in an eager break      |
|                   |                 | before the decoder layers, on one prefetch stream shared  |
|                   |                 | by the layers (a persistent grid on half the SMs, UVA),   |
|                   |                 | and is waited for in an eager break where consumed        |
| disk-prestage     | before the graph| Engram from NVMe staged before each step (the users'      |
|                   |                 | recipe, shared/spec/vllm.md): vllm-disk-offload's staging |
|                   |                 | for each layer's table                                    |

Both deliver the rows plestore's tiers do (the same packed file, decoded by the same kernel), so
the bench checks them against the resident table like the tiers. The same interface as
`PleLayerLookup` (`start`, `finish`, `close`, `table`, `heads`, `width`), plus `placement`:
"graph" (captured in the step's one graph), "before" (start runs on the host between the hash's
graph and the model's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plestore.bench.methods import DiskOffloadStaging, PinnedUva
from plestore.bench.uva_kernel import one_row_per_program_gather, persistent_grid_gather
from plestore.formats import get_format
from plestore.kernels.gather_decode import gather_decode
from plestore.spec import TableSpec
from plestore.tablefile import TableFile

__all__ = [
    "BASELINES",
    "ENGRAM_BASELINES",
    "VllmDiskOffload",
    "VllmEngramPinnedUva",
    "VllmPinnedUva",
    "open_baseline",
]


@dataclass
class TableFacts:
    """What the step needs of a baseline's table (a plestore Table's names)."""

    spec: TableSpec
    device: torch.device
    dtype: torch.dtype
    dim: int


class _Baseline:
    placement = "graph"
    captures = True

    def __init__(self, tf: TableFile, device: torch.device, heads: int, max_tokens: int):
        self.fmt = get_format(tf.spec.format)
        self.table = TableFacts(tf.spec, device, self.fmt.torch_dtype, tf.spec.dim)
        self.heads, self.width, self.tf = heads, heads * tf.spec.dim, tf
        n = max_tokens * heads
        self.buffer = torch.empty(n, tf.spec.dim, dtype=self.fmt.torch_dtype, device=device)
        self.iota = torch.arange(n, device=device)  # [n]: raw row i decodes to output row i
        self._ids: torch.Tensor | None = None

    def _decode(self, raw: torch.Tensor, tokens: int) -> torch.Tensor:
        """raw uint8 [tokens * heads, rb] on the device -> [tokens, heads * dim]."""
        n, t = tokens * self.heads, self.tf.spec
        out = self.buffer[:n]
        gather_decode(raw, self.iota[:n], 0, n, self.fmt, t.dim, t.scale, out)
        return out.view(tokens, self.width)


class VllmPinnedUva(_Baseline):
    """cpu_offload: the gather from pinned memory inside the graph, at the PLE layer."""

    name = "vllm-pinned-uva"

    def __init__(self, tf, device, heads, max_tokens):
        super().__init__(tf, device, heads, max_tokens)
        self.pinned = PinnedUva(tf, device)  # the whole table in pinned host memory

    def start(self, ids: torch.Tensor) -> None:
        self._ids = ids  # (its start_prefetch has nothing to start)

    def finish(self, tokens: int) -> torch.Tensor:
        raw = one_row_per_program_gather(self.pinned.rows, self._ids[:tokens].reshape(-1))
        return self._decode(raw, tokens)

    def close(self) -> None:
        self.pinned.close()


class VllmDiskOffload(_Baseline):
    """disk_offload: the host's staging between the hash and the step's graph, synchronous."""

    name = "vllm-disk-offload"
    placement = "before"
    captures = False

    def __init__(self, tf, device, heads, max_tokens):
        super().__init__(tf, device, heads, max_tokens)
        n, cuda = max_tokens * heads, device.type == "cuda"
        self.staging = DiskOffloadStaging(tf, n, pin=cuda)
        self.ids_host = torch.empty(n, dtype=torch.int64, pin_memory=cuda)
        # [n, rb]: the fixed device buffers the captured forward reads
        self.fixed = torch.empty(n, tf.layout.row_bytes, dtype=torch.uint8, device=device)
        self._tokens = 0

    def start(self, ids: torch.Tensor) -> None:
        """Host, before the step's graph: ids to the host, a full sync, the reads, the copy."""
        n = ids.numel()
        host = self.ids_host[:n]
        host.copy_(ids.reshape(-1), non_blocking=True)
        if ids.is_cuda:
            torch.cuda.current_stream().synchronize()
        rows = self.staging.stage(host.numpy())
        self.fixed[:n].copy_(rows, non_blocking=True)

    def finish(self, tokens: int) -> torch.Tensor:
        return self._decode(self.fixed[: tokens * self.heads], tokens)

    def close(self) -> None:
        self.staging.close()


class VllmEngramPinnedUva(VllmPinnedUva):
    """Engram's cpu_offload: start launches the gather on the layers' shared prefetch stream
    (after the work queued so far) and records an event; finish makes the step's stream wait
    for it. Both run between graphs, as vLLM's eager breaks."""

    name = "vllm-engram-pinned-uva"
    captures = False
    placement = "breaks"
    streams: dict[torch.device, torch.cuda.Stream] = {}  # one prefetch stream a device

    def __init__(self, tf, device, heads, max_tokens):
        super().__init__(tf, device, heads, max_tokens)
        cuda = device.type == "cuda"
        if cuda and device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        self.stream = self.streams.get(device)
        self.done = torch.cuda.Event() if cuda else None
        self._rows: torch.Tensor | None = None

    def start(self, ids: torch.Tensor) -> None:
        tokens = ids.shape[0]
        if self.stream is None:
            self._rows = self._gather(ids, tokens)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.table.device))
        with torch.cuda.stream(self.stream):
            self._rows = self._gather(ids, tokens)
        self.done.record(self.stream)

    def finish(self, tokens: int) -> torch.Tensor:
        if self.done is not None:
            torch.cuda.current_stream(self.table.device).wait_event(self.done)
        return self._rows[:tokens]

    def _gather(self, ids: torch.Tensor, tokens: int) -> torch.Tensor:
        raw = persistent_grid_gather(self.pinned.rows, ids.reshape(-1), background=True)
        return self._decode(raw, tokens)


class EngramDiskPrestage(VllmDiskOffload):
    """Engram rows staged from NVMe before each step (the users' recipe), a layer's table each."""

    name = "disk-prestage"


BASELINES = {c.name: c for c in (VllmPinnedUva, VllmDiskOffload)}
ENGRAM_BASELINES = {c.name: c for c in (VllmEngramPinnedUva, EngramDiskPrestage)}


def open_baseline(name: str, path: str, device: torch.device, max_tokens: int):
    """One of BASELINES or ENGRAM_BASELINES on the packed table at path (its .json or
    directory)."""
    tf = TableFile.open(path)
    return {**BASELINES, **ENGRAM_BASELINES}[name](tf, device, tf.spec.heads, max_tokens)
