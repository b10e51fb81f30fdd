"""The ``shm`` backend: one file per pool under /dev/shm, fully reserved, mapped by everyone.

The file ``<shm_dir>/kvd-<instance>-<pool>`` (mode 0660) is reserved with
``posix_fallocate`` at creation, so no later touch can SIGBUS for lack of
tmpfs space, then prefaulted: tmpfs clears a fallocated page on its first
fault, and doing that once at start-up moves the slow first touch out of
the clients' way. Measured here for the default 256 MiB pool (see
``bench/``): fallocate ~20 ms; prefault with MADV_POPULATE_WRITE ~55 ms
(one madvise, ~4.6 GB/s), touching one byte per page from numpy ~82 ms;
a client's first full write then runs at ~3.6 GB/s instead of ~1.5 GB/s.
MADV_HUGEPAGE is offered but does nothing unless the tmpfs allows huge
pages (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``; ``never``
on this machine).

``multiprocessing.shared_memory`` is not used: on Python 3.11 a client
that exits unlinks the segment.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import time
from pathlib import Path
from typing import Any, Final

import numpy as np
from kvd_client.wire import PAGE, PoolLayout

from kvd.errors import PoolTooLargeError, StartupError
from kvd.memory.base import Capacity

__all__ = ["FILE_MODE", "ShmSegment", "capacity", "remove_stale", "segment_path"]

#: Mode of a pool file: the daemon's user and group read and write.
FILE_MODE: Final = 0o660
#: MADV_POPULATE_WRITE (Linux 5.14); Python 3.11's mmap module lacks the constant.
_MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def segment_path(shm_dir: str, instance: str, pool: str) -> Path:
    """Where pool ``pool`` of daemon instance ``instance`` lives."""
    return Path(shm_dir) / f"kvd-{instance}-{pool}"


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def capacity(shm_dir: str = "/dev/shm") -> Capacity:  # noqa: S108 (the tmpfs itself)
    """Bytes a new segment could take now: the lesser of tmpfs free space and MemAvailable."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        raise StartupError(f"cannot create pools in {shm_dir}: {exc.strerror}") from None
    free = st.f_bavail * st.f_frsize
    avail = _mem_available()
    if avail is not None and avail < free:
        return Capacity(avail, "MemAvailable (/proc/meminfo)")
    return Capacity(free, f"{shm_dir} (free space)")


def remove_stale(shm_dir: str, instance: str) -> list[str]:
    """Unlink every segment of ``instance`` (call only once no live daemon owns it)."""
    removed = []
    for path in sorted(Path(shm_dir).glob(f"kvd-{instance}-*")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(str(path))
    return removed


class ShmSegment:
    """A pool's bytes in a tmpfs file, reserved and mapped by the daemon.

    Create with `ShmSegment.create` (blocking: run it in a worker thread).
    """

    def __init__(self, layout: PoolLayout, path: Path, fd: int, mm: mmap.mmap) -> None:
        self._layout = layout
        self._path = path
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self.fallocate_s = 0.0
        self.prefault_s = 0.0
        self.prefault_method = "none"
        self.hugepages = False
        # A restarted daemon recreates the same path: the token tells clients
        # that a handle with an equal path is a new file to map again.
        self.token = secrets.token_hex(8)

    @classmethod
    def create(
        cls,
        name: str,
        layout: PoolLayout,
        *,
        instance: str,
        shm_dir: str = "/dev/shm",  # noqa: S108 (the tmpfs itself)
        prefault: bool = True,
        hugepages: bool = False,
    ) -> ShmSegment:
        """Create, reserve and map the segment; raises PoolTooLargeError or StartupError.

        Refuses before touching anything when the pool does not fit; a
        segment that exists already (a live daemon's, since stale ones are
        removed first) is never reused.
        """
        size = layout.total_bytes
        cap = capacity(shm_dir)
        if size > cap.bytes:
            raise PoolTooLargeError(f"pool {name!r}", size, cap.bytes, cap.where)
        path = segment_path(shm_dir, instance, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except FileExistsError:
            raise StartupError(f"pool {name!r}: {path} exists (another daemon's?)") from None
        except OSError as exc:
            raise StartupError(f"pool {name!r}: cannot create {path}: {exc.strerror}") from None
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have cleared group bits
            t0 = time.perf_counter()
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise PoolTooLargeError(
                        f"pool {name!r}", size, capacity(shm_dir).bytes, cap.where
                    ) from None
                raise StartupError(f"pool {name!r}: fallocate {path}: {exc.strerror}") from None
            fallocate_s = time.perf_counter() - t0
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        pool = cls(layout, path, fd, mm)
        pool.fallocate_s = fallocate_s
        if hugepages:
            mm.madvise(mmap.MADV_HUGEPAGE)
            pool.hugepages = True
        if prefault:
            pool._prefault()
        return pool

    def _prefault(self) -> None:
        assert self._mm is not None
        t0 = time.perf_counter()
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
            self.prefault_method = "populate_write"
        except OSError:  # kernel before 5.14: touch one byte per page
            np.frombuffer(self._mm, dtype=np.uint8)[::PAGE] = 0
            self.prefault_method = "touch"
        self.prefault_s = time.perf_counter() - t0

    @property
    def layout(self) -> PoolLayout:
        """The layout the segment was sized for."""
        return self._layout

    @property
    def size(self) -> int:
        """Bytes reserved."""
        return self._layout.total_bytes

    @property
    def path(self) -> Path:
        """The segment's file."""
        return self._path

    def buffer(self) -> memoryview:
        """The daemon's own mapping (for checks; clients map the file themselves)."""
        if self._mm is None:
            raise ValueError("pool memory is closed")
        return memoryview(self._mm)

    def handle(self) -> dict[str, Any]:
        """``{"backend": "shm", "path", "size", "offset": 0, "token"}`` for the hello reply.

        ``token`` is random per segment: equal handles mean the same file.
        """
        return {
            "backend": "shm",
            "path": str(self._path),
            "size": self.size,
            "offset": 0,
            "token": self.token,
        }

    def info(self) -> dict[str, Any]:
        """Path, size and start-up timings."""
        return {
            **self.handle(),
            "fallocate_ms": round(self.fallocate_s * 1e3, 3),
            "prefault_ms": round(self.prefault_s * 1e3, 3),
            "prefault_method": self.prefault_method,
            "hugepages": self.hugepages,
        }

    def close(self) -> None:
        """Unmap, close and unlink; clients that mapped the file keep their mapping."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        # A view still alive (someone holding buffer()) keeps the mapping until
        # it goes; the file is unlinked regardless.
        with contextlib.suppress(BufferError):
            mm.close()
        os.close(self._fd)
        self._path.unlink(missing_ok=True)
