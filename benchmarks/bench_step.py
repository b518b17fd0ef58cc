"""Where a verification step's time goes: one forward of k = 1, 2, 4, 8, 16 rows, broken down by part.

    python benchmarks/bench_step.py [--model PATH] [--rows 1 2 4 8 16] [--prefix 300] [--repeats 7]
        [--default-rows N] [--streamed-rows N] [--variants default lean ...]
        [--threads 2] [--out FILE.json] [--plot]

For each arithmetic (`default`: PyTorch's own `nn.Linear` and transformers' SDPA attention, i.e. plain HF;
`packed`: oneDNN-prepacked weights with q/k/v and gate/up fused and the `lookahead_tree` attention backend (grouped
SDPA without copying key/value heads) in transformers' decoder layers; `lean`: what generation uses, `packed` with
the lean decoder layers (`lean_layers.py`: the same numbers without the per-module overhead; a step whose products
all run on the streamed kernel runs each layer as one compiled call, `fused_layer.py`) and each row count's
products on the kernel generation chooses (`row_kernels.py`), weights with an exact block form streamed in it
(`affine_weights.py`); `lean-float32`: `lean` with every weight on float32 panels; `lean-numba-attention`: `lean`
with numba's attention loops instead of the compiled ones (`attention_kernel.py`), SDPA for many rows over a long
cache, as before them; `lean-layer-calls`: `lean` with one compiled call per layer instead of one for the whole
stack (`fused_stack.py`), as before it; `lean-unfused`: `lean` without
the compiled layer calls; `lean-onednn`: `lean` without the streamed kernel
(`streamed_gemm.py`): the default matmul where it beats oneDNN (measured in the run), oneDNN for the rest, as
generation computed before the streamed kernel; `packed-sdpa`: prepacked and fused, with transformers' SDPA;
`packed-unfused`: prepacked, every projection on its own, `lookahead_tree` attention) and each row count k,
a real verification step is built (a draft tree of k nodes: root + a chain of k-1 drafts, packed with
`layout.pack`, the model's forward with the 4D tree mask on a `--prefix`-token cache, then the cache compaction
keeping half of the drafts; `default` on plain HF's cache, the others on the cache generation uses, appending into
a slab: `cache_layer.py`). Parts:

- matmuls by layer kind: attention q/k/v, attention o, MLP gate/up, MLP down, LM head (forward hooks);
- attention: the attention modules' time outside their projections (RoPE, SDPA, GQA head copies, cache append);
- cache append: `DynamicCache.update` alone (part of attention);
- other forward: embeddings, norms, residuals, activations and Python module overhead (forward minus the above);
- mask building (`layout.pack`) and cache compaction (`cache.keep_rows`), outside the forward.
The lean variants call their products and attention without module calls, so only its forward, mask building and
compaction are timed (the other parts show "–").

The forward total ("forward") comes from runs without hooks; the parts from runs with hooks (which add a little
time of their own, counted in "other forward"). Variants and sizes are interleaved in every round; each figure
is the lower quartile over the rounds.
Results: JSON (`--out`), a table on stdout and, with `--plot`, a stacked-bar PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

from harness import command_line, cpu_flags, load_target, machine_info, rows_parser, write_json

from lookahead.compat import CACHE_KWARG

LINEAR_KINDS = {"q_proj": "attn q/k/v", "k_proj": "attn q/k/v", "v_proj": "attn q/k/v", "qkv_proj": "attn q/k/v",
                "o_proj": "attn o", "gate_proj": "mlp gate/up", "up_proj": "mlp gate/up",
                "gate_up_proj": "mlp gate/up", "down_proj": "mlp down", "lm_head": "lm head"}
PARTS = ("attn q/k/v", "attn o", "mlp gate/up", "mlp down", "lm head", "attention", "other forward",
         "mask building", "cache compaction")
VARIANTS = ("default", "packed", "lean", "lean-float32", "lean-numba-attention", "lean-layer-calls", "lean-unfused",
            "lean-onednn", "packed-sdpa", "packed-unfused")
LEAN = ("lean", "lean-float32", "lean-numba-attention", "lean-layer-calls", "lean-unfused", "lean-onednn")


def main(argv: list[str] | None = None) -> None:
    """Measure every variant and row count; print the table, write JSON (and a plot)."""
    args = parse_args(argv)
    model, _ = load_target(args)
    args.kernels = row_kernels(model, args.default_rows, args.streamed_rows)
    args.onednn_kernels = onednn_row_kernels(model) if "lean-onednn" in args.variants else None
    result = {"command": command_line(), "machine": machine_info(args.threads), "cpu_flags": cpu_flags(),
              "prefix": args.prefix, "default_rows": args.kernels.default_rows,
              "streamed_rows": args.kernels.streamed_rows, "rows": args.rows,
              "onednn_default_rows": args.onednn_kernels.default_rows if args.onednn_kernels else None,
              "variants": measure(model, args)}
    print(format_table(result))
    if args.out:
        write_json(result, args.out)
        if args.plot:
            plot(result, args.out.with_suffix(".png"))


@torch.no_grad()
def measure(model, args) -> dict:
    """{variant: {k: {part: seconds}}}: variants and row counts interleaved in every round (a noisy machine hits
    them alike); the first round warms up; each figure is the lower quartile of the other rounds."""
    from transformers import DynamicCache

    from lookahead.cache import make_compactable

    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.prefix))
    caches = {}
    for kind in ("plain", "generation"):  # plain HF's cache, and lookahead's (appends into a slab, as generation)
        caches[kind] = DynamicCache(config=model.config)
        model(prompt, **{CACHE_KWARG: caches[kind]}, use_cache=True, logits_to_keep=1)
    make_compactable(caches["generation"], model.config, args.prefix + max(args.rows) + 1)
    samples = {v: {k: {} for k in args.rows} for v in args.variants}
    packed_sets: dict = {}
    for round_ in range(args.repeats + 1):
        print(f"round {round_} of {args.repeats} ...", file=sys.stderr)
        for variant in args.variants:
            kernels = args.onednn_kernels if variant == "lean-onednn" else args.kernels
            cache = caches["plain" if variant == "default" else "generation"]
            with linear_variant(model, variant, packed_sets, kernels):
                timer = PartTimer(model, cache) if variant not in LEAN else None  # lean layers call no modules
                for k in args.rows:
                    plain = one_step(model, cache, args.prefix, k, vocab, None)
                    parts = one_step(model, cache, args.prefix, k, vocab, timer) if timer else dict(plain)
                    parts["forward"] = plain["forward"]
                    for name, seconds in parts.items() if round_ else ():
                        samples[variant][k].setdefault(name, []).append(seconds)
                if timer:
                    timer.remove()
    return {v: {k: {name: quartile(t) for name, t in parts.items()} for k, parts in by_rows.items()}
            for v, by_rows in samples.items()}


def row_kernels(model, default_rows: int | None, streamed_rows: int | None):
    """The `RowKernels` of the prepacked variants: the given counts, generation's choice on this machine
    (`row_kernels.row_kernels_for`: cached, else measured) for those not given."""
    from lookahead import packed_linear
    from lookahead.config import LookaheadConfig
    from lookahead.hf import chosen_row_kernels

    config = LookaheadConfig(default_matmul_rows=default_rows, streamed_matmul_rows=streamed_rows)
    with packed_linear.packed_linears(model):
        return chosen_row_kernels(model, config)


def quartile(values: list[float]) -> float:
    """The lower quartile: machine noise only ever adds time."""
    return float(sorted(values)[(len(values) - 1) // 4])


def onednn_row_kernels(model):
    """The `RowKernels` generation would choose without the streamed kernel (measured now, not cached): the
    default matmul for the few rows where it beats oneDNN, oneDNN for the rest."""
    from lookahead import packed_linear
    from lookahead.row_kernels import measure_row_kernels

    with packed_linear.packed_linears(model):
        return measure_row_kernels(model, streamed=False)


@contextlib.contextmanager
def linear_variant(model, variant: str, packed_sets: dict, kernels=None):
    """The model's linear layers and attention as `variant` within the block; the prepacked variants compute each
    row count's products on the kernel `kernels` (a `RowKernels`; None: all on oneDNN) names."""
    from lookahead import attention_kernel, fused_stack, packed_linear
    from lookahead.attention import tree_attention
    from lookahead.lean_layers import lean_layers
    from lookahead.row_kernels import RowKernels, apply_row_kernels

    if variant == "default":
        yield
        return
    saved, grouping = packed_linear.FUSED_GROUPS, {"packed-unfused": "unfused", "lean-float32": "float32"}.get(
        variant, "fused")  # float32: weights on float32 panels only, a packed set of its own
    packed_linear.FUSED_GROUPS = () if grouping == "unfused" else saved
    cached = packed_sets.get(grouping)  # each grouping's packed modules, built once
    if cached is None:
        model.__dict__.pop(packed_linear._CACHE_ATTR, None)
    else:
        model.__dict__[packed_linear._CACHE_ATTR] = cached
    attention = "sdpa" if variant == "packed-sdpa" else "auto"
    try:
        with (packed_linear.packed_linears(model, compact=variant != "lean-float32"), tree_attention(model, attention),
              _refused(attention_kernel, variant == "lean-numba-attention"),
              _refused(fused_stack.FusedStack, variant == "lean-layer-calls"),
              lean_layers(model, variant in LEAN, fused=variant != "lean-unfused")):
            apply_row_kernels(model, kernels or RowKernels())
            yield
    finally:
        packed_linear.FUSED_GROUPS = saved
        packed_sets[grouping] = model.__dict__.pop(packed_linear._CACHE_ATTR)


@contextlib.contextmanager
def _refused(owner, refuse: bool):
    """Within the block, `owner.supports` (a module's function or a class's static method) says no to everything if
    `refuse`, so what it gates is built as before it: numba's attention loops (`attention_kernel`), one compiled call
    per layer instead of one for the stack (`fused_stack.FusedStack`)."""
    saved = vars(owner)["supports"]  # as stored: a class keeps its staticmethod wrapper
    if refuse:
        setattr(owner, "supports", staticmethod(lambda *args: False))
    try:
        yield
    finally:
        setattr(owner, "supports", saved)


def one_step(model, cache, prefix: int, k: int, vocab: int, timer) -> dict:
    """Time one verification step of k rows (a chain: root + k-1 drafts), with part timers if `timer`."""
    from lookahead.cache import keep_rows
    from lookahead.layout import pack
    from lookahead.tree import DraftTree

    tokens = torch.randint(0, vocab, (k,)).tolist()
    t0 = time.perf_counter()
    tree = DraftTree.from_paths(tokens[0], [tokens[1:]] if k > 1 else [], [0] if k > 1 else [], k - 1)
    inputs = pack(tree, None, prefix, prefix, None, model.dtype, model.device)
    t1 = time.perf_counter()
    if timer is not None:
        timer.reset()
    model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=inputs.attention_mask,
          **{CACHE_KWARG: cache}, use_cache=True)
    t2 = time.perf_counter()
    keep_rows(cache, prefix, list(range(0, k, 2)))  # a non-prefix set: the gather path
    t3 = time.perf_counter()
    cache.crop(prefix - cache.get_seq_length())  # back to the prefix (crop takes a negative count)
    times = {"forward": t2 - t1, "mask building": t1 - t0, "cache compaction": t3 - t2}
    if timer is not None:
        times.update(timer.parts(t2 - t1))
    return times


class PartTimer:
    """Forward hooks that add up the time spent in each linear kind and in the attention modules, and a wrapper
    of the cache's `update` (the append)."""

    def __init__(self, model, cache):
        self.spent: dict[str, float] = {}
        self.handles = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in LINEAR_KINDS:
                self._hook(module, LINEAR_KINDS[leaf])
            elif leaf in ("self_attn", "attn"):
                self._hook(module, "attention total")
        self.cache, self.update = cache, cache.update
        cache.update = self._timed_update

    def _hook(self, module, part: str) -> None:
        starts = []
        self.handles.append(module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))
        self.handles.append(module.register_forward_hook(
            lambda *_: self._add(part, time.perf_counter() - starts.pop())))

    def _add(self, part: str, seconds: float) -> None:
        self.spent[part] = self.spent.get(part, 0.0) + seconds

    def _timed_update(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.update(*args, **kwargs)
        self._add("cache append", time.perf_counter() - start)
        return out

    def reset(self) -> None:
        """Forget the times of the previous forward."""
        self.spent = {}

    def parts(self, forward: float) -> dict:
        """The last forward's parts; "attention" excludes its own projections, "other forward" is the rest."""
        spent = dict(self.spent)
        projections = spent.get("attn q/k/v", 0.0) + spent.get("attn o", 0.0)
        spent["attention"] = spent.pop("attention total", 0.0) - projections
        counted = sum(v for name, v in spent.items() if name != "cache append")
        spent["other forward"] = max(forward - counted, 0.0)
        return spent

    def remove(self) -> None:
        """Take the hooks and the cache wrapper off."""
        for handle in self.handles:
            handle.remove()
        self.cache.update = self.update


def format_table(result: dict) -> str:
    """Markdown: per variant, the forward in ms and as a ratio of that variant's one-row forward, then the parts."""
    rows = result["rows"]
    lines = [f"CPU flags: {' '.join(result['cpu_flags']) or 'unknown'}; {result['machine']['cpu']}, "
             f"{result['machine']['threads']} threads; cache of {result['prefix']} tokens; "
             f"prepacked variants: {_kernels(result).describe()}" + _onednn_note(result), "",
             "| variant | part | " + " | ".join(f"k={k}" for k in rows) + " |",
             "|---|---|" + "---:|" * len(rows)]
    base = result["variants"].get("default", {}).get(rows[0], {}).get("forward")
    for variant, by_rows in result["variants"].items():
        own = by_rows[rows[0]]["forward"]
        lines.append(f"| {variant} | forward ms | " + " | ".join(f"{by_rows[k]['forward'] * 1e3:.1f}" for k in rows)
                     + " |")
        lines.append(f"| {variant} | × own one-row | " + " | ".join(f"{by_rows[k]['forward'] / own:.2f}"
                                                                  for k in rows) + " |")
        if base:
            lines.append(f"| {variant} | × default one-row | " + " | ".join(f"{by_rows[k]['forward'] / base:.2f}"
                                                                          for k in rows) + " |")
        for part in PARTS + ("cache append",):
            lines.append(f"| {variant} | {part} ms | " + " | ".join(_ms(by_rows[k].get(part)) for k in rows) + " |")
    return "\n".join(lines)


def _kernels(result: dict):
    """The `RowKernels` a result was measured with."""
    from lookahead.row_kernels import RowKernels

    return RowKernels(result.get("default_rows", 0), result.get("streamed_rows", 0))


def _onednn_note(result: dict) -> str:
    """What the lean-onednn variant computed with, when it ran."""
    from lookahead.row_kernels import RowKernels

    rows = result.get("onednn_default_rows")
    return "" if rows is None else f" (lean-onednn: {RowKernels(rows, 0).describe()})"


def _ms(seconds: float | None) -> str:
    """A part's time in ms for the table; "–" for a part not measured (the lean layers have no part hooks)."""
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def plot(result: dict, path: Path) -> None:
    """Stacked bars: per variant and row count, the parts of one step in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants, rows = list(result["variants"]), result["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) * len(variants)), 4.5))
    labels, x, unsplit_labelled = [], 0, False
    for variant in variants:
        for k in rows:
            parts, bottom = result["variants"][variant][k], 0.0
            if "attn q/k/v" not in parts:  # lean: the forward is not split into parts
                bottom = parts["forward"] * 1e3
                ax.bar(x, bottom, color="0.6", label=None if unsplit_labelled else "forward (not split)")
                unsplit_labelled = True
            for i, part in enumerate(PARTS):
                height = parts.get(part, 0.0) * 1e3
                ax.bar(x, height, bottom=bottom, color=plt.cm.tab10(i), label=part if x == 0 else None)
                bottom += height
            labels.append(f"{variant}\nk={k}")
            x += 1
        x += 0.5
    ticks = [i + (i // len(rows)) * 0.5 for i in range(len(labels))]
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title(f"One verification step by part ({result['machine']['cpu']}, {result['machine']['threads']} threads)")
    ax.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = rows_parser(__doc__.split("\n\n")[0], repeats=7)
    parser.add_argument("--prefix", type=int, default=300, help="cached tokens before the step")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--plot", action="store_true", help="write a PNG beside --out")
    parser.add_argument("--default-rows", type=int, default=None,
                        help="products of at most this many rows on PyTorch's default matmul in the prepacked "
                             "variants (default: as generation chooses, measured on this machine)")
    parser.add_argument("--streamed-rows", type=int, default=None,
                        help="products of more rows, up to this many, on the streamed kernel in the prepacked "
                             "variants (default: as generation chooses, measured on this machine)")
    args = parser.parse_args(argv)
    if args.rows[0] != 1 or any(k < 1 for k in args.rows):
        parser.error("--rows must start with 1 (the reference) and be positive")
    if args.repeats < 1 or args.prefix < 1 or args.threads < 1:
        parser.error("--repeats, --prefix and --threads must be positive")
    return args


if __name__ == "__main__":
    main()
