"""Planning policy: how many rows to verify per step, from the cost curve and learned acceptance estimates.

Each step the policy ranks the draft-tree nodes by the estimated probability that the verifier accepts the whole
path to them, and keeps the nodes and window rows that maximise expected committed tokens per unit of cost
(`cost_curve.CostCurve`). `StepPlanner` plans one sequence's step; `BatchPlanner` plans each step of a
generation (one common tree size for a batch, the curve corrected by the generation's own timed steps).

Why path probabilities: at most one child of a node is accepted (siblings carry distinct tokens), and a node can
only be accepted once its parent is. So the tokens a tree commits are 1 (the bonus) plus the sum over its nodes of
P(path to the node accepted) = the product, along the path, of P(node accepted | parent accepted). That
conditional probability is learned online per source (drafter, split by match length or rank) and depth, from
what the verifier accepts; the estimates of one node's children are capped to sum below 1.
"""

from __future__ import annotations

from dataclasses import replace

import numba
import numpy as np

from .cost_curve import CostCurve, ObservedCost
from .tree import DraftTree

PROBE_EVERY = 16  # a resting draft model still drafts one token this often
MAX_DEPTH = 8  # acceptance is estimated per depth 1..MAX_DEPTH; deeper nodes share the last estimate
SIBLING_CAP = 0.99  # the children of one node together are accepted with probability below this
# Weight of the previous step's counts in the acceptance estimates (a memory of ~20 steps). Measured on the fixed
# curve (bench_drafts, 6 prompts per category): 0.9 -> 0.95 gave 1.28x -> 1.32x modeled speed under seeded sampling,
# where a shorter memory chases lucky streaks (the planner then verifies more than pays), and no loss greedy.
DECAY = 0.95
CLEARLY_BETTER = 1.02  # a plan with more rows must promise this factor more tokens per unit cost than a cheaper one


class AcceptanceRates:
    """Running estimate, per source and depth, of P(node accepted | its parent accepted).

    Counts decay by `decay` each step so the estimates follow the text (grounded passages vs free chat). Each
    cell is pulled towards a prior with the weight of two observations (decaying like the counts): `prior` at
    depth 1, the same source's estimate one level shallower below it, so a depth the drafter has not reached yet
    (or not for long) starts from what its shallower nodes showed instead of a fixed guess.
    """

    def __init__(self, n_sources: int, prior: float = 0.3, decay: float = DECAY, depths: int = MAX_DEPTH):
        self.accepted = np.zeros((n_sources, depths))  # [n_sources, depths], decayed counts
        self.tested = np.zeros((n_sources, depths))  # [n_sources, depths]
        self.prior, self.prior_weight, self.decay = prior, 2.0, decay
        self._rates: np.ndarray | None = None  # `rates()` until the next update

    def rates(self) -> np.ndarray:
        """[n_sources, depths] current estimates in (0, 1); column d - 1 is depth d (computed once per update;
        callers must not modify it)."""
        if self._rates is None:
            self._rates = self._estimate()
        return self._rates

    def _estimate(self) -> np.ndarray:
        """The estimates from the decayed counts and the priors (see the class docstring)."""
        out = np.empty_like(self.accepted)
        _estimates(self.accepted, self.tested, float(self.prior), float(self.prior_weight), out)
        return out

    def update(self, tested: np.ndarray, accepted: np.ndarray) -> None:
        """Add one step's counts ([n_sources, depths] each) of tested and accepted draft tokens."""
        self.accepted = self.accepted * self.decay + accepted
        self.tested = self.tested * self.decay + tested
        self.prior_weight *= self.decay
        self._rates = None


@numba.njit(cache=True, nogil=True)
def _estimates(accepted, tested, prior, weight, out):  # pragma: no cover - compiled
    """`AcceptanceRates._estimate` into out [n_sources, depths]: per source, depth by depth, (accepted + weight ·
    above) / (tested + weight) where tested + weight > 1e-12, else `above` (the estimate one level shallower;
    `prior` above depth 1), then clipped to [0.01, 0.99] (a dozen numpy calls per depth cost ~0.1 ms a step)."""
    for s in range(out.shape[0]):
        above = prior
        for d in range(out.shape[1]):
            total = tested[s, d] + weight
            if total > 1e-12:
                above = (accepted[s, d] + weight * above) / max(total, 1e-300)
            out[s, d] = min(max(above, 0.01), 0.99)


def path_values(tree, rates: np.ndarray) -> np.ndarray:
    """[N] estimated P(path to node accepted) for every node of `tree` (root: 1.0).

    rates: [n_sources, D] conditional acceptance per source and depth (depth d in column min(d, D) - 1). A node
    is worth its parent's value times its own rate; the rates of one node's children are scaled down to sum to
    at most SIBLING_CAP, as at most one of them can be accepted. Values never grow along a path.
    """
    values = np.ones(tree.size)
    if tree.size > 1:
        _path_values(tree.parents, tree.depth, tree.source, np.ascontiguousarray(rates, dtype=np.float64),
                     SIBLING_CAP, values)
    return values


@numba.njit(cache=True, nogil=True)
def _path_values(parents, depth, source, rates, cap, values):  # pragma: no cover - compiled
    """`path_values` into values [N] (values[0] = 1 on entry): nodes in creation order, so a parent precedes its
    children; each child's rate is scaled by min(1, cap / its siblings' rate sum) before it multiplies the
    parent's value (the siblings summed in node order)."""
    n, columns = parents.shape[0], rates.shape[1]
    cond, sums = np.empty(n), np.zeros(n)
    for node in range(1, n):
        cond[node] = rates[source[node], min(depth[node], columns) - 1]
        sums[parents[node]] += cond[node]
    for node in range(1, n):
        parent = parents[node]
        values[node] = values[parent] * (cond[node] * min(1.0, cap / max(sums[parent], 1e-12)))


def best_first(scores: np.ndarray) -> np.ndarray:
    """`scores` sorted from best to worst, ties in their order (the order `DraftTree.prune` keeps nodes in)."""
    return -np.sort(-scores, kind="stable")


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
            if value > best[0] * CLEARLY_BETTER:  # prefer the cheaper option unless clearly better
                best = (value, k, use_window)
    return best[1], best[2]


def best_chain_length(rate, max_len: int, draft_cost: float, curve: CostCurve) -> int:
    """Draft-model chain length n in [0, max_len] maximising expected committed tokens per unit cost,
    (1 + c_1 + c_1 c_2 + ... + c_1...c_n) / (ratio(1 + n) + n * draft_cost), where c_d is the conditional
    acceptance at depth d (`rate`: one float for every depth, or per depth [D], the last repeated beyond D) and
    `draft_cost` the time of one draft token over one target decode step. 0 = do not run the draft model."""
    rates = np.atleast_1d(np.asarray(rate, dtype=np.float64))
    per_depth = rates[np.minimum(np.arange(max_len), len(rates) - 1)]  # [max_len]
    gain = 1.0 + np.cumsum(np.cumprod(per_depth))  # [max_len] expected tokens with n = 1..max_len
    best_value, best_n = 1.0, 0
    for n in range(1, max_len + 1):
        value = gain[n - 1] / (curve.ratio(1 + n) + n * draft_cost)
        if value > best_value * CLEARLY_BETTER:
            best_value, best_n = value, n
    return best_n


class StepPlanner:
    """Per-step choice of tree size and window use from the cost curve and learned acceptance estimates."""

    def __init__(self, curve: CostCurve | None, n_sources: int, window_rows: int):
        """curve None = not adaptive: always verify the whole tree and the window."""
        self.curve, self.window_rows = curve, window_rows
        self.rates = AcceptanceRates(n_sources)
        self.window_value = 0.5  # running tokens/step credited to the window (via the pool it feeds)
        self.steps = 0

    def rank(self, tree):
        """`tree` with its scores replaced by the estimated path-acceptance probabilities (`path_values`; root:
        inf), so `prune(k)` keeps the k likeliest nodes (a prefix-closed set: values never grow along a path)
        and `expected_tokens` reads what the planner predicts."""
        scores = path_values(tree, self.rates.rates())
        scores[0] = np.inf
        return replace(tree, scores=scores)

    def node_scores(self, tree) -> np.ndarray:
        """Estimated P(path accepted) of each non-root node, best first (the order `rank(tree).prune` keeps)."""
        return best_first(path_values(tree, self.rates.rates())[1:])

    def plan(self, tree):
        """Return (the ranked tree pruned to the nodes worth verifying, whether to run the window)."""
        ranked = self.rank(tree)
        if self.curve is None:
            return ranked, self.window_rows > 0
        k, use_window = best_row_count(best_first(ranked.scores[1:]), self.window_rows, self.window_value, self.curve)
        return ranked.prune(k), use_window

    def chain_length(self, source: int, seconds_per_token: float | None, max_len: int) -> int:
        """How many tokens the draft model (drafter `source`) should draft this step: `best_chain_length` on its
        per-depth acceptance estimates and measured speed; every PROBE_EVERY-th step at least 1, so a resting
        draft model can prove itself again. The full `max_len` without a curve or before its speed is known."""
        if self.curve is None or seconds_per_token is None:
            return max_len
        rates = self.rates.rates()[source]
        n = best_chain_length(rates, max_len, seconds_per_token / self.curve.base_seconds, self.curve)
        return max(n, 1) if self.steps % PROBE_EVERY == 0 else n

    def learn(self, tree, tokens: list[int], used_window: bool, pool_source: int) -> None:
        """Update the acceptance estimates by walking the UNPRUNED tree along the committed `tokens`.

        Every child of a node on the committed path was tested (its parent was accepted); it was accepted if
        it carries the next committed token. Pruned nodes count too, so the estimates keep learning while the
        planner verifies nothing (otherwise one bad stretch would stop speculation for good). Under sampling
        the committed token has the target's law, so a pruned child carrying x counts as accepted with
        probability p(x), exactly the rate at which verifying it would have been accepted.
        """
        self.steps += 1
        tested, accepted = np.zeros_like(self.rates.tested), np.zeros_like(self.rates.accepted)
        depths = tested.shape[1]
        node = 0
        for token in tokens:
            children = tree.children[node]
            for child in children.values():
                tested[tree.source[child], min(int(tree.depth[child]), depths) - 1] += 1
            node = children.get(token, -1)
            if node < 0:
                break
            accepted[tree.source[node], min(int(tree.depth[node]), depths) - 1] += 1
        self.rates.update(tested, accepted)
        if used_window:
            self.window_value = 0.9 * self.window_value + 0.1 * float(accepted[pool_source].sum())


def expected_tokens(tree) -> float:
    """Tokens a step verifying `tree` is predicted to commit: 1 + the sum of its nodes' path-acceptance
    estimates (valid for a tree from `StepPlanner.rank`, pruned or not)."""
    return 1.0 + float(tree.scores[1:].sum())


def plan_batch(planners: list[StepPlanner], trees: list, curve: CostCurve | None, scale: float = 1.0) -> list:
    """Prune the trees of a batch step (one per sequence, no windows) to one common node count.

    All sequences are padded to the same row count, so one k serves them all: the k maximising expected
    committed tokens of the batch per unit cost, (B + sum of each tree's top-k scores) / ratio(1 + k), on
    `curve`, measured for this batch size (t(B sequences x k rows) / t(B x 1)). A wider batch makes extra rows
    dearer, so the chosen k shrinks (down to plain decoding). `scale` multiplies the curve's extra cost
    (ratio - 1) by what the generation's own timed steps showed (`ObservedCost.scale`). Each tree is ranked by its
    planner (`StepPlanner.rank`) and cut to its k likeliest nodes. Without a curve the trees are kept.
    """
    if curve is None:
        return trees
    scores = [planner.node_scores(tree) for planner, tree in zip(planners, trees)]
    batch = len(trees)
    best_value, best_k = float(batch), 0
    for k in range(1, max(len(s) for s in scores) + 1):
        value = (batch + sum(float(s[:k].sum()) for s in scores)) / (1.0 + (curve.ratio(1 + k) - 1.0) * scale)
        if value > best_value * CLEARLY_BETTER:  # prefer the cheaper option unless clearly better
            best_value, best_k = value, k
    return [planner.rank(tree).prune(best_k) for planner, tree in zip(planners, trees)]


COLD_FORWARDS = 3  # forwards after the prefill whose times are not recorded (see `BatchPlanner`)


class BatchPlanner:
    """The plan of every step of one generation of `batch` sequences: each running sequence's pruned tree and
    whether its window runs, from its `StepPlanner` and its candidate tree.

    curve: the model's cost curve at one sequence; batch_curve: its curve at `batch` sequences (used while more than
    one sequence runs; None when `batch` is 1); draws_follow_plan: the rule's random draws depend on the plan
    (`rules.draws_follow_the_plan`: unseeded sampling with a draft model). Without a curve every candidate is
    verified. The curve is taken at the current cache length and corrected by the generation's own timed steps
    (`record`), so the step after the first `COLD_FORWARDS` is a plain one (the reference time) — except at batch
    size 1 when the draws follow the plan (they must not depend on timings), and when `follow_timings` is False (a
    fixed curve the caller chose: the plan follows it alone). The first steps are planned on the measured curve and
    their times are not recorded: the forwards right after the prefill run slow (on the 2-core Intel Xeon the
    suite's chat and code prompts took a median of 11.0, 8.6, 7.6, 7.0 ms for their first one-row steps against
    ~5.5 ms later), and the first as the reference made every later step look cheap, holding the correction at its
    floor (docs/step-cost.md, "Session 52").
    """

    def __init__(self, curve: CostCurve | None, batch_curve: CostCurve | None, batch: int, draws_follow_plan: bool,
                 follow_timings: bool = True):
        self.curve, self.batch_curve, self.batch = curve, batch_curve, batch
        # A rule drawing from one generator in step order would make `torch.manual_seed` runs differ if the plan
        # followed timings: it plans on the measured curve alone (at this cache length).
        self.timed = follow_timings and not (batch == 1 and draws_follow_plan)
        self.observed = ObservedCost(batch_curve if batch > 1 else curve)
        self.cold = COLD_FORWARDS  # forwards still to come before timings count

    def record(self, rows: int, seconds: float) -> None:
        """Add one timed forward of `rows` rows per sequence (`ObservedCost.record`); the first `COLD_FORWARDS`
        after the prefill are left out."""
        if self.cold:
            self.cold -= 1
            return
        self.observed.record(rows, seconds)

    def forget_timings(self) -> None:
        """Drop the timed steps (the thread count changed, `thread_governor.py`): the next planned step is a plain
        one again, the reference time at the new count."""
        self.observed = ObservedCost(self.observed.curve)

    def plan(self, planners: list[StepPlanner], candidates: list[DraftTree],
             prefix_len: int) -> list[tuple[DraftTree, bool]]:
        """(pruned tree, use_window) per running sequence, given their planners and unpruned candidate trees and
        the cache length `prefix_len`: the planner's choice for one sequence, one common tree size (no windows)
        for a batch."""
        if len(planners) == 1 and self.batch > 1:  # the last sequence of a batch: its own curve, uncorrected
            return [(plan_batch(planners, candidates, self.curve)[0], False)]
        curve = self.curve if self.batch == 1 else self.batch_curve
        if self.timed and curve is not None and not self.observed.has_plain and not self.cold:
            return [(tree.prune(0), False) for tree in candidates]
        if self.timed:
            curve = self.observed.corrected(curve, prefix_len)
        elif curve is not None:
            curve = curve.at(prefix_len)
        if self.batch == 1:
            planners[0].curve = curve
            return [planners[0].plan(candidates[0])]
        return [(tree, False) for tree in plan_batch(planners, candidates, curve)]
