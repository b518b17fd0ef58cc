"""The recycling prior: what a model chooses after each token, counted in its own text, for the token-recycling
table's rows that no verification has filled yet.

Token recycling (`recycle.py`) drafts from the target's own top-k after the root token, stored the last time a
row carrying that token was verified. A token never verified yet has no row, and the root is such a token on a
third of a generation's steps on the default model (more at the start of a process: the table starts empty).
The prior fills those rows: for every token t it keeps the k tokens the model chose most often right after t in
texts it wrote itself (the self-distilled texts of `head_training.distill`, their teacher-forced argmaxes), each
with the log of how often — so a row's softmax over its stored scores is the share of t's occurrences that
continued with that token, as the table's classes read it (`recycle.CONFIDENT`). Tokens seen fewer than
`MIN_COUNT` times keep no row. Only empty rows are seeded (`RecycleTable.seed`); a verified row replaces a seeded
one as it replaces any other. Exactness is untouched: the prior only proposes drafts, which verification checks.

A prior file is a safetensors file: `tokens` [n] int32, `next` [n, k] int32 (-1 padded), `scores` [n, k] float32,
with text metadata `format` ("lookahead-recycle-prior"), `fingerprint` (`head_files.model_fingerprint`), `model`
and `made`. Priors shipped with the package live in `lookahead/priors/`; `prior_for(model, "auto")` finds the one
made for the model (None when none is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .head_files import check_fingerprint, find_packaged, loaded_once, model_fingerprint, read_metadata

FORMAT = "lookahead-recycle-prior"
WHAT = "recycling prior"
PACKAGED = Path(__file__).parent / "priors"
MIN_COUNT = 2  # a token's occurrences in the texts before its row is kept


@dataclass(frozen=True)
class RecyclePrior:
    """Seed rows for a recycling table: `tokens` [n] int32, their predicted next tokens `next` [n, k] int32 (best
    first, -1 padded) and `scores` [n, k] float32 (log counts)."""

    tokens: np.ndarray
    next: np.ndarray
    scores: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.tokens.ndim != 1 or self.next.ndim != 2 or self.next.shape[0] != n or \
                self.scores.shape != self.next.shape:
            raise ValueError(f"a recycling prior needs tokens [n], next [n, k] and scores [n, k], got "
                             f"{self.tokens.shape}, {self.next.shape}, {self.scores.shape}")


def build_prior(texts, vocab_size: int, k: int = 8, min_count: int = MIN_COUNT) -> RecyclePrior:
    """The prior of `texts` (each with `ids` [n] and `argmax` [n]: the model's greedy choice after each position,
    as `head_training.Example`): per token id below `vocab_size` seen at least `min_count` times, the `k` tokens
    most often chosen after it (ties: lower id first) with the logs of their counts."""
    pairs = [np.stack([t.ids.numpy(), t.argmax.numpy()]) for t in texts if len(t.ids)]
    if not pairs:
        raise ValueError("a recycling prior needs at least one non-empty text")
    token, chosen = np.concatenate(pairs, axis=1).astype(np.int64)
    inside = (token >= 0) & (token < vocab_size) & (chosen >= 0) & (chosen < vocab_size)
    keys, counts = np.unique(token[inside] * vocab_size + chosen[inside], return_counts=True)
    token, chosen = keys // vocab_size, keys % vocab_size
    order = np.lexsort((chosen, -counts, token))  # by token, then most frequent first, then lower id
    token, chosen, counts = token[order], chosen[order], counts[order]
    starts = np.flatnonzero(np.r_[True, token[1:] != token[:-1]])
    rank = np.arange(len(token)) - np.repeat(starts, np.diff(np.r_[starts, len(token)]))
    totals = np.bincount(token, weights=counts, minlength=vocab_size)
    kept = np.flatnonzero(totals >= min_count)
    row = np.full(vocab_size, -1, dtype=np.int64)
    row[kept] = np.arange(len(kept))
    take = (rank < k) & (row[token] >= 0)
    nxt = np.full((len(kept), k), -1, dtype=np.int32)
    scores = np.zeros((len(kept), k), dtype=np.float32)
    nxt[row[token[take]], rank[take]] = chosen[take]
    scores[row[token[take]], rank[take]] = np.log(counts[take])
    return RecyclePrior(kept.astype(np.int32), nxt, scores)


def save_prior(path: str | Path, prior: RecyclePrior, model, made: str) -> None:
    """Write `prior` as the prior file of `model` at `path` (see the module docstring); `made`: how."""
    tensors = {"tokens": torch.from_numpy(prior.tokens), "next": torch.from_numpy(prior.next),
               "scores": torch.from_numpy(prior.scores)}
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    save_file(tensors, str(path), metadata={"format": FORMAT, "fingerprint": model_fingerprint(model),
                                            "model": name, "made": made})


def load_prior(path: str | Path, model) -> RecyclePrior:
    """The prior in the file at `path`, made for `model`. Raises `ValueError` when the file is not a prior file,
    was made for another model, or names tokens outside the model's vocabulary."""
    check_fingerprint(read_metadata(path, FORMAT, WHAT), path, model, WHAT)
    with safe_open(str(path), framework="np") as f:
        arrays = {name: f.get_tensor(name) for name in f.keys()}
    if set(arrays) != {"tokens", "next", "scores"}:
        raise ValueError(f"{WHAT} {path} holds {sorted(arrays)}, not tokens, next and scores")
    prior = RecyclePrior(arrays["tokens"].astype(np.int32), arrays["next"].astype(np.int32),
                         arrays["scores"].astype(np.float32))
    vocab = model.config.get_text_config().vocab_size
    if len(prior.tokens) and (prior.tokens.min() < 0 or max(prior.tokens.max(), prior.next.max()) >= vocab):
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
