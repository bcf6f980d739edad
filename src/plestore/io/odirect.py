"""O_DIRECT, probed: the read alignment a file takes, and the block size a new table should have
in a directory. Kept apart from io/probe.py (which imports torch) so that `plestore pack` stays
light."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

__all__ = ["FALLBACK_BLOCK_BYTES", "directory_block_bytes", "o_direct_alignment"]

#: where O_DIRECT does not work (tmpfs, some network filesystems) reads go through the page
#: cache a 4 KiB page at a time, so smaller blocks would only waste disk space
FALLBACK_BLOCK_BYTES = 4096


def o_direct_alignment(path: str | os.PathLike, offset: int = 0) -> int:
    """Smallest read size/alignment O_DIRECT accepts for this file (512 or 4096).

    Raises OSError naming the path when the filesystem does not support O_DIRECT at all (e.g.
    tmpfs), so callers can say "use tier='mapped' or 'pinned' instead".
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise OSError(
                errno.EINVAL, f"{path}: this filesystem does not support O_DIRECT"
            ) from None
        raise
    buf = mmap.mmap(-1, 8192)
    try:
        size = os.fstat(fd).st_size
        for align in (512, 4096):
            off = max(0, min(offset // align * align, (size // align - 1) * align))
            try:
                os.preadv(fd, [memoryview(buf)[:align]], off)
                return align
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        raise OSError(errno.EINVAL, f"{path}: O_DIRECT reads fail at 512 and 4096 alignment")
    finally:
        os.close(fd)
        buf.close()


def directory_block_bytes(directory: str | os.PathLike) -> tuple[int, str]:
    """(block bytes, why) for a new table in `directory`: the smallest O_DIRECT read its disk
    takes (512 B on most disks: a cold row costs one 512-B read instead of a 4 KiB one), else
    FALLBACK_BLOCK_BYTES."""
    # measured: RESULTS.md "footprint" (disk a decode token, direct: 8.00 KiB vs 64.0 KiB)
    directory = Path(directory)
    probe = directory / f".plestore-probe-{os.getpid()}"
    try:
        probe.write_bytes(bytes(8192))
        align = o_direct_alignment(probe)
    except OSError as e:
        return FALLBACK_BLOCK_BYTES, f"{directory} takes no O_DIRECT reads ({e.strerror or e})"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return align, f"the smallest O_DIRECT read of the disk under {directory}"
