"""Fill-in-the-middle prompts for code models trained with FIM tokens (Qwen2.5-Coder, StarCoder, ...).

A FIM prompt is `<prefix token> prefix <suffix token> suffix <middle token>` (prefix-suffix-middle order); the
model then writes the middle and ends it with its end-of-text token. Because the suffix is part of the prompt,
prompt lookup drafts from it too (the middle often repeats names and lines that follow the cursor).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimTokens:
    """The three FIM marker tokens of one tokenizer (as text)."""

    prefix: str
    suffix: str
    middle: str

    def prompt(self, prefix: str, suffix: str) -> str:
        """The FIM prompt text asking for the text between `prefix` and `suffix`."""
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"


FIM_STYLES = (
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)


def fim_tokens(tokenizer) -> FimTokens | None:
    """The first of `FIM_STYLES` whose three markers the tokenizer encodes as one token each, or None."""
    for style in FIM_STYLES:
        if all(_is_one_token(tokenizer, m) for m in (style.prefix, style.suffix, style.middle)):
            return style
    return None


def _is_one_token(tokenizer, text: str) -> bool:
    """Whether `text` encodes as exactly one token that is `text` itself (not an unknown-word token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == text


def describe_styles() -> str:
    """The supported marker sets, for error messages: `<|fim_prefix|>/<|fim_suffix|>/<|fim_middle|> or ...`."""
    return " or ".join("/".join((s.prefix, s.suffix, s.middle)) for s in FIM_STYLES)
