"""Tensor parallelism (transformers `tp_plan="auto"`, 2 CPU processes over gloo): every rank runs the same
forwards and commits the same tokens, although each rank is handed a different cost curve and times its own
steps; greedy equals plain greedy, seeded sampling equals the single-process run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model, repetitive_prompt, word_tokenizer

import lookahead
from lookahead import LookaheadConfig, distributed

WORKER = Path(__file__).with_name("tp_worker.py")
NEW_TOKENS = 40
TIMEOUT = 240  # a rank waiting on a collective the other never joins fails the test instead of hanging CI


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(single-process model, prompts, per-rank results) of one 2-process torchrun of tests/tp_worker.py."""
    folder = tmp_path_factory.mktemp("tp_model")
    model = build_tiny_model("llama", dtype=torch.float32, layers=2)
    model.save_pretrained(folder)
    word_tokenizer(64).save_pretrained(folder)
    prompts = [repetitive_prompt(seed)[0].tolist() for seed in range(2)]
    out = tmp_path_factory.mktemp("tp_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKER.parent)] + sys.path))
    done = _torchrun([str(WORKER), str(folder), str(out), json.dumps(prompts), str(NEW_TOKENS)], env)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return model, prompts, ranks, folder


def _torchrun(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 ARGS`, failing the test on a hang."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # torchrun passes SIGTERM on to its ranks (each in a session of its own)
        try:
            launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
        pytest.fail(f"the tensor-parallel ranks did not finish within {TIMEOUT} s (a collective hung)")
    return subprocess.CompletedProcess(cmd, launcher.returncode, stdout, stderr)


def test_ranks_commit_identical_greedy_tokens_equal_to_plain_greedy(tp_run):
    model, prompts, ranks, _ = tp_run
    for i, ids in enumerate(prompts):
        single = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
        for rank in ranks:
            run = rank["runs"][i]
            assert run["plain"] == single  # the sharded model itself computes what the unsharded one does
            assert run["lookahead"] == single


def test_ranks_speculated_and_followed_rank_zero(tp_run):
    """Rank 1's own curve says never to draft; had it planned alone, its forwards would differ from rank 0's
    (and the collectives would break); instead both took the same steps, with drafts accepted."""
    _, _, ranks, _ = tp_run
    for run0, run1 in zip(ranks[0]["runs"], ranks[1]["runs"]):
        assert run0["steps"] == run1["steps"]
    assert any(run["steps"] < run["new_tokens"] - 1 for run in ranks[0]["runs"])


def test_seeded_sampling_identical_across_ranks_and_to_one_process(tp_run):
    model, prompts, ranks, _ = tp_run
    for i, ids in enumerate(prompts):
        single = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0,
                                custom_generate=lookahead.Lookahead(LookaheadConfig(seed=7)))[0].tolist()
        assert ranks[0]["runs"][i]["seeded"] == ranks[1]["runs"][i]["seeded"] == single


def test_unseeded_sampling_identical_across_ranks(tp_run):
    """The ranks seeded torch differently; they adopt rank 0's generator state, so they still sample alike."""
    _, _, ranks, _ = tp_run
    for run0, run1 in zip(ranks[0]["runs"], ranks[1]["runs"]):
        assert run0["unseeded"] == run1["unseeded"]


def test_cli_tp_prints_once_what_plain_greedy_does(tp_run):
    """`torchrun ... -m lookahead.cli generate --tp`: rank 0 streams the completion (once), every rank runs the
    --compare generation, and the output equals plain greedy of the sharded model."""
    *_, folder = tp_run
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = _torchrun(["-m", "lookahead.cli", "generate", "--model", str(folder), "--tp", "--max-new-tokens", "12",
                      "--compare", "w5 w6 w7 w8 w5 w6 w7"], env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.count("outputs identical: yes") == 1
    assert "FutureWarning" not in done.stderr  # the plan goes in a DistributedConfig, not as deprecated tp_plan=
    assert len(done.stdout.strip().splitlines()) == 1 and len(done.stdout.split()) == 12


def test_outside_tensor_parallelism_nothing_is_broadcast(tiny_model):
    model = tiny_model("llama")
    assert not distributed.tensor_parallel(model)
    with distributed.agreement(model) as on:
        assert not on and distributed.is_leader() and distributed.leader_value(1.5) == 1.5


def test_heads_that_do_not_split_over_the_ranks_are_refused(tiny_model):
    config = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48).config
    distributed.check_head_split(config, 3)
    with pytest.raises(ValueError, match="6 attention heads \\(3 key/value heads\\) cannot be split over 2"):
        distributed.check_head_split(config, 2)
