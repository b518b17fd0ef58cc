"""`DecodeStats`: what one generate call did (steps, tokens per step, acceptance per drafter, time split)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AcceptedDrafts:
    """What one sequence's drafts did in one step: the drafter of each accepted draft token (in path order) and
    the tokens the planner predicted the step would commit (`budget.expected_tokens`; None: no prediction)."""

    sources: list[str]
    expected_tokens: float | None = None


@dataclass
class DecodeStats:
    """Per-call statistics, exposed as `Lookahead.last_stats` after a call.

    Times are wall-clock seconds: `setup_time` (layouts of the weights built before the prefill: a process's first
    generation with a model, `hf.build_layouts`), `prefill_time` (prompt forward), `draft_time` (drafting, trie,
    layout), `forward_time` (verification forwards), `verify_time` (verification, cache compaction, drafter
    updates); `total_time` is the whole call's, set-up included.
    `new_tokens` counts the prefill's first token too; `step_tokens` only what decoding steps committed.
    `tokens_per_step` maps tokens committed in a step to how many steps committed that many. `calibration` holds
    one (predicted, committed) pair of tokens per step in which the planner made a prediction; `step_rows` the rows
    each step verified; `fewer_threads_steps` the steps run on fewer threads than the caller's while other processes
    held the cores (`thread_governor.py`).
    """

    steps: int = 0
    new_tokens: int = 0
    step_tokens: int = 0
    setup_time: float = 0.0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    forward_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    tokens_per_step: Counter = field(default_factory=Counter)
    accepted_by_drafter: Counter = field(default_factory=Counter)
    calibration: list = field(default_factory=list)  # [(predicted tokens, committed tokens)] per step
    step_rows: list = field(default_factory=list)  # rows verified (per sequence) by each step, in order
    fewer_threads_steps: int = 0

    def record_step(self, n_tokens: int, n_rows: int, accepted: AcceptedDrafts) -> None:
        """Add one decoding step that committed `n_tokens` after verifying `n_rows` rows."""
        self.steps += 1
        self.new_tokens += n_tokens
        self.step_tokens += n_tokens
        self.step_rows.append(n_rows)
        self.tokens_per_step[n_tokens] += 1
        self.accepted_by_drafter.update(accepted.sources)
        if accepted.expected_tokens is not None:
            self.calibration.append((round(accepted.expected_tokens, 4), n_tokens))

    @property
    def rows_verified(self) -> int:
        """Rows verified over all steps (per sequence)."""
        return sum(self.step_rows)

    @property
    def mean_expected_tokens(self) -> float:
        """The planner's mean predicted tokens per step (over the steps it predicted; 0.0 when none)."""
        return sum(e for e, _ in self.calibration) / len(self.calibration) if self.calibration else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens committed per decoding step (the prefill's first token excluded)."""
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of the whole call (prefill included)."""
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens the decoding steps committed per second after the set-up and the prefill (0.0 without steps): the
        speed once the first token is out, which a long prompt's prefill does not dilute."""
        decoding = self.total_time - self.setup_time - self.prefill_time
        return self.step_tokens / decoding if self.steps and decoding > 0 else 0.0

    def summary(self) -> str:
        """One line for humans: tokens, tokens/s (whole call and after the prefill), tokens per step, time split,
        accepted per drafter."""
        drafters = ", ".join(f"{k}={v}" for k, v in sorted(self.accepted_by_drafter.items())) or "none"
        return (f"{_count(self.new_tokens, 'token')} in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tok/s; "
                f"{self.decode_tokens_per_second:.1f} tok/s after the prefill), "
                f"{_count(self.steps, 'step')}, {self.mean_tokens_per_step:.2f} tokens/step; time: "
                f"{self._setup()}prefill {self.prefill_time:.2f} s, drafting {self.draft_time:.2f} s, "
                f"forward {self.forward_time:.2f} s, verify {self.verify_time:.2f} s; accepted drafts: {drafters}"
                f"{self._fewer_threads()}")

    def _fewer_threads(self) -> str:
        """The summary's thread part: shown when steps ran on fewer threads because the cores were busy."""
        if not self.fewer_threads_steps:
            return ""
        return f"; {self.fewer_threads_steps} of {self.steps} steps on fewer threads (other processes held the cores)"

    def _setup(self) -> str:
        """The summary's set-up part: shown when this call built layouts (a process's first generation)."""
        return f"set-up {self.setup_time:.2f} s (once per process), " if self.setup_time >= 0.005 else ""

    def as_dict(self) -> dict:
        """JSON-ready dict of all fields and derived rates."""
        return {
            "steps": self.steps, "new_tokens": self.new_tokens, "step_tokens": self.step_tokens,
            "rows_verified": self.rows_verified,
            "setup_time": self.setup_time, "prefill_time": self.prefill_time, "draft_time": self.draft_time,
            "forward_time": self.forward_time,
            "verify_time": self.verify_time, "total_time": self.total_time,
            "mean_tokens_per_step": self.mean_tokens_per_step, "tokens_per_second": self.tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "tokens_per_step": dict(sorted(self.tokens_per_step.items())),
            "accepted_by_drafter": dict(self.accepted_by_drafter),
            "mean_expected_tokens": self.mean_expected_tokens, "calibration": [list(p) for p in self.calibration],
            "step_rows": list(self.step_rows), "fewer_threads_steps": self.fewer_threads_steps,
        }


def _count(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is 1 ("1 token", "3 tokens")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
