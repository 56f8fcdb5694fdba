"""PeakRSS sees a short-lived allocation in its window and forgets it in the next one; the tuned
allocator reuses freed blocks (counted in page faults) and hands them back on request."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil

from editkit.util.memory import PeakRSS

MB = 2**20


def test_window_peak_includes_a_freed_allocation_and_the_next_window_does_not():
    with PeakRSS(interval=0.01) as rss:
        rss.window()  # start a fresh window
        before = psutil.Process().memory_info().rss
        block = np.ones(300 * MB, dtype=np.uint8)  # touched, so resident
        time.sleep(0.1)  # several samples while it lives (the lifetime peak may already be higher)
        del block
        peak = rss.window()
        after = rss.window()
    assert peak >= before + 280 * MB
    assert after < peak - 200 * MB


REUSE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import psutil
    from editkit.util.memory import keep_freed_memory, release_freed_memory

    if sys.argv[1] == "tuned":
        assert keep_freed_memory()
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rss = lambda: psutil.Process().memory_info().rss
    block = np.ones(256 * 2**20, dtype=np.uint8)
    del block
    before = faults()
    block = np.ones(256 * 2**20, dtype=np.uint8)
    again = faults() - before
    del block
    kept = rss()
    release_freed_memory()
    print(again, (kept - rss()) // 2**20)
""")


def _second_allocation(mode: str) -> tuple[int, int]:
    """(page faults of a 256 MiB block allocated after an equal one was freed, MiB a trim then releases)."""
    out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True)
    faults, released = out.stdout.split()
    return int(faults), int(released)


def test_the_tuned_allocator_reuses_a_freed_block_and_a_trim_hands_it_back():
    huge_pages = 256 * MB // (2 * MB)  # the fewest faults a fresh 256 MiB mapping takes (transparent huge pages)
    faults, released = _second_allocation("stock")
    assert faults >= huge_pages  # stock glibc unmapped the first block when freed: it faults in again
    assert released < 16  # and had nothing left to trim
    faults, released = _second_allocation("tuned")
    assert faults < huge_pages // 4  # the freed block was reused as it was
    assert released >= 240  # kept resident after the second free, until the trim
