"""Response bodies of the OpenAI-compatible server: whole responses, streamed chunks, usage, the `lookahead`
field with the speculation stats, and server-sent events.

A response answers one request with `n` choices. Each choice comes from one engine sample, except that a greedy
request with n > 1 is generated once and answered with n identical choices (`copies`), as OpenAI answers it
with temperature 0; usage then counts every returned choice, the `lookahead` stats the work done.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

from .server_engine import Completion
from .stats import DecodeStats


class ResponseShape:
    """Builds the JSON objects of one response (completion or chat, whole or streamed chunks).

    `copies`: how many choices each engine sample answers (n for a greedy request, else 1); sample s answers
    choices `s * copies ... (s + 1) * copies - 1` (see `choices_of`).
    """

    def __init__(self, chat: bool, model: str, copies: int = 1):
        self.chat, self.model, self.copies = chat, model, copies
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def choices_of(self, sample: int) -> range:
        """The choice indices engine sample `sample` answers."""
        return range(sample * self.copies, (sample + 1) * self.copies)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, completion: Completion) -> dict:
        logprobs = None if completion.logprobs is None else completion.logprobs.as_dict()
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": completion.text},
                    "logprobs": logprobs, "finish_reason": completion.finish_reason}
        return {"index": index, "text": completion.text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason}

    def whole(self, completions: list[Completion]) -> dict:
        """The non-streaming response for the engine samples' `completions` (in sample order), with usage and
        the `lookahead` stats."""
        choices = [self._choice(i, c) for s, c in enumerate(completions) for i in self.choices_of(s)]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return body | self._totals(completions)

    def chunk(self, text: str, index: int = 0, first: bool = False) -> dict:
        """A streamed chunk carrying `text` for choice `index` (the chat's first chunk also carries the
        assistant role)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return self._envelope("chat.completion.chunk",
                                  [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        return self._envelope("text_completion",
                              [{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def last_chunk(self, completion: Completion, text: str, index: int = 0,
                   finished: list[Completion] | None = None) -> dict:
        """Choice `index`'s final streamed chunk: the remaining `text` and `finish_reason`; the response's very
        last one also carries usage and the `lookahead` stats of all the samples (`finished`)."""
        body = self.chunk(text, index)
        body["choices"][0]["finish_reason"] = completion.finish_reason
        return body if finished is None else body | self._totals(finished)

    def _totals(self, completions: list[Completion]) -> dict:
        """The `usage` and `lookahead` fields for the samples' `completions`."""
        returned = self.copies * sum(c.completion_tokens for c in completions)
        prompt = completions[0].prompt_tokens
        cached = completions[0].cached_tokens  # the first sample's: the later ones reuse the prompt it computed
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": returned, "total_tokens": prompt + returned,
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "lookahead": speculation_stats([c.stats for c in completions])}


def speculation_stats(stats: list[DecodeStats]) -> dict:
    """The `lookahead` extra field of a response from its generations' `DecodeStats`: tokens per step and
    friends, over all of them (`prefill_seconds`: their prompts' forwards, the time before the first token;
    `fewer_threads_steps`: steps run on fewer threads while other processes held the cores, `thread_governor.py`)."""
    total = DecodeStats(steps=sum(s.steps for s in stats), new_tokens=sum(s.new_tokens for s in stats),
                        step_tokens=sum(s.step_tokens for s in stats), total_time=sum(s.total_time for s in stats),
                        accepted_by_drafter=sum((s.accepted_by_drafter for s in stats), Counter()))
    return {"tokens_per_step": round(total.mean_tokens_per_step, 4), "steps": total.steps,
            "new_tokens": total.new_tokens, "tokens_per_second": round(total.tokens_per_second, 2),
            "accepted_by_drafter": dict(total.accepted_by_drafter),
            "prefill_seconds": round(sum(s.prefill_time for s in stats), 4),
            "fewer_threads_steps": sum(s.fewer_threads_steps for s in stats)}


def sse(obj: dict | str) -> bytes:
    """One server-sent event: `data: <json>` (or a literal such as `[DONE]`) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
