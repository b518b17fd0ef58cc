"""How many cores other processes keep busy: the machine's CPU time (`/proc/stat`, Linux) against this process's own
(`os.times`), between two samples. `START` is taken when lookahead is imported, so a generation's first call can
tell, for free, whether other processes were busy while this one imported and loaded its model (the thread governor
then starts on half the threads). Elsewhere than Linux, or for a window too short or too long to mean the present, it
answers None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

MIN_WINDOW, MAX_WINDOW = 0.5, 120.0  # seconds between the samples for an answer


@dataclass(frozen=True)
class CpuSample:
    """Seconds: the wall clock, every CPU's non-idle time summed (`busy`), this process's CPU time (`own`)."""

    wall: float
    busy: float
    own: float


def sample() -> CpuSample | None:
    """The machine's and this process's CPU time now, or None where `/proc/stat` cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
        ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    if fields[0] != "cpu" or len(ticks) < 8:
        return None
    user, nice, system, _, _, irq, softirq, steal = ticks
    own = os.times()
    return CpuSample(time.monotonic(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
                     own.user + own.system)


def busy_elsewhere(since: CpuSample | None, now: CpuSample | None) -> float | None:
    """Cores other processes (and the hypervisor, as stolen time) kept busy on average between the samples, or None
    when either is missing or the window is outside [MIN_WINDOW, MAX_WINDOW] seconds."""
    if since is None or now is None or not MIN_WINDOW <= now.wall - since.wall <= MAX_WINDOW:
        return None
    return max(0.0, (now.busy - since.busy) - (now.own - since.own)) / (now.wall - since.wall)


START = sample()
