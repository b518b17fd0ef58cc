"""lookahead's CPU kernels compiled in a helper process while a process imports and loads its model, on the first
use of an installation.

numba compiles lookahead's kernels the first time an installation generates (~60 functions, ~45 s of one core on the
2-core AVX2 machine), and a first run also imports torch and transformers and converts the model's GGUF file (~30 s
more, mostly on one core). So a process whose installation's kernels are not compiled yet
(`numba_cache.helper_wanted`: no helper has run to its end in its cache folder) starts `python -m
lookahead.kernel_warmup` as early as it knows it will generate: the `lookahead` command once its options are read, a
library process at `load_model` or its first `Lookahead` object, whichever comes first. The helper builds a tiny
random Llama whose layers hold exact 4-bit block weights and whose tied LM head 8-bit ones (the forms a Q4_0/Q4_1/Q8_0
GGUF model loads in, the default model's), and generates with it greedily and sampled, with its
arithmetic pinned and a fixed cost curve (nothing measured, one thread), which compiles the kernels a real generation
calls into the same on-disk cache. The first generation waits for it before it packs, measures or generates anything
(`finish`: measurements must not share the cores with a compiler), compiling the drafters' kernels itself meanwhile
(the same model on PyTorch's plain layers, seeded sampling too, `warm("drafting")`: ~13 s of the ~45, then the
model's kernels other than the fused decoder on the layers packed but not fused, ~10 s), then finds the kernels
compiled. The two go in opposite orders (`_runs`): the helper compiles the fused decoder first (~20 s), then the rest
of the model's kernels and token recycling's last; the waiting process starts with token recycling's (compiled when
a `Lookahead` makes its table) and ends with the model's other kernels, so a function is rarely compiled twice. If
the helper fails or runs past WAIT_SECONDS it is stopped, and the generation compiles what is missing itself, as
before. `$LOOKAHEAD_KERNEL_WARMUP=0` turns the helper off; it never starts under torchrun (every rank would start
one) or when `$NUMBA_CACHE_DIR` is the user's. A helper still running when its process exits is stopped.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

import numba

from . import numba_cache

ENV_SWITCH = "LOOKAHEAD_KERNEL_WARMUP"
WAIT_SECONDS = 300.0  # the helper's compile takes ~50 s on the 2-core AVX2 machine
# The helper generates with the model's own arithmetic (the model's kernels, then the drafters' — found in the cache
# when the command compiled them meanwhile: `finish`).
HELPERS = ((sys.executable, "-m", "lookahead.kernel_warmup", "model"),)
_running: list[subprocess.Popen] = []
_started: list[bool] = []  # non-empty once this process started its helpers
# The helper's first generation: layers on float32 panels (no block search) and the LM head's plain argmax, so that
# the fused decoder (~20 s of the ~50) is the first thing it compiles, ~1 s after its imports instead of ~11 s.
FUSED_FIRST = {"compact_weights": False, "argmax_head": False}


def start(commands: tuple[tuple[str, ...], ...] = HELPERS) -> bool:
    """Start the helpers (`commands`) when this installation's kernels are not compiled yet
    (`numba_cache.helper_wanted`), unless switched off or under torchrun, at most once per process; a notice on
    stderr says so. Whether they started."""
    if _started or not numba_cache.helper_wanted() or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba.config.CACHE_DIR), "OMP_NUM_THREADS": "1",
           "NUMBA_NUM_THREADS": "1"}
    _started.append(True)  # once per process: not again while it waits (its warm-up makes a `Lookahead`) or after
    _running.extend(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for command in commands)
    _say("lookahead: compiling its CPU kernels for this installation in a helper process meanwhile, once "
         f"(~1 minute on a 2-core CPU; cached in {numba.config.CACHE_DIR})")
    return True


def finish(timeout: float = WAIT_SECONDS) -> bool | None:
    """Wait for the helpers this process started (None when there are none): True when they compiled the kernels
    (the generation's own compile notice is then spent), False when one failed or was stopped `timeout` seconds
    after the wait began."""
    if not _running:
        return None
    helpers, deadline = list(_running), time.monotonic() + timeout
    _running.clear()
    numba_cache.compiling_notice()  # spent: the warm-up generation below does not announce a compile
    if any(helper.poll() is None for helper in helpers):
        _say("lookahead: waiting for the kernel compile to finish")
        _compile_drafting_here()
    done = all([_waited(helper, deadline) for helper in helpers])
    if all(helper.returncode != -getattr(signal, "SIGKILL", 9) for helper in helpers):
        numba_cache.mark_helper_done()  # ended by itself (a helper that failed would fail again): not started again
    if not done:
        numba_cache.restore_compiling_notice()
    return done


def _compile_drafting_here() -> None:
    """While the helper compiles the fused decoder, this process compiles the drafters' and verification's (warm-up
    generations on PyTorch's plain layers) and the model's other kernels (on layers packed but not fused) instead of
    idling (`warm("drafting")`); a failure is left to the generation."""
    try:
        warm("drafting")
    except Exception:  # noqa: BLE001 — whatever failed compiles (or fails) again in the generation itself
        pass


def _waited(helper: subprocess.Popen, deadline: float) -> bool:
    """Whether `helper` exited successfully by `deadline` (`time.monotonic`); stopped if it is still running."""
    try:
        return helper.wait(max(deadline - time.monotonic(), 0.0)) == 0
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()
        return False


def _say(message: str) -> None:
    """A one-line notice on stderr."""
    print(message, file=sys.stderr, flush=True)


def _stop() -> None:
    """Stop a helper still running when the process exits (a command that failed before it generated)."""
    while _running:
        helper = _running.pop()
        helper.kill()
        helper.wait()


atexit.register(_stop)


def main(part: str = "model") -> None:
    """The helper process: `warm(part)` on one thread, at the lowest CPU priority (it compiles on cores the process
    that started it leaves idle, and does not slow what that process runs meanwhile: a user timing plain `generate`
    before lookahead's first generation, say)."""
    _lower_priority()
    import torch

    torch.set_num_threads(1)
    warm(part)


def _lower_priority() -> None:
    """This process at the lowest scheduling priority (niceness 19) where the system has niceness; else unchanged."""
    try:
        os.nice(19 - os.nice(0))
    except (AttributeError, OSError):
        pass


def warm(part: str) -> None:
    """Generate with a tiny block-weight model greedily and sampled (see the module docstring), on the model's own
    arithmetic (`part` "model") or, for "drafting", on PyTorch's plain layers (seeded sampling too) and then on
    layers packed but not fused, compiling what that calls, in the order `_runs` gives."""
    if part not in ("model", "drafting"):
        raise ValueError(f"part must be 'model' or 'drafting', got {part!r}")
    from .hf import Lookahead
    from .warmup_model import WARMUP_CURVE, warmup_model, warmup_prompt

    model, prompt = warmup_model(), warmup_prompt()
    for config, kwargs, seed in _runs(part):
        decoder = Lookahead(config, cost_curve=WARMUP_CURVE, seed=seed)
        model.generate(prompt, max_new_tokens=32, custom_generate=decoder, **kwargs)
    if part == "model":
        _tile_products()


def _tile_products() -> None:
    """A prompt-sized product on each tile kernel this CPU runs (`streamed_gemm._launch_groups`): a real prompt's
    products run there only where the machine's measurement chose the tile kernels for them, which the pinned
    arithmetic above does not."""
    import torch

    from . import affine_weights, amx_kernel, streamed_gemm
    from .warmup_model import q4_1, q8_0

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    rows = 2 * streamed_gemm.PREPARED_APART * amx_kernel.GROUP
    for form in (q4_1, q8_0):
        packed = affine_weights.pack_stacked([form(weight)])
        if packed.kind in streamed_gemm.AMX_KINDS:
            streamed_gemm.product(torch.zeros(rows, 128), packed)


def _runs(part: str) -> list[tuple]:
    """(config, generate keywords, seed) of each warm-up generation of `part`. The helper ("model") compiles the
    fused decoder first (`FUSED_FIRST`), then the rest of the model's kernels (speculation off), then the drafters
    other than token recycling, then everything; the command ("drafting") starts with token recycling's kernels (the
    largest share, compiled when its table is made), then the model's kernels other than the fused decoder (the
    layers packed but not fused: the weights' block search, the LM head's kernels), which the helper, busy with the
    fused decoder, then finds compiled, so the two processes rarely compile the same function."""
    from .config import LookaheadConfig
    from .warmup_model import WARMUP_CONFIG

    greedy, sampled = {"do_sample": False}, {"do_sample": True, "temperature": 0.7, "top_p": 0.95}
    if part == "drafting":
        plain = WARMUP_CONFIG.with_overrides(packed_linear=False)
        unfused = WARMUP_CONFIG.with_overrides(fused_layers=False)
        return [(plain, greedy, None), (plain, sampled, None), (plain, sampled, 0), (unfused, greedy, None)]
    off, default = LookaheadConfig.off(), LookaheadConfig()
    off = WARMUP_CONFIG.with_overrides(**{name: value for name, value in off.as_dict().items()
                                          if value != getattr(default, name)})  # speculation off, as `off()` has it
    unrecycled = WARMUP_CONFIG.with_overrides(recycle_nodes=0)
    return [(off.with_overrides(**FUSED_FIRST), greedy, None), (off, greedy, None), (unrecycled, greedy, None),
            (unrecycled, sampled, None), (WARMUP_CONFIG, greedy, None), (WARMUP_CONFIG, sampled, None)]


if __name__ == "__main__":  # pragma: no cover - run as a helper process
    main(*sys.argv[1:])
