"""Resting the drafters: plain steps without drafting where speculation does not pay for its fixed cost.

A speculative step pays for more than its rows: drafting, merging and ranking the trie, the mask, the walk and the
drafters' updates cost ~2 ms of Python a step on the default model on a 2-core CPU (~15% of a ~12 ms one-row step),
whatever the planner then verifies. The planner weighs rows on the cost curve; this fixed cost it cannot avoid once
it has drafted. On text where drafts rarely land (free chat: ~1.14 tokens a step) speculation then runs slower than
plain decoding (0.91x of lookahead's own mode off on the suite's chat prompts).

`DraftRest` compares, for one generation, speculation's measured throughput — tokens committed over the wall time
of its recent steps, decayed — with a plain step's: one token per the generation's own timed one-row forward plus
the measured cost around it (a step that drafts nothing still verifies, commits and feeds the drafters). When a
plain step is clearly faster (`REST_MARGIN`), the drafters rest for a period of plain steps, then speculation is
probed again for a few steps; each time resting wins again its period doubles (up to `MAX_REST`), each time
speculation wins the period starts over. Resting changes only which rows a step verifies, never the rule that
picks the tokens, so output is unchanged. It follows timings, so it is off wherever the plan must not (a fixed
curve, draws that follow the plan) and for batches; timings pass through `leader_value`, so every rank of a
tensor-parallel generation decides alike.

Opt-in (`LookaheadConfig(rest_drafters=True)`): measured on the AVX2 machine (2 prompts each of chat, code,
summarization and rag, 96 tokens, medians of 2, lookahead and its mode off interleaved), chat went from 0.96x to
0.94–1.05x of mode off in two runs while code lost tokens per step in one of them (1.68 → 1.48–1.53): within this
machine's run-to-run spread, so not on by default.
"""

from __future__ import annotations

from .distributed import leader_value

REST_MARGIN = 1.05  # rest only when a plain step's throughput beats speculation's by this factor
DECAY = 0.9  # weight of earlier speculative steps in the measured throughput (a memory of ~10 steps)
MIN_SPECULATIVE = 12  # speculative steps timed before the first comparison
PROBE_STEPS = 4  # speculative steps of a probe after a rest
FIRST_REST = 8  # plain steps of a first rest; doubles while resting keeps winning
MAX_REST = 64
PLAIN_OVERHEAD_PRIOR = 0.05  # a plain step's cost beyond its forward, as a share of it, until one is timed


class DraftRest:
    """Whether a generation's next step drafts (see the module docstring); `enabled=False` never rests."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tokens = self.seconds = 0.0  # decayed sums over the speculative steps since the last rest
        self.speculative = 0  # speculative steps since the last rest
        self.plain_overhead: float | None = None  # a plain step's time over its forward's, running
        self.rest_left = 0  # plain steps still to take
        self.period = FIRST_REST
        self.probing = False  # the speculative steps since the last rest are a probe

    def rests(self) -> bool:
        """Whether the next step is a plain step without drafting."""
        return self.rest_left > 0

    def record(self, drafted: bool, tokens: int, seconds: float, forward_seconds: float,
               plain_forward: float | None) -> None:
        """Add one step: whether it drafted, the tokens it committed, its wall time and its forward's time in
        seconds; `plain_forward` the generation's running time of a one-row forward (None until one was timed)."""
        if not self.enabled:
            return
        seconds, forward_seconds = leader_value(float(seconds)), leader_value(float(forward_seconds))
        if not drafted:
            self._record_plain(seconds / max(forward_seconds, 1e-9))
            return
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.speculative += 1
        if plain_forward is not None and self.speculative >= (PROBE_STEPS if self.probing else MIN_SPECULATIVE):
            self._decide(plain_forward)

    def _record_plain(self, overhead: float) -> None:
        """A plain step of the current rest taken, costing `overhead` times its forward."""
        old = self.plain_overhead
        self.plain_overhead = overhead if old is None else 0.7 * old + 0.3 * overhead
        self.rest_left -= 1
        if self.rest_left == 0:  # probe speculation afresh
            self.tokens = self.seconds = 0.0
            self.speculative, self.probing = 0, True

    def _decide(self, plain_forward: float) -> None:
        """Rest when a plain step (`plain_forward` seconds of forward, times the overhead seen) is clearly faster."""
        overhead = self.plain_overhead if self.plain_overhead is not None else 1.0 + PLAIN_OVERHEAD_PRIOR
        plain_rate = 1.0 / (plain_forward * overhead)
        speculative_rate = self.tokens / max(self.seconds, 1e-12)
        if plain_rate > speculative_rate * REST_MARGIN:
            if self.probing:
                self.period = min(2 * self.period, MAX_REST)
            self.rest_left = self.period
        elif self.probing:
            self.period = FIRST_REST
        self.probing = False
