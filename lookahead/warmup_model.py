"""The tiny model `kernel_warmup`'s helper generates with: a random Llama in the forms a GGUF model loads in.

Its decoder layers' weights are rounded as GGUF's Q4_1 does (`fma(q, d, m)` per block of 32, float16 d and m; `q4_1`,
also what the tests round weights with) and its tied LM head as Q8_0 (`d · q`, `q8_0`), so `affine_weights` finds the
forms it finds in the default model and the streamed kernel and the compiled decoder stack run on them (the head, in
its exact 8-bit form, keeps its own product, as the default model's does: `argmax_head`); its heads are 64 floats
wide, the default model's. Sizes are otherwise tiny: the compiled kernels depend on the arguments' types, not their
sizes.
"""

from __future__ import annotations

import torch

from .affine_kernel import AFFINE_BLOCK as BLOCK  # GGUF's Q4_1 and Q8_0 blocks: 32 weights
from .config import LookaheadConfig
from .cost_curve import CURVE_SIZES, CostCurve

VOCAB = 512
# Pinned arithmetic (nothing measured): every product of up to 64 rows on the streamed kernel.
WARMUP_CONFIG = LookaheadConfig(default_matmul_rows=0, streamed_matmul_rows=64)
# A fixed cost curve (the plan follows it alone, never the helper's timings), shaped like a CPU's.
WARMUP_CURVE = CostCurve(CURVE_SIZES, (1.0, 1.05, 1.1, 1.2, 1.3, 1.4, 1.7, 2.0, 2.6, 3.2), 0.05)


def warmup_model(seed: int = 0) -> torch.nn.Module:
    """A 2-layer float32 `LlamaForCausalLM` (hidden 128, heads of 64) with 4-bit block layers and an 8-bit block
    tied LM head, in eval mode, with no special tokens."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not model.get_output_embeddings().weight:
                module.weight.copy_(q4_1(module.weight))
        embeddings = model.get_input_embeddings().weight
        embeddings.copy_(q8_0(embeddings))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, None)
    return model


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] rounded as GGUF's Q4_1 does and expanded back to float32 as transformers' GGUF loader does:
    per block of 32, d = float16((max - min) / 15), m = float16(min), q = round((w - min) / d) in 0…15, d·q + m."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    scale = (high - low) / 15
    codes = torch.where(scale > 0, (blocks - low) / torch.where(scale > 0, scale, 1), 0).round().clamp(0, 15)
    return (scale.half().float() * codes + low.half().float()).reshape(n, k)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] rounded as GGUF's Q8_0 does and expanded back: per block of 32, d = float16(max |w| / 127),
    q = round(w / d) in -127…127, d·q."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    codes = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1), 0).round().clamp(-127, 127)
    return (scale * codes.to(torch.int8).float()).reshape(n, k)  # integer codes: a zero weight is +0, never -0


def warmup_prompt(length: int = 80) -> torch.Tensor:
    """[1, length] token ids whose second half repeats the first, so that prompt lookup finds continuations; long
    enough for a prompt's compiled passes (`prefill_kernels.ROWS`)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.randint(0, VOCAB, (1, length // 2), generator=generator)
    return torch.cat([head, head], dim=1)
