"""The server's generation engine: one worker thread running the queued generations, with cancellation.

The model is not thread-safe, so one worker thread runs the generations one at a time, in arrival order (at
most `max_queue` waiting behind the running one; more are refused with `EngineBusy`). Tokens reach the
request's coroutine through an asyncio queue as soon as a step commits them; a client that disconnects sets
its job's cancel flag, which a stopping criterion checks after every committed token; shutting down sets every
job's flag. After each generation, prompt + output go into the `SuffixCache`, which drafts for later requests
(editors re-send almost the same file on every keystroke).

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

from .config import LookaheadConfig
from .hf import Lookahead
from .recycle import RecycleTable
from .server_text import StopText, TextStreamer, first_stop
from .stats import DecodeStats
from .suffix_cache import SuffixCache

log = logging.getLogger("lookahead.server")


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


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: `temperature` 0 is greedy; `top_p` and `seed` only matter when sampling."""

    temperature: float
    top_p: float
    seed: int | None


@dataclass(frozen=True)
class Completion:
    """A finished generation: the completion text (stop string trimmed) and how it ended.

    finish_reason: "stop" (EOS or stop string), "length" (max_tokens or the context), or "cancelled" (the
    client went away or the engine closed; never sent). stats: see `speculation_stats`.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict


@dataclass(frozen=True)
class Delta:
    """Event: the next piece of a job's completion text (never retracted)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """Event: the job's `Completion` (always the last event of a job that did not fail)."""

    completion: Completion


def sampling_kwargs(params: Sampling) -> dict:
    """`generate()` keyword arguments choosing tokens as `params` asks: temperature 0 is greedy, otherwise exact
    sampling with `temperature` and `top_p` (no top-k, as in OpenAI's API). The seed goes to the decoder config
    (see `Engine._generate`)."""
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}


def speculation_stats(stats: DecodeStats) -> dict:
    """The `lookahead` extra field of a response from a `DecodeStats`: tokens per step and friends."""
    return {"tokens_per_step": round(stats.mean_tokens_per_step, 4), "steps": stats.steps,
            "new_tokens": stats.new_tokens, "tokens_per_second": round(stats.tokens_per_second, 2),
            "accepted_by_drafter": dict(stats.accepted_by_drafter)}


class _Cancelled(StoppingCriteria):
    """Stops the generation once `event` is set (the client went away, or the engine is closing)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


@dataclass(eq=False)  # identity semantics: jobs live in a set
class _Job:
    """One generation: prompt ids [1, L], the token budget, stop strings, sampling, cancel flag, event sink."""

    input_ids: torch.Tensor
    max_new_tokens: int
    stops: tuple[str, ...]
    sampling: Sampling
    cancel: threading.Event
    emit: Callable[[Delta | Finished | Exception], None]  # thread-safe, delivers to the request's coroutine


class JobStream:
    """The asynchronous side of one job: iterate `events()`, call `cancel()` when the client is gone."""

    def __init__(self, cancel: threading.Event):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = cancel

    def emit(self, event: Delta | Finished | Exception) -> None:
        """Deliver an event (or the worker's failure) from the worker thread (dropped if the event loop is
        already closed)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """Yield `Delta`s, then one `Finished`; re-raise a worker failure."""
        while True:
            event = await self._queue.get()
            if isinstance(event, Exception):
                raise event
            yield event
            if isinstance(event, Finished):
                return

    async def completion(self) -> Completion:
        """Wait for the job's `Completion` (deltas are skipped); re-raise a worker failure."""
        async for event in self.events():
            if isinstance(event, Finished):
                return event.completion
        raise RuntimeError("generation ended without a result")  # events() always ends with Finished or raises

    def cancel(self) -> None:
        """Ask the worker to stop this job (no-op once it is done)."""
        self._cancel.set()


class Engine:
    """Owns the model, the tokenizer (behind a lock: it is shared by the event loop and the worker) and the
    single generation worker thread."""

    def __init__(self, model, tokenizer, config: LookaheadConfig, cache: SuffixCache | None, max_queue: int):
        self.model, self.tokenizer, self.config, self.cache = model, tokenizer, config, cache
        # Token recycling learns the model's own next-token predictions: kept across requests, like the cache.
        self.recycle_table = RecycleTable(config.recycle_k) if config.recycle_nodes else None
        self.max_queue = max_queue
        eos = model.generation_config.eos_token_id
        self.eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()  # submitted and not finished
        self._closing = False  # set by `cancel_all`: new jobs are refused
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookahead-generate")
        self.last_completion: Completion | None = None  # the latest finished job (reported by /health)

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

    def start(self, input_ids: list[int], max_new_tokens: int, stops: tuple[str, ...],
              params: Sampling) -> JobStream:
        """Queue a generation; returns its `JobStream` (call from the event loop).

        Raises `EngineBusy` when `max_queue` jobs are already waiting behind the running one, `EngineClosed`
        when the engine is shutting down.
        """
        cancel = threading.Event()
        stream = JobStream(cancel)
        job = _Job(torch.tensor([input_ids], dtype=torch.long), max_new_tokens, stops, params, cancel, stream.emit)
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
        """Worker: generate (unless cancelled meanwhile) and report `Finished` or the failure to the job's stream."""
        try:
            prompt_len = job.input_ids.shape[1]
            completion = Completion("", "cancelled", prompt_len, 0, {}) if job.cancel.is_set() \
                else self._generate(job)
            self.last_completion = completion
            job.emit(Finished(completion))
        except Exception as exc:  # reported to its client; the worker keeps serving the others
            log.exception("generation failed")
            job.emit(exc)
        finally:
            with self._lock:
                self._jobs.discard(job)

    def _generate(self, job: _Job) -> Completion:
        """Run `model.generate` with lookahead for one job; feed the suffix cache; return the `Completion`."""
        prompt_len = job.input_ids.shape[1]
        criteria = StoppingCriteriaList([_Cancelled(job.cancel)])
        if job.stops:
            criteria.append(StopText(self.decode, job.stops, prompt_len))
        config = self.config if job.sampling.seed is None else self.config.with_overrides(seed=job.sampling.seed)
        decoder = Lookahead(config, shared_drafter=self.cache, recycle_table=self.recycle_table)
        streamer = TextStreamer(self.decode, job.stops, lambda text: job.emit(Delta(text)))
        output = self.model.generate(
            job.input_ids, attention_mask=torch.ones_like(job.input_ids), max_new_tokens=job.max_new_tokens,
            stopping_criteria=criteria, custom_generate=decoder, lookahead_streamer=streamer,
            **sampling_kwargs(job.sampling))
        new = output[0, prompt_len:].tolist()
        if self.cache is not None:
            self.cache.add(output[0].cpu().numpy())
        text = self.decode(new)
        cut = first_stop(text, job.stops)
        if job.cancel.is_set():
            reason = "cancelled"
        elif cut is not None or (new and new[-1] in self.eos_ids) or len(new) < job.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        return Completion(text if cut is None else text[:cut], reason, prompt_len, len(new),
                          speculation_stats(decoder.last_stats))
