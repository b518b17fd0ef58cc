"""Completion text for the server: stop strings, and streaming only text that can no longer change.

A completion is sent as it grows, but never past a stop string (OpenAI trims the stop string and what follows),
never a tail that may still turn into one, and never half of a UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest occurrence of any stop string starts, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stable_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of a growing completion `text` can be sent now: never a stop string nor what follows it, nor a
    tail that may still become a stop string, nor a trailing incomplete UTF-8 character (decoded as U+FFFD)."""
    cut = first_stop(text, stops)
    if cut is not None:
        return cut
    end = len(text.rstrip("\ufffd"))
    hold = max((k for s in stops for k in range(1, min(len(s), end + 1)) if text[:end].endswith(s[:k])),
               default=0)
    return end - hold


class TextStreamer(BaseStreamer):
    """Receives committed token chunks from the decoder and calls `emit(text)` with each new piece of stable
    text (see `stable_length`). `decode` turns completion token ids into text."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], emit: Callable[[str], None]):
        self.decode, self.stops, self.emit = decode, stops, emit
        self.ids: list[int] = []
        self.sent = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """Take the next committed tokens ([n] or [1, n]); the first call carries the prompt and is skipped."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids += value.reshape(-1).tolist()
        text = self.decode(self.ids)
        stable = stable_length(text, self.stops)
        if stable > self.sent:
            self.emit(text[self.sent: stable])
            self.sent = stable

    def end(self) -> None:
        """Nothing to flush: the final text travels with the finished completion."""


class StopText(StoppingCriteria):
    """Stops once the completion text contains a stop string (checked on the last few tokens' text).

    transformers' `StopStringCriteria` preprocesses the whole vocabulary per request (~1.5 s here); decoding
    the tail is enough because the decoder checks after every committed token, so a stop string is caught in
    the token that completes it. A tail of `4 * len(stop) + 4` tokens covers the string even if every
    character spans four byte-level tokens.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], prompt_len: int):
        self.decode, self.stops, self.prompt_len = decode, stops, prompt_len
        self.window = 4 * max(len(s) for s in stops) + 4

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        text = self.decode(input_ids[0, start:].tolist())
        return torch.full((input_ids.shape[0],), first_stop(text, self.stops) is not None, dtype=torch.bool)
