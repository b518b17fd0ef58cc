"""A REST-style datastore: text files (a code base, documentation, logs of earlier outputs) tokenized into a
`SuffixCache` that drafts continuations for every generation, as a `drafters.SharedDrafter`.

When the text being generated repeats a stretch of one of the files (an idiom of the code base, a phrase of the
docs), the file's continuation is a draft. Drafts are only proposals: the output is the same with or without a
datastore, and the planner learns how often the datastore's drafts are accepted and spends rows on them
accordingly.

Each file is one document of the cache (no draft crosses a file boundary). Directories are walked recursively in
sorted order, skipping hidden entries; files that are not UTF-8 text (a NUL byte, or undecodable) are skipped and
counted. Reading stops at the token bound: later files are left out and counted, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checks import check_int
from .suffix_cache import SuffixCache

DEFAULT_DATASTORE_TOKENS = 1 << 20


@dataclass
class DatastoreReport:
    """What went into a datastore: files read, tokens cached, files skipped (not UTF-8 text) and files left out
    at the token bound."""

    files: int = 0
    tokens: int = 0
    skipped: list[str] = field(default_factory=list)
    left_out: int = 0

    def summary(self) -> str:
        """One line for the user, e.g. `datastore: 12 files, 48,310 tokens (1 skipped: not UTF-8 text)`."""
        notes = []
        if self.skipped:
            notes.append(f"{len(self.skipped)} skipped: not UTF-8 text")
        if self.left_out:
            notes.append(f"{self.left_out} left out: token bound reached")
        tail = f" ({'; '.join(notes)})" if notes else ""
        return f"datastore: {self.files} files, {self.tokens:,} tokens{tail}"


def text_files(paths: list[str | Path]) -> list[Path]:
    """The files named by `paths`: files as given, directories walked recursively in sorted order (hidden files
    and directories skipped). Raises ValueError naming a path that does not exist, or if no file is found."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
        else:
            raise ValueError(f"datastore path {str(path)!r} does not exist")
    if not found:
        raise ValueError(f"no files in datastore paths {[str(p) for p in paths]}")
    return found


def _hidden(relative: Path) -> bool:
    """Whether any part of a relative path starts with a dot (.git, .venv, .cache, ...)."""
    return any(part.startswith(".") for part in relative.parts)


def read_text(path: Path) -> str | None:
    """The file's text, or None if it is not UTF-8 text (holds a NUL byte or does not decode)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def build_datastore(paths: list[str | Path], tokenizer, max_tokens: int = DEFAULT_DATASTORE_TOKENS,
                    cache: SuffixCache | None = None, progress: bool = False) -> tuple[SuffixCache, DatastoreReport]:
    """Tokenize the text files of `paths` (see `text_files`) into `cache` (None: a new `SuffixCache` bounded to
    `max_tokens`), one document per file, until `max_tokens` tokens are cached; returns the cache and a
    `DatastoreReport`. `progress` shows a progress bar on stderr. Raises ValueError for a missing path, no files,
    no text file, or `max_tokens < 1`."""
    max_tokens = check_int("max_tokens", max_tokens, 1)
    files = text_files(paths)
    cache = SuffixCache(max_tokens=max_tokens) if cache is None else cache
    report = DatastoreReport()
    for i, path in enumerate(_bar(files, progress)):
        text = read_text(path)
        if text is None:
            report.skipped.append(str(path))
            continue
        ids = np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)
        ids = ids[: max_tokens - report.tokens]
        cache.add(ids)
        report.files += 1
        report.tokens += len(ids)
        if report.tokens >= max_tokens:
            report.left_out = len(files) - i - 1
            break
    if report.files == 0:
        raise ValueError(f"no UTF-8 text files in datastore paths {[str(p) for p in paths]}")
    return cache, report


def _bar(files: list[Path], progress: bool):
    """`files`, wrapped in a tqdm bar on stderr when `progress`."""
    if not progress:
        return files
    from tqdm.auto import tqdm

    return tqdm(files, desc="datastore", unit="file", leave=False)
