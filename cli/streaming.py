"""The text `lookahead generate` streams to stdout, and a reader that stops reading (`lookahead generate ... | head`).

transformers' `TextStreamer` prints each finalized piece of text and flushes. When the reader of a pipe exits, that
print raises `BrokenPipeError` inside `generate`; click then ended the command with status 1 and no `--stats` line.
`PipedStreamer` turns it into `ReaderGone`: the generation stops at once (nothing is left to read it), stdout is
pointed at the null device (so the interpreter's final flush cannot fail again), and the command ends as a finished
one, its stats on stderr.
"""

from __future__ import annotations

import os
import sys

from transformers import TextStreamer


class ReaderGone(Exception):
    """The reader of stdout closed it while text was being streamed."""


class PipedStreamer(TextStreamer):
    """A `TextStreamer` whose print into a closed pipe raises `ReaderGone` (stdout then writes to the null device)."""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Print `text` as `TextStreamer` does; raises `ReaderGone` when stdout's reader has gone."""
        try:
            super().on_finalized_text(text, stream_end)
        except BrokenPipeError:
            silence_stdout()
            raise ReaderGone from None


def silence_stdout() -> None:
    """Point stdout's file descriptor at the null device: what is still buffered or written later goes nowhere."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)
