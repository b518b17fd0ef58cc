"""`kernel_warmup`: on an installation's first run the kernels compile in a helper process; the command waits for
it before it packs, measures or generates, and finds the default model's kernels compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import pytest
import torch

from lookahead import affine_weights, amx_kernel, kernel_warmup, numba_cache
from lookahead.warmup_model import q4_1, q8_0, warmup_model

# Generates with the default model (pinned arithmetic, a fixed cost curve: nothing measured) greedily and sampled,
# then prints how many of lookahead's compiled functions' signatures numba had to compile (not in its cache).
MISSES = """
import sys, numba, torch
from lookahead import Lookahead
from lookahead.models import load_model
from lookahead.warmup_model import WARMUP_CONFIG, WARMUP_CURVE
model, tokenizer = load_model()
ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
long = tokenizer("def f(n): return n if n < 2 else f(n - 1) + f(n - 2). " * 8, return_tensors="pt").input_ids
for prompt, kwargs in ((ids, {"do_sample": False}), (ids, {"do_sample": True, "temperature": 0.7}),
                       (long, {"do_sample": False})):
    decoder = Lookahead(WARMUP_CONFIG, cost_curve=WARMUP_CURVE)
    model.generate(prompt, max_new_tokens=16, custom_generate=decoder, **kwargs)
missed = {f"{value.py_func.__module__}.{value.py_func.__name__}" for name, module in list(sys.modules.items())
          if name.startswith("lookahead") for value in vars(module).values()
          if isinstance(value, numba.core.dispatcher.Dispatcher) and sum(value.stats.cache_misses.values())}
print(len(missed), *sorted(missed))
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process whose installation has no compiled kernels yet (in lookahead's own cache folder, here an empty
    temporary one), the helper switched on; no helper left over."""
    monkeypatch.setattr(numba_cache, "_fresh", True)
    monkeypatch.setattr(numba_cache, "_own_folder", True)
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv(kernel_warmup.ENV_SWITCH, "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(kernel_warmup, "_started", [])
    compiled_here = []
    monkeypatch.setattr(kernel_warmup, "_compile_drafting_here", lambda: compiled_here.append(numba_cache.is_fresh()))
    yield compiled_here
    kernel_warmup._stop()


def _helper(code: str, *more: str) -> tuple[tuple[str, ...], ...]:
    """Helper commands running `code` (and each of `more`) in a fresh interpreter."""
    return tuple((sys.executable, "-c", each) for each in (code, *more))


def test_a_helper_that_compiled_spends_the_compile_notice(fresh, capsys):
    assert kernel_warmup.start(_helper("pass"))
    assert "helper process" in capsys.readouterr().err
    assert kernel_warmup.finish() is True
    assert not numba_cache.is_fresh() and numba_cache.compiling_notice() is None
    assert kernel_warmup.finish() is None  # one wait: the next generation goes straight on
    assert kernel_warmup.start(_helper("pass")) is False  # one helper a process, even while the kernels are missing


def test_the_wait_for_the_helper_starts_no_other_helper(fresh, monkeypatch):
    """The waiting process's own warm-up generation makes a `Lookahead` (which starts a helper where one is
    wanted): it must not start a second one, nor wait for it."""
    monkeypatch.setattr(kernel_warmup, "_compile_drafting_here",
                        lambda: fresh.append(kernel_warmup.start(_helper("pass"))))
    assert kernel_warmup.start(_helper("import time; time.sleep(1)"))
    assert kernel_warmup.finish() is True and fresh == [False]


def test_a_failed_helper_leaves_the_compile_to_the_command(fresh):
    assert kernel_warmup.start(_helper("pass", "raise SystemExit(3)"))
    assert kernel_warmup.finish() is False
    assert numba_cache.is_fresh()  # the generation still says it compiles


def test_a_late_helper_is_stopped(fresh, capsys):
    assert kernel_warmup.start(_helper("import time; time.sleep(60)", "import time; time.sleep(60)"))
    helpers = list(kernel_warmup._running)
    assert kernel_warmup.finish(timeout=0.5) is False
    assert all(helper.poll() is not None for helper in helpers)
    assert "waiting for the kernel compile" in capsys.readouterr().err
    assert numba_cache.is_fresh()


def test_while_the_helper_compiles_the_command_compiles_the_drafters_without_a_second_notice(fresh):
    assert kernel_warmup.start(_helper("import time; time.sleep(1)"))
    assert kernel_warmup.finish() is True
    assert fresh == [False]  # compiled here once, the notice already spent (its generation prints none)


def test_a_helper_done_before_the_wait_leaves_nothing_to_compile_here(fresh):
    kernel_warmup.start(_helper("pass"))
    kernel_warmup._running[0].wait()
    assert kernel_warmup.finish() is True and fresh == []


def test_a_helper_still_running_at_exit_is_stopped(fresh):
    kernel_warmup.start(_helper("import time; time.sleep(60)"))
    helper = kernel_warmup._running[0]
    kernel_warmup._stop()
    assert helper.poll() is not None and kernel_warmup.finish() is None


@pytest.mark.parametrize("code, marked", [("pass", True), ("raise SystemExit(3)", True),
                                         ("import time; time.sleep(60)", False)], ids=["done", "failed", "stopped"])
def test_a_helper_that_ended_by_itself_is_not_started_again_for_a_partly_compiled_folder(fresh, code, marked):
    """A folder with compiled code but no helper run to its end (a first run stopped midway) still wants the helper;
    once one ended by itself there (a failure would recur), it does not; one stopped at the deadline did not end."""
    numba_cache.compiling_notice()  # the folder holds compiled code: no compile notice, the helper still wanted
    assert not numba_cache.is_fresh() and numba_cache.helper_wanted()
    assert kernel_warmup.start(_helper(code))
    kernel_warmup.finish(timeout=10.0)
    assert numba_cache.helper_wanted() is not marked  # for the next process
    assert kernel_warmup.start(_helper("pass")) is False  # this one started its helper already


def test_a_folder_the_user_chose_never_wants_the_helper(monkeypatch, tmp_path):
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba_cache, "_own_folder", False)
    assert not numba_cache.helper_wanted()
    monkeypatch.setattr(numba_cache, "_own_folder", True)
    assert numba_cache.helper_wanted()


@pytest.mark.parametrize("setting", ["compiled", "switched off", "torchrun", "started"])
def test_no_helper_when_it_is_not_needed_or_not_wanted(fresh, monkeypatch, setting):
    if setting == "compiled":
        monkeypatch.setattr(numba_cache, "helper_wanted", lambda: False)
    elif setting == "switched off":
        monkeypatch.setenv(kernel_warmup.ENV_SWITCH, "0")
    elif setting == "torchrun":
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        assert kernel_warmup.start(_helper("pass"))
    assert kernel_warmup.start(_helper("pass")) is False
    assert len(kernel_warmup._running) == (setting == "started")


def test_a_helper_takes_a_known_part_only():
    with pytest.raises(ValueError, match="part must be"):
        kernel_warmup.main("everything")


def test_the_helper_compiles_the_model_first_and_recycling_last_the_command_recycling_first():
    helper, command = kernel_warmup._runs("model"), kernel_warmup._runs("drafting")
    assert all(not config.speculates and config.packed_linear for config, _, _ in helper[:2])  # the model's kernels
    assert not helper[0][0].compact_weights and not helper[0][0].argmax_head  # the fused decoder before the rest
    assert helper[1][0].compact_weights and helper[1][0].argmax_head
    recycles = [config.recycle_nodes > 0 for config, _, _ in helper]
    assert recycles == sorted(recycles) and recycles[-1] and helper[2][0].speculates
    assert {kwargs["do_sample"] for _, kwargs, _ in helper[2:4]} == {False, True}  # the other drafters, both ways
    assert command[0][0].recycle_nodes > 0 and not any(config.packed_linear for config, _, _ in command[:3])
    assert [seed for _, _, seed in command] == [None, None, 0, None]
    assert command[-1][0].packed_linear and not command[-1][0].fused_layers  # the model's kernels but the decoder


def test_the_warmup_model_holds_the_default_models_block_forms():
    model = warmup_model()
    layers = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    assert len(layers) == 14 and all(affine_weights.affine_form(w) is not None for w in layers)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert affine_weights.scaled_form(model.get_output_embeddings().weight) is not None
    assert affine_weights.affine_form(torch.randn(8, 64)) is None  # the forms are found only where they hold


@pytest.mark.parametrize("spread", [0.02, 1.0, 30.0])
def test_block_roundings_have_the_exact_forms(spread):
    weight = torch.randn(16, 64) * spread
    four, eight = q4_1(weight), q8_0(weight)
    assert affine_weights.affine_form(four) is not None and affine_weights.scaled_form(eight) is not None
    assert affine_weights.affine_form(weight) is None and affine_weights.scaled_form(weight) is None


# Runs the helper's part (argv[1] "model") or the command's ("drafting"), printing each function numba compiles (not
# those it compiles for a function being compiled), in order.
COMPILES = """
import sys
from numba.core import event
from lookahead import kernel_warmup

class Printer(event.Listener):
    depth = 0
    def on_start(self, ev):
        self.depth += 1
        if self.depth == 1 and ev.data.get("dispatcher") is not None:
            print(ev.data["dispatcher"].py_func.__qualname__, flush=True)
    def on_end(self, ev):
        self.depth -= 1

event.register("numba:compile", Printer())
kernel_warmup.main(sys.argv[1]) if sys.argv[1] == "model" else kernel_warmup.warm(sys.argv[1])
"""


def test_after_the_helper_the_default_model_generates_without_compiling(tmp_path):
    """The helper and the command's part, run at once on a fresh cache, leave the default model nothing to compile;
    the helper compiles the fused decoder before the weights' block search, which the command's part compiles too
    (whichever comes first), never the fused decoder. (The bounded LM head's kernels are not among them: a head in
    Q8_0 form, as the default model's, keeps its exact product.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    parts = [subprocess.Popen((sys.executable, "-c", COMPILES, part), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in ("model", "drafting")]
    (helper, helper_errors), (here, here_errors) = [part.communicate(timeout=900) for part in parts]
    assert [part.returncode for part in parts] == [0, 0], (helper_errors, here_errors)
    helper, here = helper.split(), here.split()
    assert "decoder_stack" in helper and "decoder_stack" not in here
    before = helper[:helper.index("decoder_stack")]
    assert not {"_find_blocks", "_code_lanes", "_slack_rows", "_reaching"} & set(before), helper
    assert "_find_blocks" in set(here) | set(helper[helper.index("decoder_stack"):])
    assert {"_norm_rows", "_rope_rows", "_silu_rows"} <= set(helper)  # a prompt's compiled passes
    assert ("_launch_groups" in helper) == amx_kernel.available()  # a prompt's rows on the tile kernels
    done = subprocess.run([sys.executable, "-c", MISSES], env=env, check=True, timeout=900, capture_output=True,
                          text=True)
    missed = done.stdout.split()
    # The recycling prior's rows (the tiny model has none) compile on their own: two small functions.
    assert int(missed[0]) <= 2, missed


def test_a_failed_compile_here_is_left_to_the_generation(monkeypatch):
    parts = []

    def failing(part):
        parts.append(part)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kernel_warmup, "warm", failing)
    kernel_warmup._compile_drafting_here()
    assert parts == ["drafting"]


@pytest.fixture
def starts(monkeypatch):
    """Records each `kernel_warmup.start` call (the helper itself is not started)."""
    calls = []
    monkeypatch.setattr(kernel_warmup, "start", lambda: calls.append("start"))
    return calls


def test_a_library_process_starts_the_helper_before_it_loads_a_model(starts, tmp_path, monkeypatch):
    from test_model_cache import _saved_tiny_model

    from lookahead import models

    folder = _saved_tiny_model(tmp_path / "tiny")
    real_load = models._load_folder
    monkeypatch.setattr(models, "_load_folder", lambda *args: starts.append("load") or real_load(*args))
    models.load_model(folder)
    assert starts == ["start", "load"]  # the compile overlaps the load (and a GGUF's conversion)


@pytest.mark.parametrize("name, content", [("missing", None), ("notes.txt", "text"), ("empty", "")])
def test_a_model_path_that_cannot_load_starts_no_helper(starts, tmp_path, name, content):
    from lookahead.models import ModelLoadError, load_model

    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ModelLoadError):
        load_model(path)
    assert starts == []


def test_a_library_process_starts_the_helper_with_its_first_lookahead(starts):
    from lookahead import Lookahead

    Lookahead()
    assert starts == ["start"]
    with pytest.raises(TypeError):
        Lookahead(config="fast")  # a refused argument starts nothing
    assert starts == ["start"]


def test_the_helper_runs_at_the_lowest_priority():
    """It compiles on idle cores and yields to what the process that started it runs meanwhile."""
    code = ("import os; from lookahead import kernel_warmup; kernel_warmup.warm = lambda part: print(os.nice(0)); "
            "kernel_warmup.main('model')")
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["19"]
