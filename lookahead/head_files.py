"""Draft head files: saving and loading a trained `DraftHead`, and finding the one made for a model.

A head file is a safetensors file: the head's tensors (fp16; see `draft_head.DraftHead`), its output vocabulary
`vocab` [n] int64, and text metadata — `format` ("lookahead-draft-head"), `fingerprint` (of the model it was trained
for, `model_fingerprint`), `model` (a human-readable name) and `trained` (how it was made). Heads shipped with the
package live in `lookahead/heads/`; `find_head(model)` returns the one whose fingerprint is the model's, and
`head_for(model, "auto")` loads it.

A head used with another model than its own is not wrong, only useless: it only proposes drafts, which
verification checks. The fingerprint keeps a head from being picked for a model it was not trained on.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .draft_head import DraftHead, check_weights

FORMAT = "lookahead-draft-head"
PACKAGED = Path(__file__).parent / "heads"
# model → {(file kind, "auto" or a resolved path): what was loaded for it (a DraftHead, a RecyclePrior or None)}
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def model_fingerprint(model) -> str:
    """A short hex digest of what ties a head to `model`: its hidden size, vocabulary size and layer count and the
    bytes of its first 64 input embedding rows and of its final norm's weight (when it has one)."""
    config = model.config.get_text_config()
    digest = hashlib.sha256(f"{config.hidden_size}/{config.vocab_size}/{config.num_hidden_layers}".encode())
    digest.update(_whole(model.get_input_embeddings().weight)[:64].float().contiguous().numpy().tobytes())
    norm = getattr(getattr(model, "model", None), "norm", None)
    if getattr(norm, "weight", None) is not None:
        digest.update(_whole(norm.weight).float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """`weight` detached as one plain tensor: a tensor-parallel shard (a DTensor) gathered whole (a collective:
    every rank calls it, as every rank runs the same generation). Raises `ValueError` for a weight without values
    here (on the meta device: offloaded to disk by a device map)."""
    weight = weight.detach()
    if weight.is_meta:
        raise ValueError("the model's embeddings are offloaded (meta device): its fingerprint cannot be read")
    return weight.full_tensor() if callable(getattr(weight, "full_tensor", None)) else weight


def save_head(path: str | Path, weights: dict[str, torch.Tensor], vocab: torch.Tensor, model, trained: str) -> None:
    """Write a head file for `model` at `path` (see the module docstring); `trained`: how the head was made."""
    tensors = {name: value.detach().to(torch.float16).contiguous() for name, value in weights.items()}
    tensors["vocab"] = vocab.long().contiguous()
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    save_file(tensors, str(path), metadata={"format": FORMAT, "fingerprint": model_fingerprint(model),
                                            "model": name, "trained": trained})


def read_metadata(path: str | Path, kind: str = FORMAT, what: str = "draft head") -> dict[str, str]:
    """The text metadata of the `kind` file at `path` (a draft head's by default; `what` names the kind in
    errors). Raises `ValueError` when it is not such a file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as error:  # noqa: BLE001 — any unreadable file is reported the same way
        raise ValueError(f"{path} is not a readable {what} file ({error})") from None
    if metadata.get("format") != kind:
        raise ValueError(f"{path} is not a lookahead {what} file (format {metadata.get('format')!r})")
    return metadata


def check_fingerprint(metadata: dict[str, str], path: str | Path, model, what: str = "draft head") -> None:
    """Raise `ValueError` unless the file at `path` (its `metadata`) was made for `model`."""
    fingerprint = model_fingerprint(model)
    if metadata.get("fingerprint") != fingerprint:
        raise ValueError(f"{what} {path} was made for {metadata.get('model')!r} "
                         f"(fingerprint {metadata.get('fingerprint')}), not this model ({fingerprint})")


def load_head(path: str | Path, model) -> DraftHead:
    """The head in the file at `path`, bound to `model`'s input embeddings. Raises `ValueError` when the file is not
    a head file, was made for another model, or does not fit the model's sizes."""
    weights, vocab = read_head(path, model)
    return DraftHead(weights, vocab, model.get_input_embeddings().weight)


def read_head(path: str | Path, model) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(weights, output vocabulary) of the head file at `path` made for `model`. Raises `ValueError` when it is not
    a head file, was made for another model, or its shapes do not fit the model's hidden size."""
    check_fingerprint(read_metadata(path), path, model)
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if "vocab" not in tensors:
        raise ValueError(f"draft head {path} has no output vocabulary")
    vocab = tensors.pop("vocab")
    check_weights(tensors, model.get_input_embeddings().weight.shape[1])
    return tensors, vocab


def find_head(model) -> Path | None:
    """The packaged head file made for `model` (matching fingerprint), or None."""
    return find_packaged(model, PACKAGED, FORMAT)


def find_packaged(model, folder: Path, kind: str) -> Path | None:
    """The `kind` file in `folder` made for `model` (matching fingerprint), or None (also when the model's
    fingerprint cannot be read: embeddings offloaded to disk)."""
    try:
        fingerprint = model_fingerprint(model)
    except ValueError:
        return None
    for path in sorted(folder.glob("*.safetensors")):
        try:
            if read_metadata(path, kind).get("fingerprint") == fingerprint:
                return path
        except ValueError:
            continue
    return None


def head_for(model, spec: str = "auto") -> DraftHead:
    """The `DraftHead` for `model`: `spec` "auto" the packaged head made for the model, else the head file at path
    `spec`. Found and loaded once per model and spec, then shared (a server's requests, a `Lookahead`'s calls).
    Raises `ValueError` when "auto" finds no head for the model, the file does not exist, or as `load_head` does."""
    return loaded_once(model, FORMAT, spec, lambda: load_head(_head_file(model, spec), model))


def loaded_once(model, kind: str, spec: str, load):
    """What `load()` returns for `model` and the `kind` file `spec` names ("auto" or a path): loaded on the first
    call, then the same object for every later one (a server's requests, a `Lookahead`'s calls)."""
    key = (kind, spec if spec == "auto" else str(Path(spec).resolve()))
    with _LOCK:
        loaded = _LOADED.setdefault(model, {})
        if key not in loaded:
            loaded[key] = load()
        return loaded[key]


def configured_head(model, config) -> DraftHead | None:
    """The head a `LookaheadConfig` asks for, for `model` (`head_for(model, config.draft_head)`), or None when it is
    off or cannot draft (`config.drafts_with_head`). Raises `ValueError` as `head_for` does."""
    return head_for(model, config.draft_head) if config.drafts_with_head else None


def _head_file(model, spec: str) -> Path:
    """The head file `spec` names for `model` ("auto": the packaged one). Raises `ValueError` when there is none."""
    if spec == "auto":
        chosen = find_head(model)
        if chosen is None:
            raise ValueError("no draft head ships for this model; make one with `lookahead train-head OUT` and pass "
                             "its path as draft_head (--draft-head)")
        return chosen
    if not Path(spec).is_file():
        raise ValueError(f"draft head file {spec} does not exist")
    return Path(spec)
