"""One parse of a GGUF file per conversion, instead of the three transformers makes (and 400 name tables).

`AutoModelForCausalLM.from_pretrained(..., gguf_file=)` and `AutoTokenizer.from_pretrained(..., gguf_file=)` reach
transformers' `load_gguf_checkpoint` three times for one file — for the config, the weights and the tokenizer — and
each call constructs a `gguf.GGUFReader`, which parses every metadata field in Python (for the default model
49 152 vocabulary strings and 48 900 merges, over a million small memory-map slices). Mapping the
weights' names, transformers' `get_gguf_hf_weights_map` recurses over every module of the model (397 for the
default one) and calls `gguf.get_tensor_name_map(arch, blocks)` at each, which builds the same table of every
block's tensor names each time.

Both are pure: a reader only reads its file (memory-mapped read-only), and a name table is a function of its two
arguments. Within `shared_gguf_reads()`, the two functions of the `gguf` package that transformers imports at call
time return one reader per file (while the file is unchanged) and one table per (arch, blocks); on exit, also on
error, the package's own functions are back. The swap is process-wide while a block runs (another thread calling
the `gguf` package meanwhile gets the shared reader too: equally correct, as both are pure). Measured on the default
model (AVX2 machine, session 44): the weights 30.0 → 9.2 s, the tokenizer 6.4 → 2.2 s, the same tensors and the
same tokenizer files.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import gguf

_lock = threading.RLock()  # one thread at a time swaps the package's functions; nested blocks of that thread nest
_depth = 0


@contextlib.contextmanager
def shared_gguf_reads() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path, ...)` returns the reader it made before for the same unchanged file
    and arguments, and `gguf.get_tensor_name_map(arch, blocks)` the table it made before for the same arguments.
    Re-entrant in one thread (the outermost block restores); another thread entering waits for the block to end."""
    global _depth
    with _lock:
        if _depth == 0:
            saved = gguf.GGUFReader, gguf.get_tensor_name_map
            gguf.GGUFReader, gguf.get_tensor_name_map = _shared_readers(saved[0]), functools.cache(saved[1])
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _shared_readers(reader: type):
    """A stand-in for the `reader` class: one instance per (file, its size and modification time, arguments)."""
    made: dict[tuple, object] = {}

    def shared(path, *args, **kwargs):
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = reader(path, *args, **kwargs)
        return made[key]

    return shared
