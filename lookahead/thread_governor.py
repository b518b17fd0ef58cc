"""Threads on a busy machine: fewer threads while other processes hold the cores, all of them again once they leave.

With as many threads as cores, every parallel region of a step (PyTorch's and oneDNN's GEMMs, the numba kernels)
ends at a barrier that waits for its slowest thread; when another process takes a core, the thread descheduled
there holds every barrier up for a scheduler slice. Measured on a 2-core Intel Xeon (AVX-512, AMX; session 50) with
one busy-looping process beside the run: plain HF greedy, 32 tokens, 1.2 s idle → 22 s on 2 threads, 1.85 s on one;
lookahead, 64 tokens, 0.42 s idle → 4.3–6.0 s on 2 threads, 6.7 s with torch on one thread but numba on two,
0.61 s with both on one.

`ThreadGovernor` (one per model, `governor_for`) watches each step's forward time, normalised by the cost curve's ratio
for its row count (a batch's by its batch size's curve, each batch size with its own unhindered time). After `STREAK`
steps in a row slower than `SLOW` times the expected time (the curve's one-row time, or the fastest normalised step it
saw) while the machine's CPU accounting says other processes kept `BUSY_CORES` cores busy meanwhile (`cpu_load`; where
it says nothing, the step times alone decide), it halves torch's and numba's thread count (on two cores: one thread),
and halves it again while the steps stay that slow at the new count; from then on, every `FIRST_PROBE` seconds
(doubling after each probe that loses, up to `LAST_PROBE`) one step runs on all threads again, and the governor stays
there when that step was clearly faster than the reduced steps. (Step times alone misread a long cache: a one-row step
over 3000 cached tokens takes ~2.5x one over 20 on an idle machine, and the halved threads then slowed the next
prefill ~1.7x; session 57.) A model's first generation starts halved when other processes kept `BUSY_CORES` cores
busy while this one imported lookahead and loaded its model (`cpu_load.py`), so that the set-up and the prefill are
spared too. Outputs do not depend on it: the tokens are the rule's, whatever the thread count (tested by scripting
the switches). Measured on 2 cores only: halving rather than dropping to one thread is for machines with many cores,
where one busy process takes one core of many.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator

import numba
import torch

from . import cpu_load
from .cost_curve import CostCurve

SLOW = 2.0  # a full-thread step this many times its expected time counts as held up by other processes
STREAK = 3  # ... and this many such steps in a row halve the thread count
FIRST_PROBE, LAST_PROBE = 1.0, 16.0  # seconds on fewer threads before all threads are tried again (doubling)
WIN = 0.9  # a probe on all threads wins when its time is below this fraction of the reduced steps' time
BUSY_CORES = 0.5  # cores other processes kept busy before the first generation that make it start halved, and
# during slow steps that make them count as held up
MARK_SECONDS = 2.0  # how old the newest sample of the machine's CPU time gets before another is taken
_governors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def numba_threads(torch_threads: int) -> int:
    """The numba thread count that goes with `torch_threads` torch threads (numba's pool is no larger than
    `NUMBA_NUM_THREADS`)."""
    return max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))


def set_threads(count: int) -> None:
    """Run torch and this thread's numba kernels on `count` threads."""
    torch.set_num_threads(count)
    numba.set_num_threads(numba_threads(count))


class ThreadGovernor:
    """The thread count of one model's generations (see the module docstring); `clock` gives seconds."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.full = 1  # the caller's torch thread count in the running generation
        self.count = 1  # the count of the steps while reduced
        self.reduced = False  # on fewer threads because other processes held the cores
        self.probing = False  # the running step is a probe on all threads
        self.unhindered: dict[int, float] = {}  # per batch size: seconds of an unhindered full-thread step per unit
        # of its curve's ratio
        self.reduced_time: float | None = None  # running normalised time of the steps on `count` threads
        self.streak, self.interval, self.since = 0, FIRST_PROBE, 0.0
        self.curve: CostCurve | None = None
        self.marks: list[cpu_load.CpuSample] = []  # `_mark`'s samples of the machine's CPU time, oldest first

    @contextlib.contextmanager
    def running(self, curve: CostCurve | None, enabled: bool) -> Iterator[ThreadGovernor]:
        """Within the block a generation runs on the governed thread count (numba following torch); `record` its
        steps. `enabled` False or no `curve`: the caller's count throughout. After it, the caller's torch count and
        this thread's numba count are back."""
        full, numba_before = torch.get_num_threads(), numba.get_num_threads()
        if full != self.full:  # the caller changed its count: start over from it
            self.full, self.reduced, self.count, self.unhindered = full, False, full, {}
        self.curve = curve if enabled and full > 1 else None
        if self.curve is not None and curve.batch not in self.unhindered:  # the first generation of this batch size
            first = not self.unhindered
            self.unhindered[curve.batch] = curve.base_seconds
            if first and (self.busy_elsewhere() or 0.0) >= BUSY_CORES:
                self._reduce()
        self.probing = False
        if self.curve is not None:
            self._mark()  # a window over the prefill for `busy_recently`
        set_threads(self.count if self.curve is not None and self.reduced else full)
        try:
            yield self
        finally:
            torch.set_num_threads(full)
            numba.set_num_threads(numba_before)

    def busy_elsewhere(self) -> float | None:
        """Cores other processes kept busy since lookahead was imported (`cpu_load.busy_elsewhere`)."""
        return cpu_load.busy_elsewhere(cpu_load.START, cpu_load.sample())

    @property
    def expected(self) -> float:
        """Seconds of an unhindered full-thread step per unit of curve ratio at the running generation's batch size
        (its curve's one-row time, or the fastest normalised step seen at that size)."""
        return self.unhindered[self.curve.batch]

    @expected.setter
    def expected(self, seconds: float) -> None:
        self.unhindered[self.curve.batch] = seconds

    @property
    def reduced_now(self) -> bool:
        """Whether the next step runs on fewer threads than the caller's."""
        return self.curve is not None and self.reduced and not self.probing

    def record(self, rows: int, seconds: float) -> bool:
        """Add one step's forward of `rows` rows that took `seconds`, and set the next step's thread count. Returns
        whether the steps move to another count (a probe's single step aside): step times from before no longer say
        what a step costs."""
        if self.curve is None:
            return False
        self._mark()
        normalised, before = seconds / max(self.curve.ratio(rows), 1e-9), (self.reduced, self.count)
        if self.probing:
            self._after_probe(normalised)
        elif self.reduced:
            self._reduced_step(normalised)
        elif self._slow(normalised, self.full):
            self._reduce()
        return (self.reduced, self.count) != before

    def _slow(self, normalised: float, threads: int) -> bool:
        """Whether `STREAK` steps in a row on `threads` threads were held up: over `SLOW` times the unhindered
        full-thread time, scaled to `threads` threads as if the work split evenly, while other processes kept at
        least `BUSY_CORES` cores busy (`busy_recently`; where that is unknown, the step times alone decide). Steps
        slow for their own reasons (a long cache's attention: a one-row step over 3000 cached tokens takes ~2.5x
        one over 20) on an otherwise idle machine start the streak over. An unhindered full-thread step lowers the
        unhindered time."""
        if normalised <= SLOW * self.expected * self.full / threads:
            self.streak = 0
            if threads == self.full:
                self.expected = min(self.expected, normalised)
            return False
        self.streak += 1
        if self.streak < STREAK:
            return False
        busy = self.busy_recently()
        if busy is not None and busy < BUSY_CORES:
            self.streak = 0
            return False
        return True

    def busy_recently(self) -> float | None:
        """Cores other processes (and the hypervisor) kept busy since the newest of the governor's marks that is at
        least `cpu_load.MIN_WINDOW` seconds old (`_mark`: at a generation's start and every `MARK_SECONDS` of
        steps), else since lookahead was imported; None where the machine does not say or no such window is at
        hand."""
        now = cpu_load.sample()
        for since in [*reversed(self.marks), cpu_load.START]:  # the newest first: the most recent window
            busy = cpu_load.busy_elsewhere(since, now)
            if busy is not None:
                return busy
        return None

    def _mark(self) -> None:
        """Keep a sample of the machine's CPU time at most `MARK_SECONDS` old (and the one before it), so that
        `busy_recently` has a recent window of a few seconds whenever steps turn slow (a sample reads /proc/stat:
        ~20 µs, once every MARK_SECONDS at most)."""
        wall = time.monotonic()
        if self.marks and wall - self.marks[-1].wall < MARK_SECONDS:
            return
        sample = cpu_load.sample()
        if sample is not None:
            self.marks = (self.marks + [sample])[-2:]

    def _reduced_step(self, normalised: float) -> None:
        """A step on `count` threads: halve again if still held up, else time it and probe all threads when due."""
        if self.count > 1 and self._slow(normalised, self.count):
            self._reduce()
            return
        previous = self.reduced_time
        self.reduced_time = normalised if previous is None else 0.7 * previous + 0.3 * normalised
        if self.clock() - self.since >= self.interval:
            self.probing = True
            set_threads(self.full)

    def _reduce(self) -> None:
        """Halve the thread count (all threads → half of them → ... → one); the next probe comes after
        `FIRST_PROBE` seconds."""
        self.count = max(1, (self.count if self.reduced else self.full) // 2)
        self.reduced, self.streak, self.reduced_time = True, 0, None
        self.interval, self.since = FIRST_PROBE, self.clock()
        set_threads(self.count)

    def _after_probe(self, normalised: float) -> None:
        """The probe's verdict: all threads again when it beat the reduced steps, else the reduced count for
        longer."""
        self.probing = False
        if self.reduced_time is not None and normalised < WIN * self.reduced_time:
            self.reduced, self.count, self.expected, self.interval = False, self.full, normalised, FIRST_PROBE
            self.streak = 0
            return
        self.interval, self.since = min(2 * self.interval, LAST_PROBE), self.clock()
        set_threads(self.count)


def governor_for(model) -> ThreadGovernor:
    """The model's `ThreadGovernor` (made on first use; it lives as long as the model)."""
    with _lock:
        governor = _governors.get(model)
        if governor is None:
            governor = _governors[model] = ThreadGovernor()
        return governor
