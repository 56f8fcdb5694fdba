"""This process's memory: peak resident memory over windows of time (cost tables and benchmarks),
and glibc's allocator kept from handing large freed blocks back to the kernel."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import resource
import threading

#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: Free memory at the top of the heap kept for reuse instead of trimmed (bytes).
_KEEP_FREED = 1 << 30


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (whose allocator the functions below tune), else None."""
    if "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory for large tensors instead of mapping fresh pages each time.

    glibc serves every allocation over 32 MiB (a batch of language-model logits is ~100 MiB)
    with its own ``mmap`` and unmaps it when freed, so the next batch faults in and zeroes
    the same amount again: on a CPU that cost a fifth of a language-model step as kernel
    time. With mmap-served blocks turned off and trimming raised, freed blocks stay in the
    heap and are reused; :func:`release_freed_memory` hands them back when a phase ends.
    Returns whether the allocator was tuned (False where the C library is not glibc).
    """
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED))


def release_freed_memory() -> None:
    """Return the heap's free memory to the kernel (glibc's ``malloc_trim``), so resident memory
    measured next is what is in use, not what an earlier phase left for reuse."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def lifetime_peak_rss() -> int:
    """The process's lifetime peak RSS (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if os.uname().sysname == "Darwin" else peak * 1024)


class PeakRSS:
    """Peak resident memory of this process over windows of time.

    A background thread samples RSS (psutil) every ``interval`` seconds; when the
    lifetime peak (``getrusage``) rises during a window, that exact value is used. Each
    window starts by handing the heap's freed memory back (:func:`release_freed_memory`):
    with :func:`keep_freed_memory` in effect, an earlier window's freed tensors would
    otherwise stay resident and count against the next one.
    """

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._process = psutil.Process()
        self.interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._window_peak = 0
        self._window_maxrss = 0

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self._rss()
            with self._lock:
                self._window_peak = max(self._window_peak, rss)

    def __enter__(self) -> "PeakRSS":
        self._reset()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _reset(self) -> None:
        release_freed_memory()
        with self._lock:
            self._window_peak = self._rss()
            self._window_maxrss = lifetime_peak_rss()

    def window(self) -> int:
        """Peak RSS (bytes) since the previous call (or entry); starts a new window."""
        maxrss = lifetime_peak_rss()
        with self._lock:
            peak = max(self._window_peak, self._rss())
            if maxrss > self._window_maxrss:
                peak = max(peak, maxrss)
        self._reset()
        return int(peak)


def nbytes(value: object) -> int:
    """Bytes a value holds as data: a tensor's or array's elements, a string's UTF-8, the sum over a mapping's
    values, a sequence's items or a dataclass's fields, 8 for a number. What a method keeps of earlier tasks is
    counted with it, the same way whichever method keeps it (an example, a buffer, a model copy)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):  # torch.Tensor, without importing torch here
        return int(value.numel() * value.element_size())
    if hasattr(value, "nbytes"):  # numpy arrays
        return int(value.nbytes)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, (int, float, bool)):
        return 8
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a batch of texts: ids and mask
        return sum(nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    raise TypeError(f"cannot count the bytes of a {type(value).__name__}")
