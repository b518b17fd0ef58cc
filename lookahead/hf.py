"""Integration with `transformers`: the `Lookahead` callable for `generate(custom_generate=...)` and `patch`.

transformers (5.x) calls a callable `custom_generate` in place of its decoding loop, after preparing the
generation config, logits processors, stopping criteria and the cache. Arguments that its own `_sample`
declares (`streamer`) are not forwarded to a callable, and `tokenizer=` is dropped too, so `patch` reroutes
them: the streamer travels as `lookahead_streamer=`, stop strings become a ready `StopStringCriteria`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import kernel_warmup
from .argmax_head import argmax_logits, bounded_head
from .attention import tree_attention
from .cache import make_compactable
from .calibration import cost_curve_for, say
from .compat import CACHE_KWARG, check_transformers
from .config import LookaheadConfig
from .cost_curve import CostCurve
from .decoder import Decoder
from .distributed import agreement, follower_process, leader_value
from .draft_model import check_draft_model
from .head_files import configured_head
from .lean_layers import lean_layers
from .numba_cache import compiling_notice
from .packed_linear import packed_linears, packed_weights
from .recycle import RecycleTable
from .recycle_prior import configured_prior
from .request import DecodeRequest
from .row_kernels import RowKernels, apply_row_kernels, row_kernels_for
from .stats import DecodeStats
from .thread_governor import ThreadGovernor, governor_for
from .top_p import faster_warpers

_UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
_PATCH_ATTR = "_lookahead_patch"
# Decoding methods `generate` would run that lookahead's loop does not: named in the refusal.
_REFUSED_MODES = {GenerationMode.CONTRASTIVE_SEARCH: "contrastive search (penalty_alpha with top_k > 1)",
                  GenerationMode.DOLA_GENERATION: "DoLa decoding (dola_layers)",
                  GenerationMode.CONSTRAINED_BEAM_SEARCH: "constrained beam search (constraints / force_words_ids)",
                  GenerationMode.GROUP_BEAM_SEARCH: "group beam search (num_beam_groups)"}
_MODEL_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → the RLock its generations hold
_LOCKS_GUARD = threading.Lock()


class Lookahead:
    """Exact lookahead decoding as a `custom_generate` callable.

    `model.generate(**inputs, custom_generate=Lookahead(window_levels=2, ...))` returns exactly what
    `model.generate(**inputs)` returns for greedy decoding, faster; with `do_sample=True` it samples exactly
    from the same distribution (with `seed=...`: the same tokens as `LookaheadConfig.off()` with that seed).
    Keyword arguments override fields of `config` (a `LookaheadConfig`); `shared_drafter` adds a cross-request
    drafter (`drafters.SharedDrafter`); `draft_model` adds a small causal LM with the target's vocabulary that
    drafts a chain of `config.draft_tokens` tokens each step (exact too: sampled chains are accepted with
    min(1, p/q)). The token-recycling table (`recycle.RecycleTable`) persists across this object's calls;
    pass `recycle_table` to share one between objects (the server does). `cost_curve` (a `CostCurve`) replaces
    the measured curve, and the plan then follows it alone, never the generation's own step timings: the same
    inputs give the same steps on any machine (`benchmarks/bench_drafts.py` compares drafting this way).
    Batches of left-padded prompts are decoded sequence by sequence exactly as plain batched `generate`.
    After each call `last_stats` holds its `DecodeStats` (an interrupted call's: what it did until then). A streamer is
    passed as `lookahead_streamer=` (HF does not forward `streamer=` to a callable; `lookahead.patch` reroutes it
    automatically).
    """

    def __init__(self, config: LookaheadConfig | None = None, shared_drafter=None, draft_model=None,
                 recycle_table: RecycleTable | None = None, cost_curve: CostCurve | None = None, **overrides):
        if config is not None and not isinstance(config, LookaheadConfig):
            raise TypeError(f"config must be a LookaheadConfig (or None), got {type(config).__name__}; pass "
                            "options as keywords instead: Lookahead(tree_budget=8, ...)")
        self.config = (config or LookaheadConfig()).with_overrides(**overrides)
        if cost_curve is not None and not isinstance(cost_curve, CostCurve):
            raise TypeError(f"cost_curve must be a lookahead CostCurve, got {type(cost_curve).__name__}")
        self.fixed_curve = cost_curve
        if draft_model is not None and not callable(getattr(draft_model, "can_generate", None)):
            raise TypeError("draft_model must be a loaded transformers causal LM (e.g. lookahead.load_model(path)[0]), "
                            f"got {type(draft_model).__name__}")
        self.shared_drafter, self.draft_model = shared_drafter, draft_model
        kernel_warmup.start()  # an installation's first use: the model's kernels compile in a helper meanwhile
        if recycle_table is None and self.config.recycle_nodes:
            recycle_table = RecycleTable.for_config(self.config)
        self.recycle_table = recycle_table
        self.last_stats: DecodeStats | None = None

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                 generation_config: GenerationConfig, synced_gpus: bool = False,
                 lookahead_streamer=None, **model_kwargs):
        """Decoding loop called by `generate`; returns what `generate` would (sequences or a dict output).
        Raises `compat.UnsupportedTransformers` on a transformers release lookahead does not support."""
        check_transformers()
        kernel_warmup.finish()  # a helper compiling the kernels (an installation's first use) is done before anything
        notice = compiling_notice()
        if notice:
            say(follower_process(), notice)
        with _model_lock(model), generation_arithmetic(model, self.config):
            return self._generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  lookahead_streamer, model_kwargs)

    def _generate(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                  lookahead_streamer, model_kwargs):
        """The body of `__call__`, run with the linear layers chosen by the config."""
        _check_generation_config(generation_config, input_ids)
        max_slots = generation_config.max_length + self.config.tree_budget + self.config.window_size
        make_compactable(model_kwargs.get(CACHE_KWARG), model.config, max_slots, input_ids.shape[0])
        if self.draft_model is not None:
            check_draft_model(model, self.draft_model)
        if lookahead_streamer is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"a streamer needs batch size 1 (got {input_ids.shape[0]} prompts); "
                                 "drop streamer= or generate one prompt at a time")
            lookahead_streamer.put(input_ids.cpu())  # generate only feeds the prompt to its own `streamer=`
        batch = input_ids.shape[0]
        request = DecodeRequest(input_ids=input_ids, prompt_kwargs=model_kwargs,
                                logits_processor=faster_warpers(logits_processor),
                                stopping_criteria=stopping_criteria, max_length=generation_config.max_length,
                                streamer=lookahead_streamer, shared_drafter=self.shared_drafter,
                                cost_curve=self._cost_curve(model), do_sample=bool(generation_config.do_sample),
                                batch_cost_curve=self._cost_curve(model, batch) if batch > 1 else None,
                                draft_model=self.draft_model, pad_token_id=_pad_token(generation_config),
                                recycle_table=self.recycle_table,
                                pad_finished=any(hasattr(c, "eos_token_id") for c in stopping_criteria),
                                record_scores=_wants_scores(generation_config),
                                copies=generation_config.num_return_sequences or 1,
                                follow_timings=self.fixed_curve is None, draft_head=configured_head(model, self.config),
                                recycle_prior=configured_prior(model, self.config),
                                uncached=_uncached_length(model, input_ids, generation_config, model_kwargs),
                                threads=self._threads(model))
        decoder = Decoder(model, self.config, request)
        self.last_stats = decoder.stats  # this call's, also when it is interrupted
        with (argmax_logits(model, self.config.argmax_head and _argmax_only(request)) as argmax,
              decoder.governed_threads()):
            decoder.stats.setup_time = build_layouts(model, argmax, batch * self.config.step_rows)
            try:
                sequences = decoder.run()
            finally:
                decoder.stats.total_time += decoder.stats.setup_time  # the whole call's time
        if not generation_config.return_dict_in_generate:
            return sequences
        scores, logits = decoder.step_outputs(sequences) if request.record_scores else (None, None)
        return GenerateDecoderOnlyOutput(sequences=sequences, **{CACHE_KWARG: decoder.cache},
                                         scores=scores if generation_config.output_scores else None,
                                         logits=logits if generation_config.output_logits else None)

    def _threads(self, model) -> ThreadGovernor | None:
        """The model's thread governor when the config adapts threads and the plan follows timings, else None."""
        return governor_for(model) if self.config.adapt_threads and self.fixed_curve is None else None

    def _cost_curve(self, model, batch: int = 1):
        """The model's measured cost curve at `batch` sequences when the budget adapts (measured once up to the
        most rows a step of this configuration verifies, then cached on disk; the fixed `cost_curve` instead when one
        was given), else None."""
        drafts = self.config.speculates or (self.draft_model is not None and self.config.tree_budget > 0)
        if not (self.config.adaptive and drafts):
            return None
        if self.fixed_curve is not None:
            return replace(self.fixed_curve, batch=batch)
        curve = cost_curve_for(model, batch=batch, rows=self.config.step_rows)
        return leader_value(curve)  # one curve for all tensor-parallel ranks


@contextlib.contextmanager
def generation_arithmetic(model, config: LookaheadConfig, refresh: bool = False) -> Iterator[str]:
    """Within the block the model computes as lookahead generation does (prepacked linear layers, each row count's
    products on the kernel measured fastest on this machine (`row_kernels`), the tree attention backend, lean
    decoder layers, as `config` asks), for speculative and plain steps alike, and tensor-parallel ranks take
    their timing-dependent decisions from rank 0 (`distributed.agreement`); yields a one-line description.
    `refresh`: measure the kernel choice again instead of reading its cache."""
    kernel_warmup.finish()  # nothing is packed, compiled or measured while a helper compiles the kernels
    packing = (config.packed_linear, config.compact_weights, config.amx_kernel)
    with (agreement(model), packed_linears(model, *packing) as packed,
          tree_attention(model, config.attention) as tree,
          lean_layers(model, config.lean_layers, config.fused_layers) as lean):
        linear = "PyTorch's default linear layers"
        if packed:
            kernels = chosen_row_kernels(model, config, refresh)
            apply_row_kernels(model, kernels)
            amx = getattr(model, "_lookahead_compact_weights", None) == "amx"
            streamed = "the streamed kernel (block-form weights: the AMX kernels)" if amx else "the streamed kernel"
            linear = f"{packed} linear layers prepacked: {kernels.describe(streamed)}"
        attention = "lookahead_tree attention" if tree else f"{model.config._attn_implementation} attention"
        yield f"{linear}, {attention}" + (f", {lean} lean decoder layers" if lean else "")


def build_layouts(model, argmax: bool, rows: int) -> float:
    """Build now what the first forward of a generation would otherwise build inside its prefill — the streamed
    kernel's panels of every packed weight whose steps' products (of up to `rows` rows) it computes, and for the LM
    head, when greedy steps take their argmax from it (`argmax`), its bounded int8 copy instead — and return the
    seconds it took (~0.6 s for the default model on the 2-core AVX2 machine, once per process and model; ~0 once
    built, until a weight changes). Call it inside `generation_arithmetic` (and `argmax_logits`):
    `DecodeStats.setup_time` reports it apart from the prefill. Layouts only a prefill reads build on first use."""
    start = time.perf_counter()
    head = model.get_output_embeddings()
    head_packed = getattr(head, "packed", None)
    for packed in packed_weights(model):
        if packed.default_rows < min(packed.streamed_rows, rows):
            if packed is head_packed and argmax:
                bounded_head(head)
            else:
                packed.streamed()
    return time.perf_counter() - start


def chosen_row_kernels(model, config: LookaheadConfig, refresh: bool = False) -> RowKernels:
    """The row counts `config` pins (`default_matmul_rows`, `streamed_matmul_rows`), the measured ones
    (`row_kernels_for`) for those it leaves to the machine."""
    pinned = RowKernels(config.default_matmul_rows or 0, config.streamed_matmul_rows or 0)
    if config.default_matmul_rows is not None and config.streamed_matmul_rows is not None:
        return pinned
    measured = row_kernels_for(model, refresh=refresh)
    return RowKernels(measured.default_rows if config.default_matmul_rows is None else pinned.default_rows,
                      measured.streamed_rows if config.streamed_matmul_rows is None else pinned.streamed_rows,
                      measured.large)


def _uncached_length(model, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict) -> int | None:
    """How many of each prompt's last tokens are not in the cache the caller passed (`model_kwargs[CACHE_KWARG]`),
    when the prompt repeats the cached ones — None: feed the whole prompt. transformers' own prefill slices the same
    way: a prompt as long as the attention mask (or its recorded length once an all-ones mask was dropped) restarts
    from the cache and only its uncached tail is forwarded; inputs_embeds always hold the whole sequence."""
    cache = model_kwargs.get(CACHE_KWARG)
    if cache is None:
        return None
    cached = cache.get_seq_length()
    if model_kwargs.get("inputs_embeds") is not None:
        return model_kwargs["inputs_embeds"].shape[1] - cached
    mask = model_kwargs.get("attention_mask")
    mask_length = mask.shape[1] if mask is not None else getattr(config, "_mask_length", -1)
    return input_ids.shape[1] - cached if mask_length == input_ids.shape[1] else None


def _pad_token(config: GenerationConfig) -> int | None:
    """The pad token `generate` fills finished sequences with (prepared by transformers; may be None)."""
    pad = getattr(config, "_pad_token_tensor", None)
    return int(pad) if pad is not None else config.pad_token_id


def _argmax_only(request: DecodeRequest) -> bool:
    """Whether the generation reads nothing from the logits but each row's argmax and drafts: greedy, no logits
    processor, no returned scores (the condition for `argmax_head.argmax_logits`)."""
    return not request.do_sample and not request.record_scores and len(request.logits_processor) == 0


def _wants_scores(config: GenerationConfig) -> bool:
    """Whether `generate` must return per-token scores or logits."""
    return bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))


def _model_lock(model) -> threading.RLock:
    """The lock a generation holds on `model`: generation swaps the model's layers and kernels in and out for the
    call, so calls from several threads run one after the other (re-entrant for a nested call in one thread)."""
    with _LOCKS_GUARD:
        return _MODEL_LOCKS.setdefault(model, threading.RLock())


def _check_generation_config(config: GenerationConfig, input_ids: torch.Tensor) -> None:
    """Raise `ValueError` naming any generation option lookahead cannot honour exactly."""
    mode = config.get_generation_mode()
    if mode in _REFUSED_MODES:
        raise ValueError(f"lookahead does not support {_REFUSED_MODES[mode]}; use plain model.generate for it")
    if config.use_cache is False:
        raise ValueError("lookahead decodes with the KV cache (use_cache=False was passed); drop use_cache=False "
                         "(the tokens do not change) or use plain model.generate")
    if (config.num_beams or 1) > 1:
        raise ValueError(f"lookahead does not support beam search (num_beams={config.num_beams}); "
                         "use plain model.generate for beam search")
    if config.return_dict_in_generate:
        for name in _UNSUPPORTED_OUTPUTS:
            if getattr(config, name, False):
                raise ValueError(f"lookahead cannot return {name.removeprefix('output_')} "
                                 f"({name}=True); with return_dict_in_generate it returns `sequences`, "
                                 "`scores` (output_scores) and `logits` (output_logits)")


def patch(model, config: LookaheadConfig | None = None, **overrides) -> Lookahead:
    """Make `model.generate(...)` use lookahead decoding (this instance only; undo with `unpatch`).

    Same arguments and return value as before. Returns the `Lookahead` object (read `.last_stats` there).
    Raises `ValueError` if `model` is not a decoder-only transformers generative model or is already patched.
    """
    if not (isinstance(model, PreTrainedModel) and isinstance(model, GenerationMixin) and model.can_generate()):
        raise ValueError(f"lookahead.patch needs a transformers generative model, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"lookahead does not support encoder-decoder models ({type(model).__name__})")
    if _PATCH_ATTR in model.__dict__:
        raise ValueError("this model is already patched by lookahead; call lookahead.unpatch(model) first")
    decoder = Lookahead(config, **overrides)
    original = model.generate
    model.__dict__["generate"] = functools.wraps(original)(functools.partial(_patched_generate, original, decoder))
    model.__dict__[_PATCH_ATTR] = decoder
    return decoder


def unpatch(model) -> None:
    """Restore the model's own `generate`. Raises `ValueError` if the model is not patched."""
    if _PATCH_ATTR not in model.__dict__:
        raise ValueError("this model is not patched by lookahead")
    del model.__dict__["generate"]
    del model.__dict__[_PATCH_ATTR]


def _patched_generate(original, decoder: Lookahead, *args, **kwargs):
    """`generate` with lookahead: reroutes the streamer and stop strings that transformers would drop."""
    kwargs = inspect.signature(original).bind(*args, **kwargs).arguments  # a positional config is read like a kwarg
    kwargs.update(kwargs.pop("kwargs", {}))
    if kwargs.get("custom_generate") is not None:
        raise ValueError("custom_generate= cannot be combined with a lookahead-patched model; unpatch it first")
    if kwargs.get("assistant_model") is not None:
        raise ValueError("assistant_model= (assisted generation) cannot be combined with lookahead; "
                         "unpatch the model to use HF assisted generation")
    config = kwargs.get("generation_config") or original.__self__.generation_config
    if kwargs.get("token_healing", config.token_healing):
        raise ValueError("lookahead does not support token_healing (transformers does not hand the tokenizer to a "
                         "custom decoding loop); unpatch the model to heal the prompt's last tokens")
    streamer = kwargs.pop("streamer", None)
    if streamer is not None:
        kwargs["lookahead_streamer"] = streamer
    _reroute_stop_strings(original.__self__, kwargs)
    return original(custom_generate=decoder, **kwargs)


def _reroute_stop_strings(model, kwargs: dict) -> None:
    """Turn `stop_strings` (kwarg or generation config) into a `StopStringCriteria` in `stopping_criteria`.

    transformers' priority holds: the kwarg, else the passed config's, else the model's generation config's.
    The strings then leave every config transformers reads (it would ask for the tokenizer it dropped).
    """
    passed = kwargs.get("generation_config")
    if "stop_strings" in kwargs:
        stop_strings = kwargs["stop_strings"]
    else:
        stop_strings = (passed.stop_strings if passed is not None else None) or model.generation_config.stop_strings
    if not stop_strings:
        return
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
    if passed is not None and passed.stop_strings:
        kwargs["generation_config"] = passed = copy.deepcopy(passed)
        passed.stop_strings = None
    if "stop_strings" in kwargs or model.generation_config.stop_strings:
        kwargs["stop_strings"] = None  # a None in the passed config would be filled from the model's
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
