"""The server's generation engine: one worker thread running the queued generations, with cancellation.

The model is not thread-safe, so one worker thread runs the generations one at a time, in arrival order (at
most `max_queue` waiting behind the running one; more are refused with `EngineBusy`). Tokens reach the
request's coroutine through an asyncio queue as soon as a step commits them; a client that disconnects sets
its job's cancel flag, which a stopping criterion checks after every committed token; shutting down sets every
job's flag. After each generation, prompt + output go into the `SuffixCache`, which drafts for later requests
(editors re-send almost the same file on every keystroke), and their keys and values stay in the `PromptCache`,
from which the next request that starts the same way forwards only the rest of its prompt.

The engine knows nothing of HTTP: it raises `EngineError`s, which the app (`lookahead.server`) answers with
status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from .compat import CACHE_KWARG
from .config import LookaheadConfig
from .fim import describe_styles, fim_tokens
from .hf import Lookahead
from .prompt_cache import PromptCache
from .recycle import RecycleTable
from .server_logprobs import TokenLogprobs, token_logprobs
from .server_text import StopText, TextStreamer, first_stop
from .stats import DecodeStats
from .suffix_cache import SuffixCache

log = logging.getLogger("lookahead.server")

MAX_SEED = 2**63 - 1  # `LookaheadConfig.seed`'s range
# What `Engine.warm_up` generates from: repetitive code, so its steps verify drafts as a request's do.
WARM_UP_TEXT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
WARM_UP_TOKENS = 16


class EngineError(Exception):
    """A request the engine cannot take; the message says why in one line."""


class EngineBusy(EngineError):
    """`max_queue` generations already wait behind the running one."""

    def __init__(self, waiting: int):
        super().__init__(f"server busy: {waiting} generations waiting; retry later")
        self.waiting = waiting


class EngineClosed(EngineError):
    """The engine is shutting down: new jobs are refused and running ones cancelled."""

    def __init__(self):
        super().__init__("server is shutting down; the generation was cancelled")


class NoChatTemplate(EngineError):
    """The tokenizer has no chat template, so chat messages cannot become a prompt."""

    def __init__(self):
        super().__init__("this model's tokenizer has no chat template; use /v1/completions")


class NoFimTokens(EngineError):
    """The tokenizer has no fill-in-the-middle tokens, so a suffix cannot go into the prompt."""

    def __init__(self):
        super().__init__(f"suffix: this model's tokenizer has no fill-in-the-middle tokens ({describe_styles()}); "
                         "omit suffix")


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: `temperature` 0 is greedy; `top_p` and `seed` only matter when sampling."""

    temperature: float
    top_p: float
    seed: int | None


WARM_UP_RUNS = (Sampling(0.0, 1.0, None), Sampling(0.7, 0.95, 0))  # greedy, then sampled as chat clients do


@dataclass(frozen=True)
class Completion:
    """A finished generation: the completion text (stop string trimmed) and how it ended.

    finish_reason: "stop" (EOS or stop string), "length" (max_tokens or the context), or "cancelled" (the
    client went away or the engine closed; never sent). stats: what the decoder did (empty when cancelled
    before it started). logprobs: when the job asked for them.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: DecodeStats
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prompt cache


@dataclass(frozen=True)
class Delta:
    """Event: the next piece of sample `index`'s completion text (never retracted)."""

    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    """Event: sample `index`'s `Completion` (the samples of a job finish in index order)."""

    index: int
    completion: Completion


def sampling_kwargs(params: Sampling) -> dict:
    """`generate()` keyword arguments choosing tokens as `params` asks: temperature 0 is greedy, otherwise exact
    sampling with `temperature` and `top_p` (no top-k, as in OpenAI's API). The seed goes to the decoder config
    (see `Engine._generate`)."""
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}


class _Cancelled(StoppingCriteria):
    """Stops the generation once `event` is set (the client went away, or the engine is closing)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


@dataclass(frozen=True)
class JobSpec:
    """What one request asks the engine for: `samples` completions of prompt `input_ids`, each at most
    `max_new_tokens` long and ended by any of `stops`; `logprobs`: how many alternatives per token to report
    (None: no logprobs)."""

    input_ids: list[int]
    max_new_tokens: int
    stops: tuple[str, ...]
    sampling: Sampling
    samples: int = 1
    logprobs: int | None = None


@dataclass(eq=False)  # identity semantics: jobs live in a set
class _Job:
    """One queued `JobSpec`: its prompt as a tensor [1, L], the cancel flag and the event sink."""

    spec: JobSpec
    input_ids: torch.Tensor
    cancel: threading.Event
    emit: Callable[[Delta | Finished | Exception], None]  # thread-safe, delivers to the request's coroutine


class JobStream:
    """The asynchronous side of one job: iterate `events()`, call `cancel()` when the client is gone."""

    def __init__(self, cancel: threading.Event, samples: int):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = cancel
        self.samples = samples

    def emit(self, event: Delta | Finished | Exception) -> None:
        """Deliver an event (or the worker's failure) from the worker thread (dropped if the event loop is
        already closed)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """Yield each sample's `Delta`s and its `Finished`, sample after sample; re-raise a worker failure."""
        finished = 0
        while finished < self.samples:
            event = await self._queue.get()
            if isinstance(event, Exception):
                raise event
            finished += isinstance(event, Finished)
            yield event

    async def completions(self) -> list[Completion]:
        """Wait for every sample's `Completion`, in index order (deltas are skipped); re-raise a worker failure."""
        return [event.completion async for event in self.events() if isinstance(event, Finished)]

    def cancel(self) -> None:
        """Ask the worker to stop this job (no-op once it is done)."""
        self._cancel.set()


class Engine:
    """Owns the model, the tokenizer (behind a lock: it is shared by the event loop and the worker) and the
    single generation worker thread."""

    def __init__(self, model, tokenizer, config: LookaheadConfig, cache: SuffixCache | None, max_queue: int,
                 cache_requests: bool = True, prompt_cache: PromptCache | None = None):
        """cache: the cross-request drafter (None: none); cache_requests: whether each request's prompt + output
        goes into it (False: it drafts from what it holds, e.g. a datastore, and learns nothing); prompt_cache:
        the keys and values of the latest texts, reused by a request that starts the same way (None: none)."""
        self.model, self.tokenizer, self.config, self.cache = model, tokenizer, config, cache
        self.prompt_cache = prompt_cache
        self.cache_requests = cache_requests
        # Token recycling learns the model's own next-token predictions: kept across requests, like the cache.
        self.recycle_table = RecycleTable.for_config(config) if config.recycle_nodes else None
        self.max_queue = max_queue
        self.fim = fim_tokens(tokenizer)
        eos = model.generation_config.eos_token_id
        self.eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()  # submitted and not finished
        self._closing = False  # set by `cancel_all`: new jobs are refused
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookahead-generate")
        self.last_completion: Completion | None = None  # the latest finished job (reported by /health)

    def warm_up(self) -> None:
        """Generate a few tokens from `WARM_UP_TEXT`, greedy and sampled, as a request would but keeping nothing
        (no suffix or prompt cache, a recycling table of its own, no `last_completion`): what a process does once
        before its first generation runs at full speed — the layers' packing, the kernels loaded from numba's
        cache, the row-kernel choice and cost curve read or measured — is done before the first request. Call
        it before serving (`lookahead serve` does)."""
        ids = torch.tensor([self.encode(WARM_UP_TEXT)], dtype=torch.long)
        for sampling in WARM_UP_RUNS:
            config = self.config.with_overrides(seed=sampling.seed) if sampling.seed is not None else self.config
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=WARM_UP_TOKENS,
                                custom_generate=Lookahead(config), **sampling_kwargs(sampling))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (the same call as `lookahead generate`)."""
        with self._tokenizer_lock:
            return self.tokenizer(text).input_ids

    def chat_text(self, messages: list[dict]) -> str:
        """The chat template applied to `messages` with the generation prompt; `NoChatTemplate` without one."""
        if not self.tokenizer.chat_template:
            raise NoChatTemplate()
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def fim_text(self, prefix: str, suffix: str) -> str:
        """The fill-in-the-middle prompt for the text between `prefix` and `suffix`; `NoFimTokens` when the
        tokenizer has no FIM tokens."""
        if self.fim is None:
            raise NoFimTokens()
        return self.fim.prompt(prefix, suffix)

    def decode(self, ids: list[int]) -> str:
        """Text of completion token ids, special tokens (EOS) left out."""
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (valid token ids are below it)."""
        return self.model.config.get_text_config().vocab_size

    @property
    def queued(self) -> int:
        """Jobs submitted and not finished (the running one included)."""
        return len(self._jobs)

    def start(self, spec: JobSpec) -> JobStream:
        """Queue a job; returns its `JobStream` (call from the event loop).

        Raises `EngineBusy` when `max_queue` jobs are already waiting behind the running one, `EngineClosed`
        when the engine is shutting down.
        """
        cancel = threading.Event()
        stream = JobStream(cancel, spec.samples)
        job = _Job(spec, torch.tensor([spec.input_ids], dtype=torch.long), cancel, stream.emit)
        with self._lock:
            if self._closing:
                raise EngineClosed()
            if len(self._jobs) > self.max_queue:  # one of them is running
                raise EngineBusy(len(self._jobs) - 1)
            self._jobs.add(job)
        self._executor.submit(self._run, job)
        return stream

    def cancel_all(self) -> None:
        """Refuse new jobs and cancel every submitted one (each running job ends within one step)."""
        with self._lock:
            self._closing = True
            for job in self._jobs:
                job.cancel.set()

    @property
    def closing(self) -> bool:
        """Whether `cancel_all` was called (the engine is shutting down)."""
        return self._closing

    def close(self) -> None:
        """Cancel every job and wait for the worker to drain."""
        self.cancel_all()
        self._executor.shutdown(wait=True)

    def _run(self, job: _Job) -> None:
        """Worker: run the job, or report its failure to its stream."""
        try:
            self._generate(job)
        except Exception as exc:  # reported to its client; the worker keeps serving the others
            log.exception("generation failed")
            job.emit(exc)
        finally:
            with self._lock:
                self._jobs.discard(job)

    def _generate(self, job: _Job) -> None:
        """Generate the job's samples one after another, each streamed and then reported as `Finished`; once
        the job is cancelled, the remaining samples finish at once as "cancelled"."""
        for index in range(job.spec.samples):
            if job.cancel.is_set():
                completion = Completion("", "cancelled", len(job.spec.input_ids), 0, DecodeStats())
            else:
                completion = self._sample(job, index)
            self.last_completion = completion
            job.emit(Finished(index, completion))

    def _generate_reusing(self, job: _Job, **kwargs):
        """`model.generate(job's prompt, **kwargs)` from the prompt cache's keys and values where the prompt starts
        as a kept text does, its own keys and values kept there afterwards; returns (the output, its sequences
        [1, L + n], how many prompt tokens were reused)."""
        reuse, cached = {}, 0
        if self.prompt_cache is not None:
            reuse[CACHE_KWARG], cached = self.prompt_cache.take(job.spec.input_ids, self.model.config)
        output = self.model.generate(job.input_ids, attention_mask=torch.ones_like(job.input_ids), **kwargs, **reuse)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences  # a dict output with logprobs
        if reuse:
            self.prompt_cache.keep(sequences[0].tolist(), reuse[CACHE_KWARG])
        return output, sequences, cached

    def _sample(self, job: _Job, index: int) -> Completion:
        """Run `model.generate` with lookahead for sample `index` of a job (`_generate_reusing`); feed the suffix
        cache; return the `Completion`. With a seed, sample i is drawn with seed + i (so it is what a one-sample
        request with that seed gets)."""
        spec, prompt_len = job.spec, job.input_ids.shape[1]
        criteria = StoppingCriteriaList([_Cancelled(job.cancel)])
        if spec.stops:
            criteria.append(StopText(self.decode, spec.stops, prompt_len))
        seed = spec.sampling.seed
        if seed is not None:
            seed = (seed + index) % (MAX_SEED + 1)
        config = self.config if seed is None else self.config.with_overrides(seed=seed)
        decoder = Lookahead(config, shared_drafter=self.cache, recycle_table=self.recycle_table)
        streamer = TextStreamer(self.decode, spec.stops, lambda text: job.emit(Delta(index, text)))
        scored = {} if spec.logprobs is None else {"return_dict_in_generate": True, "output_logits": True}
        output, sequences, cached = self._generate_reusing(
            job, max_new_tokens=spec.max_new_tokens, stopping_criteria=criteria, custom_generate=decoder,
            lookahead_streamer=streamer, **sampling_kwargs(spec.sampling), **scored)
        new = sequences[0, prompt_len:].tolist()
        if self.cache is not None and self.cache_requests:
            self.cache.add(sequences[0].cpu().numpy())
        text = self.decode(new)
        cut = first_stop(text, spec.stops)
        text = text if cut is None else text[:cut]
        if job.cancel.is_set():
            reason = "cancelled"
        elif cut is not None or (new and new[-1] in self.eos_ids) or len(new) < spec.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        logprobs = None
        if spec.logprobs is not None:
            with self._tokenizer_lock:
                logprobs = token_logprobs(torch.cat(output.logits), new, spec.logprobs, self.tokenizer, text)
        return Completion(text, reason, prompt_len, len(new), decoder.last_stats, logprobs, cached)
