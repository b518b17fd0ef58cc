"""Rank-consistent decisions for tensor-parallel models (`from_pretrained(..., tp_plan="auto")` under torchrun).

Every rank of a tensor-parallel model runs the same forward in lockstep: the collectives inside the model break
(or hang) if two ranks verify trees of different shapes. lookahead's drafts depend only on the committed tokens,
which the ranks share, but a few decisions depend on local state: the measured cost curve, the timings that
correct it during a generation, the draft model's speed, and torch's global random generator (unseeded
sampling). Within `agreement(model)` those are taken from rank 0 (`leader_value`): one broadcast of a float per
timed step, one of the curve per generation, one of the generator state at the start.

Outside tensor parallelism (a single process, or data-parallel ranks that each decode their own prompts)
nothing is broadcast: ranks that do not share a forward must not wait for each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

_GROUP: contextvars.ContextVar[bool] = contextvars.ContextVar("lookahead_tensor_parallel", default=False)


def tensor_parallel(model) -> bool:
    """Whether `model` is split over the ranks of an initialised process group (transformers' `tp_plan`).

    Raises `ValueError` for a tensor-parallel degree smaller than the world (tensor parallelism combined with
    data parallelism): lookahead broadcasts over the whole world and would mix the data-parallel groups."""
    size = int(getattr(model, "tp_size", None) or 1)
    if size <= 1 or not _group_up():
        return False
    world = torch.distributed.get_world_size()
    if size != world:
        raise ValueError(f"lookahead supports tensor parallelism over the whole process group only "
                         f"(tp_size={size}, world size {world})")
    check_head_split(model.config, size)
    return True


def check_head_split(config, size: int) -> None:
    """`ValueError` unless the model's attention heads (and key/value heads) split evenly over `size` ranks
    (transformers loads such a model but its first forward fails with a reshape error)."""
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads and (heads % size or kv_heads % size):
        raise ValueError(f"this model's {heads} attention heads ({kv_heads} key/value heads) cannot be split over "
                         f"{size} tensor-parallel ranks; use a process count that divides {math.gcd(heads, kv_heads)}")


@contextlib.contextmanager
def agreement(model) -> Iterator[bool]:
    """Within the block, `leader_value` hands every rank rank 0's value when `model` is tensor-parallel; on
    entry the ranks adopt rank 0's global random generator state (so unseeded sampling draws alike). Yields
    whether the ranks agree through broadcasts."""
    on = tensor_parallel(model)
    token = _GROUP.set(on)
    try:
        if on:
            torch.set_rng_state(_broadcast_object(torch.get_rng_state()))
        yield on
    finally:
        _GROUP.reset(token)


def active() -> bool:
    """Whether the current generation runs inside `agreement` of a tensor-parallel model."""
    return _GROUP.get()


def is_leader() -> bool:
    """Whether this process decides for the group: rank 0, or any process outside tensor parallelism."""
    return not active() or torch.distributed.get_rank() == 0


def follower_process() -> bool:
    """Whether this process is a rank other than 0 of an initialised process group, inside a generation or not
    (`is_leader` answers for the generation in `agreement` only)."""
    return _group_up() and torch.distributed.get_rank() != 0


def _group_up() -> bool:
    """Whether torch.distributed has an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def leader_value(value: T) -> T:
    """`value` as rank 0 holds it (every rank must call this at the same point), or `value` itself outside
    tensor parallelism. Floats travel as one float64 tensor; anything else pickled."""
    if not active():
        return value
    if isinstance(value, float):
        box = torch.tensor([value], dtype=torch.float64)
        torch.distributed.broadcast(box, src=0)
        return float(box.item())
    return _broadcast_object(value)


def release_process_group() -> None:
    """End the process group a tensor-parallel load started (transformers' `tp_plan` initializes it), after a
    barrier, so that the process exits cleanly: a gloo group left up at interpreter exit can abort the process
    ("terminate called without an active exception", seen once in CI after `lookahead generate --tp` had printed
    its output). Every rank must call it; nothing happens without a process group."""
    if _group_up():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _broadcast_object(value):
    """Rank 0's `value` on every rank (pickled)."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
