"""The host core's numpy reference: every function of the compiled core (`plestore.native._core`)
with its arguments and results, written plainly. Tests compare the two; it serves, announced,
where the core is not built (or `native="off"`).

| call | what | reference of |
|---|---|---|
| `check_ids` | the first id outside a table's rows | ids.c |
| `gather`, `gather_start` | rows at the layout's offsets into staging (or a job) | gather.c |
| `check_file` | the mapped file's fstat against what was seen | filecheck.c |
| `willneed` | WILLNEED on a lookup's pages, unless a sample is resident | willneed.c |
| `crc32_blocks` | zlib's CRC-32 of many blocks | crc.c |
| `recode_nvfp4` | NVFP4 rows through a symbol table, the symbols counted | recode.c |
| `cache_locate`, `cache_admit` | the GPU cache directory's probe, admission | gpudirectory.c |
| `feed_serve` | a graph feed's host side: wait, its host step, READY | feedserve.c |
| `feed_wake` | a feed's host side woken from its sleep (a step is coming) | feedserve.c |
| `publish` | a feed's header word written after the rows (release) | feedserve.c |
| `clear_if` | a feed's error word cleared where it still holds what was read | feedserve.c |
| `host_step` | one host step: ids, this rank's, the GPU cache's probe, the reads | hoststep.c |
| `Mutex` | a lock (the compiled one is taken without the GIL too) | module.c |
| `DirectCore` | the direct tier's read: host row cache, block reads, checks, admission | direct.c |
"""

from threading import Lock as Mutex

from plestore.native.reference.direct import DirectCore
from plestore.native.reference.feedserve import clear_if, feed_serve, feed_wake, publish
from plestore.native.reference.files import check_file, crc32_blocks, willneed
from plestore.native.reference.gather import check_ids, gather, gather_start
from plestore.native.reference.gpudirectory import cache_admit, cache_locate
from plestore.native.reference.hoststep import host_step
from plestore.native.reference.recode import recode_nvfp4

__all__ = [
    "DirectCore",
    "Mutex",
    "cache_admit",
    "cache_locate",
    "check_file",
    "clear_if",
    "check_ids",
    "crc32_blocks",
    "feed_serve",
    "feed_wake",
    "gather",
    "gather_start",
    "host_step",
    "publish",
    "recode_nvfp4",
    "willneed",
]
