"""Peak resident memory of this process, over windows of time (cost tables and benchmarks)."""

from __future__ import annotations

import os
import resource
import threading


def _maxrss_bytes() -> int:
    """The process's lifetime peak RSS (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if os.uname().sysname == "Darwin" else peak * 1024)


class PeakRSS:
    """Peak resident memory of this process over windows of time.

    A background thread samples RSS (psutil) every ``interval`` seconds; when the
    lifetime peak (``getrusage``) rises during a window, that exact value is used.
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
        with self._lock:
            self._window_peak = self._rss()
            self._window_maxrss = _maxrss_bytes()

    def window(self) -> int:
        """Peak RSS (bytes) since the previous call (or entry); starts a new window."""
        maxrss = _maxrss_bytes()
        with self._lock:
            peak = max(self._window_peak, self._rss())
            if maxrss > self._window_maxrss:
                peak = max(peak, maxrss)
        self._reset()
        return int(peak)
