"""OpenAI completions `logprobs` of one choice, from the raw logits `generate(output_logits=True)` returns.

The log-probabilities are those of the model's own distribution at each position (log-softmax of the raw
logits, before temperature and top_p), as vLLM reports them by default. `tokens` are the returned tokens' texts,
`text_offset` where each starts in the completion text, `top_logprobs` the `k` most likely tokens of each
position plus the returned one (so up to k + 1 entries, as OpenAI documents). Tokens past the returned text
(the end-of-text token, the rest of a stop string) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One choice's `logprobs` object: four lists with one entry per returned token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    def as_dict(self) -> dict:
        """The JSON object of `choices[i].logprobs`."""
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def token_logprobs(logits: torch.Tensor, ids: list[int], k: int, tokenizer, text: str) -> TokenLogprobs:
    """The `logprobs` of completion tokens `ids` [n] given the raw logits [n, V] of the positions that chose
    them, with the top `k` alternatives; `text` is the returned completion text (stop string trimmed), which
    decides how many tokens are reported. Call with the tokenizer's lock held. Decodes every prefix of `ids`
    (quadratic in the completion's length, in the tokenizer's native code: fine for completion lengths)."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(ids, device=logits.device).view(-1, 1)).view(-1).tolist()  # [n]
    top = logprobs.topk(k, dim=-1)  # values, indices [n, k]
    # Offsets by decoding prefixes: the only way that agrees with the completion text for every tokenizer
    # (leading-space rules, characters split over byte tokens: a trailing U+FFFD belongs to the next token).
    prefixes = tokenizer.batch_decode([ids[:i] for i in range(len(ids))], skip_special_tokens=True)
    offsets = [len(p.rstrip("\ufffd")) for p in prefixes]
    n = sum(1 for o in offsets if o < len(text))

    def piece(token: int) -> str:
        return tokenizer.decode([token])

    tops = [{piece(t): v for t, v in zip(top.indices[i].tolist(), top.values[i].tolist())}
            | {piece(ids[i]): chosen[i]} for i in range(n)]
    return TokenLogprobs([piece(t) for t in ids[:n]], chosen[:n], tops, offsets[:n])
