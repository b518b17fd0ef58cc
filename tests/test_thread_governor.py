"""`thread_governor`: fewer threads while steps show other processes holding the cores, all threads again after a
probe that wins; the caller's thread counts back after every generation; and outputs that do not depend on it.

The policy is driven by scripted step times and a fake clock (nothing here times the machine running it).
"""

from __future__ import annotations

import numba
import pytest
import torch
from tiny_models import build_tiny_model as tiny_model, repetitive_prompt

from lookahead import Lookahead, LookaheadConfig, cpu_load, hf, thread_governor
from lookahead.cost_curve import CURVE_SIZES, CostCurve
from lookahead.thread_governor import BUSY_CORES, FIRST_PROBE, SLOW, STREAK, ThreadGovernor, numba_threads

CURVE = CostCurve(CURVE_SIZES, (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.7, 2.0, 2.6, 3.2), 0.01)
FAST, BUSY, ONE = 0.01, 0.01 * SLOW * 3, 0.014  # seconds of a one-row step: free cores, busy cores, fewer threads


class Quiet(ThreadGovernor):
    """A governor that sees no other process busy before its first generation, and `others_recently` cores busy
    whenever its steps turn slow (by default one: the scripted slow steps are other processes' doing)."""

    others_recently: float | None = 1.0

    def busy_elsewhere(self) -> float:
        return 0.0

    def busy_recently(self) -> float | None:
        return self.others_recently


class Clock:
    """A settable clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def two_threads():
    """The test runs with two torch threads (whatever the machine has); the caller's counts come back after."""
    before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    numba.set_num_threads(numba_before)


def _threads() -> tuple[int, int]:
    return torch.get_num_threads(), numba.get_num_threads()


def test_busy_steps_move_to_one_thread_and_a_winning_probe_moves_back(two_threads):
    clock = Clock()
    governor = Quiet(clock)
    with governor.running(CURVE, enabled=True):
        for _ in range(STREAK - 1):
            governor.record(1, BUSY)
        governor.record(1, FAST)  # a fast step breaks the streak
        for _ in range(STREAK - 1):
            governor.record(1, BUSY)
        assert _threads() == (2, numba_threads(2)) and not governor.reduced_now
        assert governor.record(4, BUSY * CURVE.ratio(4))  # normalised by the curve: as slow as the one-row steps
        assert _threads() == (1, 1) and governor.reduced_now
        governor.record(1, ONE)
        assert _threads() == (1, 1)  # not yet time to probe
        clock.now += FIRST_PROBE
        governor.record(1, ONE)
        assert _threads() == (2, numba_threads(2)) and not governor.reduced_now  # the probe step
        assert governor.record(1, FAST)  # the probe beat the reduced steps
        assert _threads() == (2, numba_threads(2)) and not governor.reduced
    assert _threads() == (2, numba_threads(2))


def test_a_losing_probe_stays_on_one_thread_twice_as_long(two_threads):
    clock = Clock()
    governor = Quiet(clock)
    with governor.running(CURVE, enabled=True):
        for _ in range(STREAK):
            governor.record(1, BUSY)
        clock.now += FIRST_PROBE
        governor.record(1, ONE)
        assert not governor.record(1, BUSY)  # the probe lost: still busy, still on one thread
        assert _threads() == (1, 1) and governor.interval == 2 * FIRST_PROBE
        clock.now += FIRST_PROBE
        governor.record(1, ONE)
        assert _threads() == (1, 1)  # the next probe waits the doubled interval
        clock.now += FIRST_PROBE
        governor.record(1, ONE)
        assert governor.probing and _threads() == (2, numba_threads(2))
    assert _threads() == (2, numba_threads(2))  # the caller's count back, mid-probe or not


def test_the_state_carries_to_the_next_generation_and_the_caller_gets_its_threads_back(two_threads):
    governor = Quiet(Clock())
    with governor.running(CURVE, enabled=True):
        for _ in range(STREAK):
            governor.record(1, BUSY)
    assert _threads() == (2, numba_threads(2))
    with pytest.raises(RuntimeError), governor.running(CURVE, enabled=True):
        assert _threads() == (1, 1)  # the next generation starts on one thread
        raise RuntimeError("a failing generation")
    assert _threads() == (2, numba_threads(2))


@pytest.mark.parametrize("curve, enabled", [(None, True), (CURVE, False)])
def test_without_a_curve_or_disabled_the_count_never_changes(two_threads, curve, enabled):
    governor = Quiet(Clock())
    with governor.running(curve, enabled):
        for _ in range(3 * STREAK):
            governor.record(1, BUSY)
            assert _threads() == (2, numba_threads(2)) and not governor.reduced_now


def test_numba_follows_the_callers_torch_count():
    """A caller on one torch thread (`lookahead serve --threads 1`) gets numba's kernels on one thread too: numba's
    pool on two threads beside torch's one made a busy machine's run 10x slower."""
    before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadGovernor().running(None, enabled=False):
            assert _threads() == (1, 1)
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba_before)


class Flipping(ThreadGovernor):
    """Switches between one thread and all of them after every step; counts the forwards at each count."""

    def __init__(self):
        super().__init__()
        self.counts = set()

    def record(self, rows: int, seconds: float) -> bool:
        self.counts.add(torch.get_num_threads())
        if self.curve is None:
            return False
        self.reduced = not self.reduced
        thread_governor.set_threads(1 if self.reduced else self.full)
        return True  # the planner forgets its timed steps each time


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("sample", [False, True])
def test_outputs_do_not_depend_on_thread_switches(two_threads, monkeypatch, family, sample):
    model = tiny_model(family, dtype=torch.float64, seed=5)
    governor = Flipping()
    monkeypatch.setattr(hf, "governor_for", lambda m: governor)
    prompt = repetitive_prompt(3)
    kwargs = dict(max_new_tokens=40, do_sample=sample, **({"temperature": 0.8} if sample else {}))
    if sample:
        plain = model.generate(prompt, custom_generate=Lookahead(LookaheadConfig.off(), seed=7), **kwargs)
    else:
        plain = model.generate(prompt, **kwargs)
    decoder = Lookahead(seed=7) if sample else Lookahead()
    out = model.generate(prompt, custom_generate=decoder, **kwargs)
    assert torch.equal(plain, out)
    assert governor.counts == {1, 2} and decoder.last_stats.fewer_threads_steps > 0
    assert _threads() == (2, numba_threads(2))


@pytest.mark.parametrize("sample", [False, True])
def test_batch_outputs_do_not_depend_on_thread_switches(two_threads, monkeypatch, sample):
    """A batch is governed too (judged by its batch's cost curve); each row is plain batched `generate`'s."""
    from test_batch import padded_batch

    model = tiny_model("llama", dtype=torch.float64, seed=2)
    governor = Flipping()
    monkeypatch.setattr(hf, "governor_for", lambda m: governor)
    ids, mask = padded_batch()
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=30, do_sample=sample,
                  **({"temperature": 0.8} if sample else {}))
    if sample:
        plain = model.generate(ids, custom_generate=Lookahead(LookaheadConfig.off(), seed=7), **kwargs)
    else:
        plain = model.generate(ids, **kwargs)
    decoder = Lookahead(seed=7) if sample else Lookahead()
    assert torch.equal(plain, model.generate(ids, custom_generate=decoder, **kwargs))
    assert governor.counts == {1, 2} and governor.curve.batch == len(ids)
    assert 0 < decoder.last_stats.fewer_threads_steps < decoder.last_stats.steps
    assert _threads() == (2, numba_threads(2))


def test_each_batch_size_is_judged_by_its_own_unhindered_time(two_threads):
    """A batch's step costs more than one sequence's; after batch-1 generations it must not look held up."""
    governor, batch = Quiet(Clock()), CostCurve(CURVE.sizes, CURVE.ratios, 3 * CURVE.base_seconds, batch=8)
    with governor.running(CURVE, enabled=True):
        governor.record(1, FAST)
    with governor.running(batch, enabled=True):
        for _ in range(2 * STREAK):
            governor.record(1, 3 * FAST)  # its curve's one-row time: unhindered
        assert not governor.reduced_now and governor.expected == 3 * FAST
        for _ in range(STREAK):
            governor.record(1, 3 * FAST * SLOW * 1.5)  # held up at this size
        assert governor.reduced_now
    with governor.running(CURVE, enabled=True):
        assert governor.unhindered[1] == FAST


def test_the_planner_forgets_its_timed_steps_when_the_thread_count_changes():
    """After a switch the next planned step is a plain one again: the reference time at the new thread count."""
    from lookahead.budget import BatchPlanner

    planner = BatchPlanner(CURVE, None, 1, draws_follow_plan=False)
    planner.observed.record(1, 0.01)  # (conftest times the planner's own `record` by the curve)
    planner.observed.record(8, 0.03)
    assert planner.observed.has_plain and planner.observed.scale() != 1.0
    planner.forget_timings()
    assert not planner.observed.has_plain and planner.observed.scale() == 1.0 and planner.observed.curve is CURVE


@pytest.mark.parametrize("busy, starts_on_one", [(BUSY_CORES, True), (BUSY_CORES - 0.1, False), (None, False)])
def test_the_first_generation_starts_on_one_thread_when_others_kept_the_cores_busy(two_threads, busy, starts_on_one):
    """Cores other processes kept busy while lookahead loaded decide the first generation's count (set-up and prefill
    included); later generations follow their steps only."""

    class Seen(ThreadGovernor):
        def busy_elsewhere(self):
            return busy

    governor = Seen(Clock())
    with governor.running(CURVE, enabled=True):
        assert governor.reduced_now == starts_on_one
        assert _threads() == ((1, 1) if starts_on_one else (2, numba_threads(2)))
    busy = BUSY_CORES + 1  # no longer asked
    with governor.running(CURVE, enabled=True):
        assert governor.reduced_now == starts_on_one


@pytest.mark.parametrize("others, halves", [(0.0, False), (BUSY_CORES - 0.1, False), (BUSY_CORES, True), (None, True)])
def test_slow_steps_count_as_held_up_only_while_others_keep_cores_busy(two_threads, others, halves):
    """Steps slow for their own reasons (a long cache) on an idle machine keep all threads, however many; where the
    machine does not say (None), the step times alone decide."""
    governor = Quiet(Clock())
    governor.others_recently = others
    with governor.running(CURVE, enabled=True):
        for _ in range(3 * STREAK):
            governor.record(1, BUSY)
        assert governor.reduced_now == halves
        assert _threads() == ((1, 1) if halves else (2, numba_threads(2)))


def test_busy_recently_reads_the_newest_window_long_enough(monkeypatch):
    """The marks a governor keeps (at a generation's start, then every MARK_SECONDS of steps): the newest one at
    least MIN_WINDOW seconds old is the window's start, else the one before it, else lookahead's import."""
    samples = iter([cpu_load.CpuSample(100.0, 50.0, 1.0), cpu_load.CpuSample(100.2, 50.3, 1.2)])
    monkeypatch.setattr(cpu_load, "sample", lambda: next(samples))
    monkeypatch.setattr(cpu_load, "START", None)
    governor = ThreadGovernor(Clock())
    governor.marks = [cpu_load.CpuSample(97.0, 44.0, 0.5), cpu_load.CpuSample(99.9, 49.0, 0.9)]
    assert governor.busy_recently() == pytest.approx(((50.0 - 44.0) - (1.0 - 0.5)) / 3.0)  # 0.1 s: too short
    assert ThreadGovernor(Clock()).busy_recently() is None  # no mark, no import sample: nothing to tell
    monkeypatch.setattr(cpu_load, "sample", lambda: cpu_load.CpuSample(102.0, 51.0, 1.5))
    now = [101.0]
    monkeypatch.setattr(thread_governor.time, "monotonic", lambda: now[0])
    governor._mark()
    assert [mark.wall for mark in governor.marks] == [97.0, 99.9]  # the newest is not MARK_SECONDS old yet
    now[0] = 99.9 + thread_governor.MARK_SECONDS
    governor._mark()
    assert [mark.wall for mark in governor.marks] == [99.9, 102.0]  # a new mark; the two newest kept


def test_busy_elsewhere_counts_the_other_processes_cores():
    start = cpu_load.CpuSample(wall=10.0, busy=100.0, own=5.0)
    assert cpu_load.busy_elsewhere(start, cpu_load.CpuSample(12.0, 103.0, 6.0)) == pytest.approx(1.0)  # 3 - 1 own
    assert cpu_load.busy_elsewhere(start, cpu_load.CpuSample(12.0, 100.5, 6.0)) == 0.0  # own counted coarsely
    assert cpu_load.busy_elsewhere(start, cpu_load.CpuSample(10.1, 101.0, 5.0)) is None  # too short to tell
    assert cpu_load.busy_elsewhere(start, cpu_load.CpuSample(1e4, 1e4, 5.0)) is None  # too long ago
    assert cpu_load.busy_elsewhere(None, start) is None


@pytest.mark.skipif(cpu_load.sample() is None, reason="/proc/stat (Linux) is what cpu_load reads")
def test_busy_elsewhere_sees_a_spinning_process():
    import subprocess
    import sys
    import time

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter has started and spins
        start = cpu_load.sample()
        time.sleep(cpu_load.MIN_WINDOW + 0.2)
        assert cpu_load.busy_elsewhere(start, cpu_load.sample()) >= BUSY_CORES
    finally:
        spinner.kill()
        spinner.wait()


def test_many_threads_halve_while_the_steps_stay_held_up():
    """Four threads: busy steps halve the count to two, still-busy steps at two (over SLOW times the full-thread time
    scaled to two threads) to one; a step at two threads that is merely twice as slow as on four is not held up."""
    before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(4)
    try:
        governor = Quiet(Clock())
        with governor.running(CURVE, enabled=True):
            for _ in range(STREAK):
                governor.record(1, BUSY)
            assert governor.count == 2 and _threads() == (2, numba_threads(2))
            for _ in range(2 * STREAK):
                assert not governor.record(1, 2 * FAST)  # twice the four-thread time on half the threads: fine
            for _ in range(STREAK - 1):
                governor.record(1, 2 * BUSY)
            assert governor.record(1, 2 * BUSY) and governor.count == 1 and _threads() == (1, 1)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
        numba.set_num_threads(numba_before)


def test_a_caller_that_changes_its_count_starts_the_governor_over(two_threads):
    governor = Quiet(Clock())
    with governor.running(CURVE, enabled=True):
        for _ in range(STREAK):
            governor.record(1, BUSY)
        assert governor.reduced_now
    torch.set_num_threads(3)
    with governor.running(CURVE, enabled=True):
        assert not governor.reduced_now and torch.get_num_threads() == 3 and governor.expected == CURVE.base_seconds
