"""Planning policy: how many rows to verify per step, from the cost curve and running acceptance rates.

Each step the policy keeps the draft-tree nodes and window rows that maximise expected committed tokens per
unit of cost (`cost_curve.CostCurve`), using running acceptance rates per drafter.
"""

from __future__ import annotations

import numpy as np

from .cost_curve import CostCurve

PROBE_EVERY = 16  # a resting draft model still drafts one token this often


class AcceptanceRates:
    """Running per-drafter probability that a drafted token is accepted given its parent was.

    Counts decay by `decay` each step so the rates follow the text (grounded passages vs free chat).
    """

    def __init__(self, n_sources: int, prior: float = 0.3, decay: float = 0.9):
        self.accepted = np.full(n_sources, prior * 2.0)
        self.tested = np.full(n_sources, 2.0)
        self.decay = decay

    def rates(self) -> np.ndarray:
        """[n_sources] current acceptance estimates in (0, 1)."""
        return np.clip(self.accepted / self.tested, 0.01, 0.99)

    def update(self, tested: np.ndarray, accepted: np.ndarray) -> None:
        """Add one step's per-source counts of tested and accepted draft tokens."""
        self.accepted = self.accepted * self.decay + accepted
        self.tested = self.tested * self.decay + tested


def best_row_count(scores: np.ndarray, window_rows: int, window_value: float, curve: CostCurve) -> tuple[int, bool]:
    """Choose how many tree nodes to keep and whether to run the window this step.

    scores: [n] estimated acceptance probabilities of the candidate nodes in the tree's pruning order (its
    first k nodes always form a valid tree). window_value: expected extra tokens per step the window brings.
    Maximises (1 + sum(top-k scores) + window value) / ratio(1 + k + window rows).
    Returns (k, use_window); (0, False) means a plain single-row step.
    """
    gain = np.concatenate([[1.0], 1.0 + np.cumsum(scores)])  # [n+1] expected tokens with k = 0..n
    best = (1.0, 0, False)  # (tokens per unit cost, k, window)
    for use_window in ((False, True) if window_rows else (False,)):
        extra = window_rows if use_window else 0
        bonus = window_value if use_window else 0.0
        for k in range(len(gain)):
            rows = 1 + k + extra
            if rows == 1:
                continue
            value = (gain[k] + bonus) / curve.ratio(rows)
            if value > best[0] * 1.02:  # prefer the cheaper option unless clearly better
                best = (value, k, use_window)
    return best[1], best[2]


def best_chain_length(rate: float, max_len: int, draft_cost: float, curve: CostCurve) -> int:
    """Draft-model chain length n in [0, max_len] maximising expected committed tokens per unit cost,
    (1 + rate + ... + rate**n) / (ratio(1 + n) + n * draft_cost), where `draft_cost` is the time of one draft
    token over one target decode step. 0 = do not run the draft model this step."""
    best_value, best_n = 1.0, 0
    for n in range(1, max_len + 1):
        value = sum(rate**i for i in range(n + 1)) / (curve.ratio(1 + n) + n * draft_cost)
        if value > best_value * 1.02:
            best_value, best_n = value, n
    return best_n


class StepPlanner:
    """Per-step choice of tree size and window use from the cost curve and running acceptance rates."""

    def __init__(self, curve: CostCurve | None, n_sources: int, window_rows: int):
        """curve None = not adaptive: always verify the whole tree and the window."""
        self.curve, self.window_rows = curve, window_rows
        self.rates = AcceptanceRates(n_sources)
        self.window_value = 0.5  # running tokens/step credited to the window (via the pool it feeds)
        self.steps = 0

    def plan(self, tree):
        """Return (pruned tree, whether to run the window) for this step."""
        if self.curve is None:
            return tree, self.window_rows > 0
        k, use_window = best_row_count(self.node_scores(tree), self.window_rows, self.window_value, self.curve)
        return tree.prune(k), use_window

    def chain_length(self, source: int, seconds_per_token: float | None, max_len: int) -> int:
        """How many tokens the draft model (drafter `source`) should draft this step: `best_chain_length` on its
        running acceptance rate and measured speed; every PROBE_EVERY-th step at least 1, so a resting draft
        model can prove itself again. The full `max_len` without a curve or before its speed is known."""
        if self.curve is None or seconds_per_token is None:
            return max_len
        rate = float(self.rates.rates()[source])
        n = best_chain_length(rate, max_len, seconds_per_token / self.curve.base_seconds, self.curve)
        return max(n, 1) if self.steps % PROBE_EVERY == 0 else n

    def node_scores(self, tree) -> np.ndarray:
        """Estimated acceptance probability of each non-root node, in `tree.ranked_nodes()` order."""
        ranked = tree.ranked_nodes()
        return self.rates.rates()[tree.source[ranked]] ** tree.depth[ranked]

    def learn(self, tree, tokens: list[int], used_window: bool, pool_source: int) -> None:
        """Update acceptance rates by walking the UNPRUNED tree along the committed `tokens`.

        Every child of a node on the committed path was tested (its parent was accepted); it was accepted if
        it carries the next committed token. Pruned nodes count too, so the rates keep learning while the
        planner verifies nothing (otherwise one bad stretch would stop speculation for good).
        """
        self.steps += 1
        n = len(self.rates.tested)
        tested, accepted = np.zeros(n), np.zeros(n)
        node = 0
        for token in tokens:
            children = tree.children[node]
            for child in children.values():
                tested[tree.source[child]] += 1
            node = children.get(token, -1)
            if node < 0:
                break
            accepted[tree.source[node]] += 1
        self.rates.update(tested, accepted)
        if used_window:
            self.window_value = 0.9 * self.window_value + 0.1 * float(accepted[pool_source])


def plan_batch(planners: list[StepPlanner], trees: list, curve: CostCurve | None, scale: float = 1.0) -> list:
    """Prune the trees of a batch step (one per sequence, no windows) to one common node count.

    All sequences are padded to the same row count, so one k serves them all: the k maximising expected
    committed tokens of the batch per unit cost, (B + sum of each tree's top-k scores) / ratio(1 + k), on
    `curve`, measured for this batch size (t(B sequences x k rows) / t(B x 1)). A wider batch makes extra rows
    dearer, so the chosen k shrinks (down to plain decoding). `scale` multiplies the curve's extra cost
    (ratio - 1) by what the generation's own timed steps showed (`ObservedCost.scale`). Without a curve the trees
    are kept.
    """
    if curve is None:
        return trees
    scores = [planner.node_scores(tree) for planner, tree in zip(planners, trees)]
    batch = len(trees)
    best_value, best_k = float(batch), 0
    for k in range(1, max(len(s) for s in scores) + 1):
        value = (batch + sum(float(s[:k].sum()) for s in scores)) / (1.0 + (curve.ratio(1 + k) - 1.0) * scale)
        if value > best_value * 1.02:  # prefer the cheaper option unless clearly better
            best_value, best_k = value, k
    return [tree.prune(best_k) for tree in trees]
