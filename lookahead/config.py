"""`LookaheadConfig`: the one validated home of every speculation knob."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

ATTENTION_CHOICES = ("auto", "sdpa", "triton")


@dataclass(frozen=True)
class LookaheadConfig:
    """Speculation settings, validated on construction (raises `ValueError` naming the bad field).

    Drafters:
      - window: the Jacobi lookahead window, `window_levels × window_columns` tokens iterated every step; its
        harvested n-grams (size `window_levels + 1`) feed the n-gram pool. Off by default (`window_levels=0`):
        on the default model on CPU its rows did not pay for themselves in the drafter ablation (window alone:
        1.15–1.26 tokens per step for 12–13 rows verified; the adaptive planner rested it).
      - pool: n-gram pool proposals keyed by the root token, up to `pool_candidates` per step (0 = off). The
        pool is fed by the window and, when `pool_from_text`, by committed text.
      - prompt lookup: up to `prompt_candidates` continuations of suffix matches in prompt + output (0 = off),
        matching suffixes of `prompt_min_ngram..prompt_max_ngram` tokens.
      - recycle: token recycling, a draft tree of up to `recycle_nodes` nodes (0 = off) grown from the root
        over a table of the target's own top-`recycle_k` next tokens per token, kept from every verification
        forward (see `recycle.py`). `recycle_prior`: rows for tokens no verification has filled yet, counted in
        the model's own text (`recycle_prior.py`): "auto" (the default: the prior shipped for the model, none if
        none is), None or "none" (none) or a prior file's path. `recycle_pairs` (opt-in): keep rows per token pair
        too (the target's top-k after a token, apart for each token before it; seeded from the prior's pair rows)
        and draft from them beside the token's row (`recycle_pairs.py`). Off by default: in the suite (two runs)
        it raised tokens per step by 2% (chat 5%) at 1.4% less speed overall (chat +2-4%, code, math and
        translation -4 to -6%: the planner spends ~0.4 more rows a step on them).
      - shared: up to `shared_candidates` continuations from a cross-request drafter, when one is given.
      - draft model: a chain of up to `draft_tokens` tokens per step, when a draft model is given.
      - head (opt-in): a learned predictor of the token after the root from the target's own last hidden state
        (`draft_head.py`), its `head_candidates` best tokens, a recycled subtree below the first. `draft_head`:
        None (off), "auto" (the head shipped for the model; an error if none is) or a head file's path
        (`head_files.py`). Off by default: on the default model on this CPU it raised tokens per step by a fifth (suite:
        1.51 → 1.81) at about the same speed, its rows and its own forward costing what it saved (see the README).
    Every candidate is at most `max_draft_len` tokens; the merged trie keeps at most `tree_budget` nodes
    besides the root (0 = verify no drafts: plain decoding through the same loop).
    With `adaptive` (the default) `tree_budget` and the window are upper bounds: each step keeps only the
    nodes and window rows that pay for themselves on the measured cost curve (see `budget.py`); with
    `adaptive=False` every step verifies the full tree and window.
    `rest_drafters` (opt-in; with `adaptive`, batch size 1, a plan that may follow timings): where speculation's
    measured throughput falls clearly below a plain step's, take plain steps without drafting for a while, then
    probe again (`rest.py`; off by default until a larger measurement shows it pays: see the README).
    `packed_linear` (CPU, fp32): run the model's linear layers on oneDNN-prepacked weights during generation
    (`packed_linear.py`), which makes a forward of several rows nearly as cheap as one row; speculative and
    plain steps (`off()`) then use the same arithmetic. Products of at most `default_matmul_rows` rows run PyTorch's
    default matmul on the model's own weights instead (the faster kernel for a few rows on some CPUs), larger ones
    up to `streamed_matmul_rows` rows the streamed kernel (`streamed_gemm.py`: the weights streamed from memory once
    for all the rows), larger ones oneDNN; None measures the count on this machine once (`row_kernels.py`, cached beside
    the cost curve), 0 turns that kernel off.
    `lean_layers` (with `packed_linear`): Llama-style decoder layers (Llama, Qwen2, Mistral) run a forward without
    transformers' per-module overhead that computes bit-identical numbers (`lean_layers.py`).
    `fused_layers` (with `lean_layers`): a step whose products all run on the streamed kernel runs each such layer
    as one compiled call (`fused_layer.py`: the same products, its own norms, attention and SiLU, equal to the
    lean forward's to ~1e-6 relative), and a step in which every layer does so runs them all in one call
    (`fused_stack.py`, bit-identical to the per-layer calls).
    `compact_weights` (with `packed_linear` and the streamed kernel): weights whose float32 values have an exact
    4-bit or 8-bit block form (models from GGUF files quantized as Q4_0 / Q4_1 / Q8_0, the default model among
    them) stream from it, checked bit for bit (`affine_weights.py`): the same products, bit for bit, from a fifth
    of the bytes or less.
    `amx_kernel` (with `compact_weights`, on a CPU with AMX): 4-bit block weights run on tile multiply-adds
    (`amx_kernel.py`), where a row costs little beyond the first; float32-accurate (each input split into three
    bfloat16 pieces), but not the streamed kernel's bits, so greedy output matches plain `generate` as closely
    as the streamed kernel's does (a tie within float32 rounding could go either way); 8-bit block weights (the
    default model's LM head) on int8 tile multiply-adds where the CPU has AMX-INT8 (`amx_int8.py`, four int8
    pieces of each input: float32-accurate too).
    `argmax_head` (with `packed_linear` and the streamed kernel; greedy without logits processors or returned
    scores): an LM head held as float32 panels (no exact block form) streams int8 weights and computes exact fp32
    logits only for the tokens a proven error bound cannot rule out as a row's argmax (`argmax_head.py`): the same
    tokens, a quarter of its bytes; a head in its exact 8-bit form (the default model's) keeps its own product.
    `attention`: "auto" attends with the `lookahead_tree` backend (`attention.py`) during generation when the
    model uses SDPA (CPU: grouped-query SDPA without copying key/value heads; CUDA: the Triton tree kernel for
    verification steps); "sdpa" keeps the model's own attention; "triton" forces the backend (CUDA only).
    `adapt_threads` (with a measured cost curve that the plan follows; batches too): while other processes hold
    the cores, steps run on half the threads (one on two cores), and on all again once the cores are free
    (`thread_governor.py`; `benchmarks/bench_busy.py`, 2-core Intel Xeon, session 50: 48 tokens beside one busy
    process took 10.8 s on two fixed threads, 1.42 s governed, 0.53 s on the idle machine).
    `seed` (sampling only): draw the token at sequence index t by Gumbel-max with noise from (seed, t), so the
    same seed gives the same tokens with or without speculation; None samples from a generator seeded by
    torch's global RNG.
    """

    window_levels: int = 0
    window_columns: int = 5
    pool_candidates: int = 4
    pool_from_text: bool = True
    pool_per_key: int = 8
    pool_max_keys: int = 16384
    prompt_candidates: int = 3
    shared_candidates: int = 3
    recycle_nodes: int = 12
    recycle_k: int = 8
    recycle_prior: str | None = "auto"
    recycle_pairs: bool = False
    draft_tokens: int = 4
    head_candidates: int = 3
    draft_head: str | None = None
    prompt_min_ngram: int = 1
    prompt_max_ngram: int = 4
    max_draft_len: int = 8
    tree_budget: int = 16
    adaptive: bool = True
    rest_drafters: bool = False
    packed_linear: bool = True
    default_matmul_rows: int | None = None
    streamed_matmul_rows: int | None = None
    lean_layers: bool = True
    fused_layers: bool = True
    compact_weights: bool = True
    amx_kernel: bool = True
    argmax_head: bool = True
    attention: str = "auto"
    adapt_threads: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_range("window_levels", self.window_levels, 0, 8)
        _check_range("window_columns", self.window_columns, 1, 64)
        _check_range("pool_candidates", self.pool_candidates, 0, 64)
        _check_range("pool_per_key", self.pool_per_key, 1, 256)
        _check_range("pool_max_keys", self.pool_max_keys, 1, 1 << 22)
        _check_range("prompt_candidates", self.prompt_candidates, 0, 64)
        _check_range("shared_candidates", self.shared_candidates, 0, 64)
        _check_range("recycle_nodes", self.recycle_nodes, 0, 256)
        _check_range("recycle_k", self.recycle_k, 1, 64)
        _check_range("draft_tokens", self.draft_tokens, 1, 64)
        if self.recycle_prior is not None and (not isinstance(self.recycle_prior, str) or not self.recycle_prior):
            raise ValueError(f'recycle_prior must be None, "auto", "none" or a prior file path, '
                             f'got {self.recycle_prior!r}')
        _check_range("head_candidates", self.head_candidates, 0, 16)
        if self.draft_head is not None and (not isinstance(self.draft_head, str) or not self.draft_head):
            raise ValueError(f'draft_head must be None, "auto" or a head file path, got {self.draft_head!r}')
        _check_range("prompt_min_ngram", self.prompt_min_ngram, 1, 64)
        _check_range("prompt_max_ngram", self.prompt_max_ngram, self.prompt_min_ngram, 64)
        _check_range("max_draft_len", self.max_draft_len, 1, 256)
        _check_range("tree_budget", self.tree_budget, 0, 1024)
        if self.default_matmul_rows is not None:
            _check_range("default_matmul_rows", self.default_matmul_rows, 0, 64)
        if self.streamed_matmul_rows is not None:
            _check_range("streamed_matmul_rows", self.streamed_matmul_rows, 0, 1024)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, 2**63 - 1)
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {self.attention!r}")
        for name in ("pool_from_text", "recycle_pairs", "adaptive", "rest_drafters", "packed_linear", "lean_layers",
                     "fused_layers", "compact_weights", "amx_kernel", "argmax_head", "adapt_threads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def window_size(self) -> int:
        """Number of window rows verified per step (`levels × columns`, 0 when the window is off)."""
        return self.window_levels * self.window_columns if self.window_levels else 0

    @property
    def pool_ngram_size(self) -> int:
        """n of the pool's n-grams: the window's `levels + 1`, or 4 when the window is off."""
        return self.window_levels + 1 if self.window_levels else 4

    @property
    def drafts_with_head(self) -> bool:
        """Whether a learned draft head is asked for and can draft (a head named, candidates and a tree budget)."""
        return self.draft_head is not None and self.head_candidates > 0 and self.tree_budget > 0

    @property
    def speculates(self) -> bool:
        """Whether any draft can be verified (False means one token per step)."""
        return self.tree_budget > 0 and (self.pool_candidates > 0 or self.prompt_candidates > 0
                                         or self.recycle_nodes > 0 or self.drafts_with_head)

    @property
    def step_rows(self) -> int:
        """The most rows a step verifies per sequence: the root, `tree_budget` draft nodes and the window's rows."""
        return 1 + self.tree_budget + self.window_size

    @classmethod
    def off(cls) -> "LookaheadConfig":
        """A config with speculation turned off: the same loop, one token per step (`--mode off`)."""
        return cls(window_levels=0, pool_candidates=0, prompt_candidates=0, recycle_nodes=0, head_candidates=0,
                   tree_budget=0)

    def with_overrides(self, **overrides) -> "LookaheadConfig":
        """Return a copy with the given fields replaced; unknown names raise `ValueError` listing valid ones."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown lookahead option(s) {unknown}; valid options: {sorted(known)}")
        return replace(self, **overrides)

    def as_dict(self) -> dict:
        """The settings as a plain dict (for stats and benchmark JSON)."""
        return asdict(self)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    """Raise `ValueError` unless `value` is an int in `[low, high]`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
