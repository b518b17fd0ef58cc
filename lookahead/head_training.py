"""Making a draft head (`draft_head.py`) for a model by self-distillation: no outside text, only the model's own.

1. `distill`: the model writes its own training text, batch by batch in the order of `kinds`: "chat" samples user
   messages in its chat template (the text of a user turn up to where the message goes, then T = 1) and answers
   them greedily (lookahead, batched); "plain" continues short openings of code and prose ("def ", "The ", ...);
   "grounded" samples a passage of prose, then answers a request about it (summarize it, its main idea, its key
   points) with the passage in the user turn, as summarization and retrieval-augmented prompts do. A
   teacher-forced forward of each text gives, at every position, the final normed hidden state (what the LM head
   reads) and the model's argmax there: the head's inputs and labels.
2. `fit`: a `HeadNet` learns, at every position t, to predict the model's argmax at t + 1 from the hidden state at
   t and the embedding of the token at t + 1 (cross-entropy over the `vocab_size` tokens the labels use most;
   AdamW, one-cycle schedule), reporting held-out top-1 accuracy after every epoch; from scratch or from an
   existing head (`start`: more texts, more epochs).
3. `head_weights` gives the tensors `head_files.save_head` writes.

The head only proposes drafts, so nothing here can change an output: a poor head costs speed, never tokens.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .draft_head import block_count, rms_norm
from .hidden_tap import hidden_tap

PLAIN_OPENINGS = ("def ", "import ", "class ", "# ", "The ", "In ", "from ", "    ")
PROSE_OPENINGS = ("The ", "In ", "A ", "When ", "Many ", "Scientists ", "Our ", "After ")
GROUNDED_REQUESTS = ("Summarize the text above in a few sentences.", "What is the main idea of the text above?",
                     "List the key points of the text above.", "Using only the text above, explain what it says.")
KINDS = ("chat", "grounded", "chat", "plain")  # the batches of one round of `distill`, in order
_MARKER = "\u2063LOOKAHEAD-USER-TEXT\u2063"


@dataclass
class Example:
    """One distilled text: ids [n] int64, hidden [n, size] float16 (the LM head's input at each position) and
    argmax [n] int64 (the model's greedy choice after each position)."""

    ids: torch.Tensor
    hidden: torch.Tensor
    argmax: torch.Tensor


def user_turn_prefix(tokenizer) -> str:
    """The chat-template text that precedes a user message (system turn included). Raises `ValueError` when the
    tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("distilling a draft head needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    return text[: text.index(_MARKER)]


def distill(model, tokenizer, sequences: int, seed: int = 0, batch: int = 32, user_tokens: int = 64,
            answer_tokens: int = 128, passage_tokens: int = 160, kinds: tuple[str, ...] = KINDS,
            progress: Callable[[str], None] | None = None, dtype: torch.dtype | None = None) -> list[Example]:
    """At least `sequences` texts written by `model` itself (see the module docstring), batch by batch; `kinds`
    the batches' kinds in turn ("chat", "plain", "grounded"). `dtype`: a copy of the model in this dtype writes and
    reads the texts instead (None: the model as it is), by plain `generate`. On the 2-core Intel Xeon with AMX
    (session 51), batched greedy of the default model: 362 tokens/s in bfloat16 against 213 in float32 at 32 texts,
    540 at 128; bfloat16's labels agreed with float32's argmax at 98.4% of positions (a head only proposes: a wrong
    label costs hits, never tokens). Raises `ValueError` for another kind."""
    from .hf import Lookahead
    from .config import LookaheadConfig

    unknown = set(kinds) - {"chat", "plain", "grounded"}
    if unknown or not kinds:
        raise ValueError(f"distill kinds are 'chat', 'plain' and 'grounded', got {sorted(unknown) or 'none'}")
    torch.manual_seed(seed)
    tokenizer = copy.deepcopy(tokenizer)  # padded on the left, with a pad token: the caller's stays as it is
    end = tokenizer.eos_token_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token else tokenizer.convert_ids_to_tokens(0)
    tokenizer.padding_side = "left"
    if dtype is None or dtype == model.dtype:
        writer = _Writer(model, tokenizer, end, tokenizer.pad_token_id, Lookahead(LookaheadConfig.off()), Lookahead())
    else:
        model = copy.deepcopy(model).to(dtype)
        writer = _Writer(model, tokenizer, end, tokenizer.pad_token_id, None, None)
    prefix, examples, start = user_turn_prefix(tokenizer), [], time.perf_counter()
    round_ = 0
    while len(examples) < sequences:
        kind = kinds[round_ % len(kinds)]
        if kind == "plain":
            texts = writer.sampled([PLAIN_OPENINGS[i % len(PLAIN_OPENINGS)] for i in range(batch)], user_tokens,
                                   keep_prompt=True)
        elif kind == "grounded":
            passages = writer.sampled([PROSE_OPENINGS[i % len(PROSE_OPENINGS)] for i in range(batch)],
                                      passage_tokens, keep_prompt=True)
            texts = writer.answered([f"{tokenizer.decode(p, skip_special_tokens=True).strip()}\n\n"
                                     f"{GROUNDED_REQUESTS[i % len(GROUNDED_REQUESTS)]}"
                                     for i, p in enumerate(passages)], answer_tokens)
        else:
            users = [u.strip() for u in writer.sampled([prefix] * batch, user_tokens)]
            texts = writer.answered([u for u in users if len(u) > 8], answer_tokens)
        examples += [_teacher_forced(model, ids) for ids in texts]
        round_ += 1
        if progress is not None:
            progress(f"distilled {len(examples)}/{sequences} texts, {sum(len(e.ids) for e in examples)} positions, "
                     f"{time.perf_counter() - start:.0f}s")
    return examples[:sequences]


@dataclass
class _Writer:
    """The model writing text for `distill`: `sample` decodes with T = 1, `greedy` answers (the `custom_generate`
    of each; None: `generate`'s own); `end` / `pad` token ids."""

    model: nn.Module
    tokenizer: object
    end: int | None
    pad: int
    sample: Callable | None
    greedy: Callable | None

    def sampled(self, prompts: list[str], tokens: int, keep_prompt: bool = False) -> list:
        """Texts the model samples (T = 1) after each of `prompts`: decoded strings, or the prompt and sample's
        token ids [n] (cut after the first end token) when `keep_prompt`."""
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens,
                                      eos_token_id=self.end, pad_token_id=self.pad, custom_generate=self.sample)
        if keep_prompt:
            return [_trimmed(row, enc.attention_mask[i], self.end) for i, row in enumerate(out)]
        return [self.tokenizer.decode(row[enc.input_ids.shape[1]:], skip_special_tokens=True) for row in out]

    def answered(self, messages: list[str], tokens: int) -> list[torch.Tensor]:
        """Each user message in the chat template with the model's greedy answer, as token ids [n] (padding dropped,
        cut after the first end token)."""
        chats = [self.tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                                    add_generation_prompt=True) for m in messages]
        if not chats:
            return []
        enc = self.tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(**enc, do_sample=False, max_new_tokens=tokens, eos_token_id=self.end,
                                      pad_token_id=self.pad, custom_generate=self.greedy)
        return [_trimmed(row, enc.attention_mask[i], self.end) for i, row in enumerate(out)]


def _trimmed(row: torch.Tensor, mask: torch.Tensor, end: int | None) -> torch.Tensor:
    """`row` without its left padding (per `mask` over the prompt part) and cut after the first end token that
    follows the prompt."""
    prompt_len = len(mask)
    prompt, rest = row[:prompt_len][mask.bool()], row[prompt_len:]
    stop = (rest == end).nonzero() if end is not None else []
    if len(stop):
        rest = rest[: int(stop[0]) + 1]
    return torch.cat([prompt, rest])


def _teacher_forced(model, ids: torch.Tensor) -> Example:
    """The `Example` of the text `ids` [n]: one forward, the LM head's input (`hidden_tap`) and the argmaxes."""
    with torch.no_grad(), hidden_tap(model) as tap:
        logits = model(ids[None]).logits
        hidden = tap.last()
    return Example(ids.clone(), hidden[0].to(torch.float16), logits[0].argmax(-1))


class HeadNet(nn.Module):
    """The trainable form of `draft_head.DraftHead` (the same function): fc over [hidden; next embedding], then
    `blocks` residual SiLU-gated MLP blocks with RMS norms; scores over given output embedding rows."""

    def __init__(self, size: int, inter: int, blocks: int = 1):
        super().__init__()
        self.fc = nn.Linear(2 * size, size)
        self.norms = nn.ParameterList(nn.Parameter(torch.ones(size)) for _ in range(blocks))
        self.gates = nn.ModuleList(nn.Linear(size, inter, bias=False) for _ in range(blocks))
        self.ups = nn.ModuleList(nn.Linear(size, inter, bias=False) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(inter, size, bias=False) for _ in range(blocks))
        for down in self.downs:
            nn.init.zeros_(down.weight)  # each block starts as the identity

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor]) -> "HeadNet":
        """The net holding `weights` (as `head_weights` names them; sizes and block count read from them)."""
        blocks = block_count(weights)
        inter, size = weights["blocks.0.gate"].shape
        net = cls(size, inter, blocks)
        own = head_weights(net)
        with torch.no_grad():
            for name, value in own.items():
                _parameter(net, name).copy_(weights[name].float())
        return net

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, size] head states for hidden [T, size] and the next tokens' embeddings [T, size]."""
        a = self.fc(torch.cat([hidden, embedded], dim=-1))
        for norm, gate, up, down in zip(self.norms, self.gates, self.ups, self.downs):
            x = rms_norm(a, norm)
            a = a + down(F.silu(gate(x)) * up(x))
        return a


def head_weights(net: HeadNet) -> dict[str, torch.Tensor]:
    """The tensors of `net` under the names `draft_head.DraftHead` reads."""
    return {name: _parameter(net, name).detach().clone() for name in _names(len(net.norms))}


def _names(blocks: int) -> list[str]:
    """The tensor names of a head with `blocks` blocks."""
    return ["fc.weight", "fc.bias"] + [f"blocks.{i}.{part}" for i in range(blocks)
                                       for part in ("norm", "gate", "up", "down")]


def _parameter(net: HeadNet, name: str) -> torch.Tensor:
    """The parameter of `net` that the head tensor `name` holds."""
    if name.startswith("fc."):
        return getattr(net.fc, name[3:])
    _, i, part = name.split(".")
    if part == "norm":
        return net.norms[int(i)]
    return {"gate": net.gates, "up": net.ups, "down": net.downs}[part][int(i)].weight


def label_vocabulary(examples: list[Example], vocab_size: int, total: int) -> torch.Tensor:
    """The (at most) `vocab_size` token ids most often the label (the argmax after a position's next token),
    most frequent first; `total` the model's vocabulary size."""
    counts = torch.bincount(torch.cat([e.argmax[1:] for e in examples]), minlength=total)
    return counts.argsort(descending=True)[: min(vocab_size, int((counts > 0).sum()))]


BATCH_TEXTS = 8  # texts per optimizer step


def fit(examples: list[Example], embeddings: torch.Tensor, vocab_size: int = 8192, epochs: int = 6,
        inter: int | None = None, blocks: int = 1, lr: float = 1e-3, seed: int = 0, held_out: float = 0.05,
        start: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None,
        progress: Callable[[str], None] | None = None) -> tuple[HeadNet, torch.Tensor, dict]:
    """Train a `HeadNet` on `examples` (see the module docstring) over the model's input `embeddings` [V, size]
    (`inter`: the blocks' width, None = 8/3 of the hidden size, 1536 for the default model; `start`: (weights,
    vocabulary) of an existing head to train on from, whose sizes and vocabulary are kept); returns (net, output
    vocabulary [n] int64, {"top1": held-out top-1 accuracy per epoch, "positions": n})."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    held, train = _split(examples, held_out, generator)
    table = embeddings.detach().float()
    vocab = label_vocabulary(train, vocab_size, table.shape[0]) if start is None else start[1].long()
    remap = torch.full((table.shape[0],), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    out_rows = table[vocab]
    net = HeadNet(table.shape[1], inter or 8 * table.shape[1] // 3, blocks) if start is None else \
        HeadNet.from_weights(start[0])
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    steps = max(1, epochs * math.ceil(len(train) / BATCH_TEXTS))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps + 1, pct_start=0.05)
    report = {"top1": [], "positions": sum(len(e.ids) - 1 for e in train)}
    for epoch in range(epochs):
        shuffled = torch.randperm(len(train), generator=generator).tolist()
        for i in range(0, len(shuffled), BATCH_TEXTS):
            loss = _batch_loss(net, [train[j] for j in shuffled[i:i + BATCH_TEXTS]], table, remap, out_rows)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        report["top1"].append(accuracy(net, held, table, remap, out_rows))
        if progress is not None:
            progress(f"epoch {epoch + 1}/{epochs}: held-out top-1 {report['top1'][-1]:.3f}")
    return net.eval(), vocab, report


def _split(examples: list[Example], held_out: float, generator: torch.Generator) -> tuple[list, list]:
    """(held-out texts, training texts): a `held_out` share of `examples` (at least one when there are two or more)
    drawn at random with `generator`."""
    order = torch.randperm(len(examples), generator=generator).tolist()
    n_held = max(1, int(len(examples) * held_out)) if len(examples) > 1 else 0
    return [examples[i] for i in order[:n_held]], [examples[i] for i in order[n_held:]]


def _states(net: HeadNet, example: Example, table: torch.Tensor) -> torch.Tensor:
    """[n - 1, size] head states of `example`'s positions 0 … n - 2."""
    return net(example.hidden[:-1].float(), table[example.ids[1:]])


def _batch_loss(net, batch: list[Example], table, remap, out_rows) -> torch.Tensor:
    """Mean cross-entropy of the labels in the head's vocabulary over the positions of `batch` (the head reads
    each position alone, so all of them go through it at once)."""
    hidden = torch.cat([example.hidden[:-1] for example in batch]).float()
    following = torch.cat([example.ids[1:] for example in batch])
    labels = remap[torch.cat([example.argmax[1:] for example in batch])]
    scores = net(hidden, table[following]) @ out_rows.T
    return F.cross_entropy(scores, labels, ignore_index=-100, reduction="sum") / max(int((labels >= 0).sum()), 1)


def accuracy(net: HeadNet, examples: list[Example], table, remap, out_rows) -> float:
    """How often the head's top-1 is the model's next argmax, over every position of `examples` (labels outside
    the head's vocabulary count as misses); 0 without examples."""
    hits, count = 0, 0
    with torch.no_grad():
        for example in examples:
            best = (_states(net, example, table) @ out_rows.T).argmax(-1)
            hits += int((best == remap[example.argmax[1:]]).sum())
            count += len(best)
    return hits / count if count else 0.0
