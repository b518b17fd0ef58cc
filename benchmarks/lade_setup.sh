#!/usr/bin/env bash
# Set up the comparison with the original Lookahead Decoding package (`lade` 0.0.2, hao-ai-lab), which needs
# transformers 4.34 and a Llama-family model, so it gets its own virtual environment outside the repo:
#
#   1. a venv at ${LADE_VENV:-~/.cache/lookahead/lade-venv} (made with ${LADE_PYTHON:-python3});
#   2. torch 2.13.0 in it: the local CPU wheel (any other torch request would pull a multi-GB CUDA build),
#      then transformers==4.34.0 with its own dependencies under a constraints file that pins torch==2.13.0
#      (so pip can neither upgrade nor downgrade it) and numpy<2 (transformers 4.34 predates numpy 2);
#   3. lade==0.0.2 with --no-deps (its metadata declares no dependencies; it imports only torch and
#      transformers, plus termcolor/awq in paths the benchmark never takes);
#   4. an HF folder of the default model at ${LADE_MODEL_DIR:-~/.cache/lookahead/smollm2-hf}, saved by the
#      MAIN environment (${MAIN_PYTHON:-python}, which has `lookahead` installed) and rewritten so that
#      transformers 4.34 reads it as the same model (see `bench_lade.make_folder_compatible`);
#   5. a check that the venv imports torch/transformers/lade and reads the folder's config and tokenizer.
#
# Idempotent: every step is skipped when its result is already there. Then run, for example:
#   "$LADE_VENV/bin/python" benchmarks/bench_lade.py --categories code --prompts-per-category 1 \
#       --max-new-tokens 16 --repeats 1 --threads 1 --out /tmp/lade-smoke.json
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${LOOKAHEAD_CACHE:-$HOME/.cache/lookahead}"
LADE_VENV="${LADE_VENV:-$CACHE/lade-venv}"
LADE_MODEL_DIR="${LADE_MODEL_DIR:-$CACHE/smollm2-hf}"
LADE_PYTHON="${LADE_PYTHON:-python3}"
MAIN_PYTHON="${MAIN_PYTHON:-python}"
TORCH_VERSION="2.13.0"
TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR:-/opt/wheels}"
VPY="$LADE_VENV/bin/python"
CONSTRAINTS="$LADE_VENV/lade-constraints.txt"

say() { printf '[lade_setup] %s\n' "$*"; }

vpip() {  # pip of the venv, without the warnings about this machine's missing local index folders
    "$VPY" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}

make_venv() {
    if [[ -x "$VPY" ]]; then
        say "venv exists: $LADE_VENV"
    else
        say "creating venv $LADE_VENV with $($LADE_PYTHON --version)"
        "$LADE_PYTHON" -m venv "$LADE_VENV"
    fi
    printf 'torch==%s\nnumpy<2\n' "$TORCH_VERSION" > "$CONSTRAINTS"
}

installed_version() {  # the version of package $1 in the venv, or nothing
    { "$VPY" -m pip show "$1" 2>/dev/null || true; } | sed -n 's/^Version: //p'
}

install_torch() {
    local have wheel
    have="$(installed_version torch)"
    if [[ "$have" == "$TORCH_VERSION"* ]]; then
        say "torch $have already installed"
        return
    fi
    wheel="$(ls "$TORCH_WHEEL_DIR"/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n 1 || true)"
    if [[ -n "$wheel" ]]; then
        say "installing torch from the local CPU wheel $wheel"
        vpip install --quiet -c "$CONSTRAINTS" "$wheel"
    else
        say "no local CPU wheel in $TORCH_WHEEL_DIR; installing torch==$TORCH_VERSION as the main README does"
        vpip install --quiet -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
    fi
}

install_package() {  # $1 = name, $2 = version, rest = extra pip options
    local name="$1" version="$2" have
    shift 2
    have="$(installed_version "$name")"
    if [[ "$have" == "$version" ]]; then
        say "$name $have already installed"
    else
        say "installing $name==$version $*"
        vpip install --quiet -c "$CONSTRAINTS" "$@" "$name==$version"
    fi
}

save_model() {
    if [[ -f "$LADE_MODEL_DIR/.lade-compatible" ]]; then
        say "model folder exists: $LADE_MODEL_DIR"
        return
    fi
    say "saving the default model from the main environment ($MAIN_PYTHON) to $LADE_MODEL_DIR"
    "$MAIN_PYTHON" - "$LADE_MODEL_DIR" "$HERE" <<'EOF'
import sys

folder, benchmarks = sys.argv[1], sys.argv[2]
sys.path.insert(0, benchmarks)
from lookahead import load_model
from bench_lade import make_folder_compatible

model, tokenizer = load_model()
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
for change in make_folder_compatible(folder):
    print(f"[lade_setup]   {change}")
EOF
}

check_venv() {
    say "checking the venv: versions, and the model folder read by transformers 4.34"
    "$VPY" - "$LADE_MODEL_DIR" <<'EOF'
import sys

import lade  # noqa: F401  (import check: lade patches transformers 4.34 internals on use)
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer

assert torch.__version__.startswith("2.13.0"), torch.__version__
config = AutoConfig.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("def fibonacci(n):", add_special_tokens=False).input_ids
print(f"[lade_setup]   torch {torch.__version__}, transformers {transformers.__version__}, lade 0.0.2; "
      f"{config.model_type} rope_theta={config.rope_theta} dtype={config.torch_dtype}; "
      f"tokenizer {type(tokenizer).__name__}, chat template: {bool(tokenizer.chat_template)}, "
      f"'def fibonacci(n):' -> {ids}")
EOF
}

make_venv
install_torch
install_package transformers 4.34.0
install_package lade 0.0.2 --no-deps
save_model
check_venv
say "done. Run: $VPY $HERE/bench_lade.py --help"
