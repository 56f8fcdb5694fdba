"""PeakRSS sees a short-lived allocation in its window and forgets it in the next one."""

from __future__ import annotations

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
