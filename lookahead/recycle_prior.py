"""The recycling prior: what a model chooses after each token, counted in its own text, for the token-recycling
table's rows that no verification has filled yet.

Token recycling (`recycle.py`) drafts from the target's own top-k after the root token, stored the last time a
row carrying that token was verified. A token never verified yet has no row, and the root is such a token on a
third of a generation's steps on the default model (more at the start of a process: the table starts empty).
The prior fills those rows: for every token t it keeps the k tokens the model chose most often right after t in
texts it wrote itself (the self-distilled texts of `head_training.distill`, their teacher-forced argmaxes), each
with the log of how often — so a row's softmax over its stored scores is the share of t's occurrences that
continued with that token, as the table's classes read it (`recycle.CONFIDENT`). The same counts per token pair
(the token before t and t) seed the table's rows per pair (`recycle_pairs.py`), at most `PAIR_K` tokens each.
Tokens and pairs seen fewer than `MIN_COUNT` times keep no row. Only empty rows are seeded (`RecycleTable.seed`);
a verified row replaces a seeded one as it replaces any other. Exactness is untouched: the prior only proposes
drafts, which verification checks.

A prior file is a safetensors file: `tokens` [n] int32, `next` [n, k] int32 (-1 padded), `scores` [n, k] float32,
optionally the pair rows `pair_prev` [m] int32, `pair_tokens` [m] int32, `pair_next` [m, k'] int32 and
`pair_scores` [m, k'] float32 (a file without them seeds no pair rows), with text metadata `format`
("lookahead-recycle-prior"), `fingerprint` (`head_files.model_fingerprint`), `model` and `made`. Priors shipped
with the package live in `lookahead/priors/`; `prior_for(model, "auto")` finds the one made for the model (None
when none is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .head_files import check_fingerprint, find_packaged, loaded_once, model_fingerprint, read_metadata

FORMAT = "lookahead-recycle-prior"
WHAT = "recycling prior"
PACKAGED = Path(__file__).parent / "priors"
MIN_COUNT = 2  # a token's (or a pair's) occurrences in the texts before its row is kept
PAIR_K = 4  # next tokens kept per pair (the default model's pairs seen twice have 3.3 distinct next tokens)
_ARRAYS = ("tokens", "next", "scores")
_PAIR_ARRAYS = ("pair_prev", "pair_tokens", "pair_next", "pair_scores")


@dataclass(frozen=True)
class RecyclePrior:
    """Seed rows for a recycling table: `tokens` [n] int32, their predicted next tokens `next` [n, k] int32 (best
    first, -1 padded) and `scores` [n, k] float32 (log counts); the same per token pair: `pair_tokens` [m] int32
    after `pair_prev` [m] int32, `pair_next` [m, k'] int32, `pair_scores` [m, k'] float32 (m = 0: none)."""

    tokens: np.ndarray
    next: np.ndarray
    scores: np.ndarray
    pair_prev: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pair_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    pair_next: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int32))
    pair_scores: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.float32))

    def __post_init__(self) -> None:
        _check_rows("tokens, next and scores", self.tokens, self.next, self.scores)
        _check_rows("pair_tokens, pair_next and pair_scores", self.pair_tokens, self.pair_next, self.pair_scores)
        if self.pair_prev.shape != self.pair_tokens.shape:
            raise ValueError(f"a recycling prior needs pair_prev shaped as pair_tokens {self.pair_tokens.shape}, "
                             f"got {self.pair_prev.shape}")


def _check_rows(names: str, keys: np.ndarray, nxt: np.ndarray, scores: np.ndarray) -> None:
    """Raise `ValueError` unless keys [n], next [n, k] and scores [n, k] fit together."""
    if keys.ndim != 1 or nxt.ndim != 2 or nxt.shape[0] != len(keys) or scores.shape != nxt.shape:
        raise ValueError(f"a recycling prior needs {names} shaped [n], [n, k], [n, k], got "
                         f"{keys.shape}, {nxt.shape}, {scores.shape}")


def build_prior(texts, vocab_size: int, k: int = 8, min_count: int = MIN_COUNT,
                pair_k: int = PAIR_K) -> RecyclePrior:
    """The prior of `texts` (each with `ids` [n] and `argmax` [n]: the model's greedy choice after each position,
    as `head_training.Example`): per token id below `vocab_size` seen at least `min_count` times, the `k` tokens
    most often chosen after it (ties: lower id first) with the logs of their counts; per token pair (a position's
    token and the one before it) seen at least `min_count` times, its `pair_k` (0: no pair rows) the same way."""
    columns = [np.stack([np.r_[-1, t.ids.numpy()[:-1]], t.ids.numpy(), t.argmax.numpy()]) for t in texts
               if len(t.ids)]
    if not columns:
        raise ValueError("a recycling prior needs at least one non-empty text")
    prev, token, chosen = np.concatenate(columns, axis=1).astype(np.int64)
    inside = (token >= 0) & (token < vocab_size) & (chosen >= 0) & (chosen < vocab_size)
    keys, nxt, scores = _ranked(token[inside, None], chosen[inside], k, min_count)
    pairs = inside & (prev >= 0) & (prev < vocab_size)
    pair_keys, pair_next, pair_scores = _ranked(np.stack([prev[pairs], token[pairs]], axis=1), chosen[pairs],
                                                pair_k, min_count) if pair_k else _ranked_none()
    return RecyclePrior(keys[:, 0].astype(np.int32), nxt, scores, pair_keys[:, 0].astype(np.int32),
                        pair_keys[:, 1].astype(np.int32), pair_next, pair_scores)


def _ranked(keys: np.ndarray, chosen: np.ndarray, k: int, min_count: int):
    """For each distinct row of `keys` [n, c] int64 seen at least `min_count` times (in order): the `k` values of
    `chosen` [n] most often seen with it (ties: lower first; -1 padded) and the logs of their counts. Returns
    (key rows [m, c] int64, next [m, k] int32, scores [m, k] float32)."""
    rows, counts = np.unique(np.column_stack([keys, chosen]), axis=0, return_counts=True)
    if not len(rows):
        return _ranked_none(keys.shape[1], k)
    key_rows, group = np.unique(rows[:, :-1], axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.lexsort((rows[:, -1], -counts, group))  # by key, then most frequent first, then lower value
    group, value, counts = group[order], rows[order, -1], counts[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    rank = np.arange(len(group)) - np.repeat(starts, np.diff(np.r_[starts, len(group)]))
    totals = np.bincount(group, weights=counts, minlength=len(key_rows))
    kept = np.flatnonzero(totals >= min_count)
    renumber = np.full(len(key_rows), -1, dtype=np.int64)
    renumber[kept] = np.arange(len(kept))
    take = (rank < k) & (renumber[group] >= 0)
    nxt = np.full((len(kept), k), -1, dtype=np.int32)
    scores = np.zeros((len(kept), k), dtype=np.float32)
    nxt[renumber[group[take]], rank[take]] = value[take]
    scores[renumber[group[take]], rank[take]] = np.log(counts[take])
    return key_rows[kept], nxt, scores


def _ranked_none(columns: int = 2, k: int = 1):
    """`_ranked`'s result with no rows."""
    return np.zeros((0, columns), np.int64), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)


def save_prior(path: str | Path, prior: RecyclePrior, model, made: str) -> None:
    """Write `prior` as the prior file of `model` at `path` (see the module docstring); `made`: how."""
    tensors = {name: torch.from_numpy(np.ascontiguousarray(getattr(prior, name))) for name in _ARRAYS}
    if len(prior.pair_tokens):
        tensors.update({name: torch.from_numpy(np.ascontiguousarray(getattr(prior, name))) for name in _PAIR_ARRAYS})
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    save_file(tensors, str(path), metadata={"format": FORMAT, "fingerprint": model_fingerprint(model),
                                            "model": name, "made": made})


def load_prior(path: str | Path, model) -> RecyclePrior:
    """The prior in the file at `path`, made for `model`. Raises `ValueError` when the file is not a prior file,
    was made for another model, or names tokens outside the model's vocabulary."""
    check_fingerprint(read_metadata(path, FORMAT, WHAT), path, model, WHAT)
    with safe_open(str(path), framework="np") as f:
        arrays = {name: f.get_tensor(name) for name in f.keys()}
    if set(arrays) not in (set(_ARRAYS), set(_ARRAYS + _PAIR_ARRAYS)):
        raise ValueError(f"{WHAT} {path} holds {sorted(arrays)}, not tokens, next and scores (and optionally "
                         f"{', '.join(_PAIR_ARRAYS)})")
    try:
        prior = RecyclePrior(**{name: a.astype(np.float32 if name.endswith("scores") else np.int32)
                                for name, a in arrays.items()})
    except ValueError as exc:
        raise ValueError(f"{WHAT} {path}: {exc}") from None
    vocab = model.config.get_text_config().vocab_size
    keys = [a for a in (prior.tokens, prior.pair_prev, prior.pair_tokens) if a.size]
    nexts = [a for a in (prior.next, prior.pair_next) if a.size]
    if any(a.min() < 0 or a.max() >= vocab for a in keys) or any(a.max() >= vocab for a in nexts):
        raise ValueError(f"{WHAT} {path} names tokens outside the model's vocabulary of {vocab}")
    return prior


def prior_for(model, spec: str | None = "auto") -> RecyclePrior | None:
    """The recycling prior `spec` names for `model`: None or "none" → none; "auto" → the packaged prior made for
    the model (None when there is none); else the prior file at path `spec`. Loaded once per model and spec, then
    shared. Raises `ValueError` when the file does not exist or as `load_prior` does."""
    if spec is None or spec == "none":
        return None
    return loaded_once(model, FORMAT, spec, lambda: _load(model, spec))


def configured_prior(model, config) -> RecyclePrior | None:
    """The prior a `LookaheadConfig` asks for, for `model` (`prior_for(model, config.recycle_prior)`), or None when
    token recycling is off. Raises `ValueError` as `prior_for` does."""
    return prior_for(model, config.recycle_prior) if config.recycle_nodes and config.tree_budget else None


def _load(model, spec: str) -> RecyclePrior | None:
    """Load the prior `spec` names (see `prior_for`)."""
    if spec == "auto":
        found = find_packaged(model, PACKAGED, FORMAT)
        return None if found is None else load_prior(found, model)
    if not Path(spec).is_file():
        raise ValueError(f"{WHAT} file {spec} does not exist")
    return load_prior(spec, model)
