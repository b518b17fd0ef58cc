"""A learned predictor of the token after the root, from the target's own last hidden state (an EAGLE-style head).

The drafts that miss most are at the first position after the root: the token after the one the step's own logits
just chose. Copying drafters guess it from earlier text (prompt lookup, the pool) or from the last time the root
token was verified (recycling), blind to what the model is saying now. The head reads what the model itself
computed: the final normed hidden state h of the row that chose the root (the LM head's input) and the root's
embedding e, and predicts the model's own next choice:

    a = W_fc [h; e] + b_fc
    a = a + W_down (silu(W_gate rms(a)) * W_up rms(a))     (one or more such blocks, each with its own norm)
    scores = E_out a,   E_out = the model's input embedding rows of the head's output vocabulary

It is trained by self-distillation (`head_training.py`): its labels are the target's own greedy choices, so what it
predicts is what greedy verification accepts. It only proposes: verification is unchanged, so outputs stay exact
whatever the head says (a wrong or mismatched head costs speed, never tokens).

Its linear layers run on the streamed kernel from int8 copies (`streamed_gemm.quantize`; a head's proposals only
need to be near), ~3.3 M weights plus the output rows (2048 × 576 for the default model): ~4.5 MB a step. A head of
one block runs as one compiled call (`head_kernel`: its dozen small operations dispatched one by one cost more than
its products); other heads as PyTorch operations around the same products. Without the streamed kernel (or for a
model not in fp32) they run as plain fp32 products.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from . import streamed_gemm
from .head_kernel import CompiledHead

NORM_EPS = 1e-5
# Output tokens a head scores (the first of its vocabulary, which head files list most frequent first). Measured on
# the default model's head (the suite's first 4 prompts per category, 96 greedy tokens each): top-1 right 30.2% of
# the time over 8192 tokens, 29.8% over the first 2048 (chat 39.3% / 38.3%), from a quarter of the output rows'
# bytes — a step reads the head's weights from memory, so its bytes are its time.
OUTPUT_TOKENS = 2048


@dataclass(frozen=True)
class HeadProposal:
    """The head's best next tokens after a root: tokens [k] int64, best first, and their probabilities [k]
    float32 under the head's softmax over its output vocabulary."""

    tokens: np.ndarray
    probs: np.ndarray


class DraftHead:
    """A trained head (see the module docstring) bound to a model's input embeddings [V, size].

    weights: {"fc.weight" [size, 2 · size], "fc.bias" [size], for each block i "blocks.i.norm" [size],
    "blocks.i.gate" / "blocks.i.up" [inter, size], "blocks.i.down" [size, inter]}; vocab: [n] int64 the token ids
    of its output rows, most frequent first (the first `max_outputs` are scored; None: all). Raises `ValueError` when
    the shapes do not fit each other or the embeddings."""

    def __init__(self, weights: dict[str, torch.Tensor], vocab: torch.Tensor, embeddings: torch.Tensor,
                 max_outputs: int | None = OUTPUT_TOKENS):
        self.embeddings = embeddings.detach()
        size = self.embeddings.shape[1]
        check_weights(weights, size)
        vocab = vocab.long()[:max_outputs]
        if vocab.dim() != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= self.embeddings.shape[0]:
            raise ValueError(f"a draft head's vocabulary must be token ids below {self.embeddings.shape[0]}")
        self.vocab = vocab.numpy()
        self.blocks = block_count(weights)
        device = self.embeddings.device
        streamed = device.type == "cpu" and self.embeddings.dtype == torch.float32 and streamed_gemm.available()
        linear = _Int8Linear if streamed else _Linear
        w = {name: value.detach().float().to(device).contiguous() for name, value in weights.items()}
        self.fc = linear(w["fc.weight"], w["fc.bias"])
        self.norms = [w[f"blocks.{i}.norm"] for i in range(self.blocks)]
        self.gate_up = [linear(torch.cat([w[f"blocks.{i}.gate"], w[f"blocks.{i}.up"]])) for i in range(self.blocks)]
        self.down = [linear(w[f"blocks.{i}.down"]) for i in range(self.blocks)]
        self.out = linear(self.embeddings[vocab].float().contiguous())
        self.compiled = CompiledHead(self.fc.weight, [g.weight for g in self.gate_up], [d.weight for d in self.down],
                                     self.out.weight, self.norms, NORM_EPS) if streamed and self.blocks == 1 else None

    def propose(self, hidden: torch.Tensor, root: int, k: int) -> HeadProposal:
        """The head's `k` most likely tokens after `root`, given `hidden` [size], the target's final normed hidden
        state of the row that chose `root`."""
        if self.compiled is not None:
            rows, probs = self.compiled.propose(np.ascontiguousarray(hidden.detach().float().cpu().numpy()),
                                                self.embeddings[root].numpy(), min(k, len(self.vocab)))
            found = rows >= 0  # a non-finite hidden state leaves no score to rank: nothing is proposed
            return HeadProposal(self.vocab[rows[found]], probs[found])
        x = torch.cat([hidden.detach().float().view(1, -1).to(self.embeddings.device),
                       self.embeddings[root].float().view(1, -1)], dim=1)
        a = self.fc(x)
        for norm, gate_up, down in zip(self.norms, self.gate_up, self.down):
            gate, up = gate_up(rms_norm(a, norm)).chunk(2, dim=1)
            a = a + down(F.silu(gate) * up)
        scores = self.out(a)[0]
        top = torch.topk(scores, min(k, scores.shape[0]))
        probs = torch.softmax(scores, dim=0)[top.indices]
        return HeadProposal(self.vocab[top.indices.cpu().numpy()], probs.cpu().numpy().astype(np.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight * x / sqrt(mean(x²) + eps)` over the last dimension (the head's block norm)."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


def block_count(weights: dict[str, torch.Tensor]) -> int:
    """How many residual blocks `weights` holds (blocks.0 … blocks.n-1)."""
    n = 0
    while f"blocks.{n}.down" in weights:
        n += 1
    return n


def check_weights(weights: dict[str, torch.Tensor], size: int) -> None:
    """Raise `ValueError` unless `weights` is a head for hidden size `size` (see `DraftHead`)."""
    def shape(name):
        if name not in weights:
            raise ValueError(f"a draft head needs the tensor {name!r}")
        return tuple(weights[name].shape)

    if shape("fc.weight") != (size, 2 * size) or shape("fc.bias") != (size,):
        raise ValueError(f"draft head's fc is {shape('fc.weight')}, the model's hidden size needs ({size}, {2 * size})")
    if block_count(weights) == 0:
        raise ValueError("a draft head needs at least one block (blocks.0.*)")
    for i in range(block_count(weights)):
        inter = shape(f"blocks.{i}.gate")[0]
        expected = {"norm": (size,), "gate": (inter, size), "up": (inter, size), "down": (size, inter)}
        for part, dims in expected.items():
            name = f"blocks.{i}.{part}"
            if shape(name) != dims:
                raise ValueError(f"draft head tensor {name} is {shape(name)}, expected {dims}")


class _Linear:
    """`x @ weightᵀ + bias` in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Int8Linear:
    """`x @ weightᵀ + bias` on the streamed kernel from an int8 copy of the weight (one scale per output row)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = replace(streamed_gemm.quantize(weight), bias=None if bias is None else bias.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return streamed_gemm.product(x, self.weight)
