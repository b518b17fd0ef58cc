"""Candidates for the linear layers of a verification forward: time of all of a model's matmuls at k rows.

    python benchmarks/bench_linear.py [--model PATH] [--rows 1 2 4 8 16] [--repeats 5] [--threads 2]
        [--candidates default w_xt mkldnn mkldnn_fused mkl head_blocks inductor] [--out FILE.json]

Every candidate computes the products of one forward of the model for k input rows: per layer q, k, v, o, gate,
up, down and once the LM head, with a distinct weight per layer (so, as in the model, the weights stream from
memory rather than cache). Shapes come from the model's config (the default model unless `--model`). Candidates:

- `default`: `torch.nn.functional.linear` (PyTorch's default CPU path: packs the weight on every call);
- `w_xt`: the product as `W @ xᵀ`;
- `mkldnn`: weights prepacked once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`);
- `mkldnn_fused`: the same with q/k/v and gate/up stacked into one weight each (what `lookahead` uses);
- `mkl`: MKL packed GEMM (`torch.ops.mkl._mkl_reorder_linear_weight` for the row count + `_mkl_linear`);
- `head_blocks`: `mkldnn_fused` with the LM head split into vocabulary blocks of 8192 rows;
- `inductor`: `torch.compile` (inductor, weight freezing, max-autotune with its C++ GEMM template) of the fused
  layers, compiled once per row count (slow: minutes; compiled code is cached under inductor's cache folder).

bf16 and int8 are reported as skipped unless the CPU has native instructions for them (avx512_bf16/amx_bf16,
avx512_vnni/avx_vnni/amx_int8): emulated, they are slower than fp32 and fp32 stays the exact default anyway.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from harness import command_line, cpu_flags, machine_info, rows_parser, write_json

CANDIDATES = ("default", "w_xt", "mkldnn", "mkldnn_fused", "mkl", "head_blocks", "inductor")
NATIVE = {"bf16": ("avx512_bf16", "amx_bf16"), "int8": ("avx512_vnni", "avx_vnni", "amx_int8")}


def main(argv: list[str] | None = None) -> None:
    """Time every candidate at every row count; print a table, write JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = model_shapes(args.model)
    weights = make_weights(shapes)
    flags = cpu_flags()
    result = {"command": command_line(), "machine": machine_info(args.threads), "cpu_flags": flags,
              "shapes": shapes, "rows": args.rows, "candidates": {}, "skipped": skipped_types(flags)}
    for name in args.candidates:
        print(f"timing {name} ...", file=sys.stderr)
        result["candidates"][name] = time_candidate(name, weights, shapes, args.rows, args.repeats)
    print(format_table(result))
    if args.out:
        write_json(result, args.out)


def model_shapes(path: str | None) -> dict:
    """Layer count and the (out, in) sizes of a decoder layer's projections and the LM head."""
    from transformers import AutoConfig

    from lookahead.models import default_model_folder

    config = AutoConfig.from_pretrained(path or default_model_folder()).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, kv = config.hidden_size, config.num_key_value_heads * head_dim
    return {"layers": config.num_hidden_layers, "q": [config.num_attention_heads * head_dim, hidden],
            "k": [kv, hidden], "v": [kv, hidden], "o": [hidden, config.num_attention_heads * head_dim],
            "gate": [config.intermediate_size, hidden], "up": [config.intermediate_size, hidden],
            "down": [hidden, config.intermediate_size], "head": [config.vocab_size, hidden]}


def make_weights(shapes: dict) -> dict:
    """Random fp32 weights: a list per projection (one per layer) and the head."""
    generator = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(*shapes[name], generator=generator) * 0.02 for _ in range(shapes["layers"])]
               for name in ("q", "k", "v", "o", "gate", "up", "down")}
    weights["head"] = [torch.randn(*shapes["head"], generator=generator) * 0.02]
    return weights


def groups(fused: bool) -> list[tuple[str, ...]]:
    """The products of one layer: projections stacked into one weight per tuple."""
    if fused:
        return [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)]
    return [(name,) for name in ("q", "k", "v", "o", "gate", "up", "down")]


def time_candidate(name: str, weights: dict, shapes: dict, rows: list[int], repeats: int) -> dict:
    """{k: best-of-`repeats` seconds for all of one forward's products at k rows} with candidate `name`; the row
    counts interleaved in every round. Weights are prepared once (per row count only where the candidate packs
    for one), so no large allocation happens between timed runs."""
    fused = name in ("mkldnn_fused", "head_blocks", "inductor")
    mats = [torch.cat([weights[p][layer] for p in group]) for layer in range(len(weights["q"]))
            for group in groups(fused)] + weights["head"]
    runs = {k: build(name, mats, k) for k in rows} if name in ("mkl", "inductor") else dict.fromkeys(
        rows, build(name, mats, rows[0]))
    hidden, inner = shapes["head"][1], shapes["down"][1]
    inputs = {k: {hidden: torch.randn(k, hidden), inner: torch.randn(k, inner)} for k in rows}
    best = dict.fromkeys(rows, float("inf"))
    with torch.no_grad():
        for round_ in range(repeats + 1):  # round 0 warms up
            for k in rows:
                start = time.perf_counter()
                runs[k](inputs[k])
                if round_:
                    best[k] = min(best[k], time.perf_counter() - start)
    return best


def build(name: str, mats: list[torch.Tensor], rows: int):
    """A function x -> None computing every product with candidate `name` (weights prepared here, untimed)."""
    if name == "default":
        return lambda x: [F.linear(x[w.shape[1]], w) for w in mats]
    if name == "w_xt":
        return lambda x: [torch.mm(w, x[w.shape[1]].t()) for w in mats]
    if name in ("mkldnn", "mkldnn_fused", "head_blocks"):
        if name == "head_blocks":
            mats = mats[:-1] + list(mats[-1].split(8192))
        packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)) for w in mats]
        return lambda x: [torch.ops.mkldnn._linear_pointwise(x[k], p, None, "none", [], "") for k, p in packed]
    if name == "mkl":
        packed = [(w, torch.ops.mkl._mkl_reorder_linear_weight(w, rows)) for w in mats]
        return lambda x: [torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, rows) for w, p in packed]
    if name == "inductor":
        return compiled_stack(mats)
    raise ValueError(f"unknown candidate {name!r}")


def compiled_stack(mats: list[torch.Tensor]):
    """torch.compile (inductor, freezing, max-autotune C++ GEMM) of a module computing every product."""
    import torch._inductor.config as inductor

    inductor.freezing, inductor.max_autotune = True, True
    inductor.max_autotune_gemm_backends = "CPP,ATEN"
    linears = torch.nn.ModuleList()
    for w in mats:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data.copy_(w)
        linears.append(linear)

    class Stack(torch.nn.Module):
        def forward(self, small, large):
            return [lin(large if lin.in_features == large.shape[1] else small) for lin in linears]

    stack = Stack().eval()
    stack.linears = linears
    compiled = torch.compile(stack)
    keys = sorted({w.shape[1] for w in mats})
    return lambda x: compiled(x[keys[0]], x[keys[-1]])


def skipped_types(flags: list[str]) -> dict:
    """Why bf16 / int8 were not measured on this CPU (empty when it has native instructions)."""
    return {kind: f"no native {kind} instructions ({' / '.join(need)} absent)" for kind, need in NATIVE.items()
            if not any(flag in flags for flag in need)}


def format_table(result: dict) -> str:
    """Markdown: per candidate, ms at each row count and the ratio to its own and to `default`'s one-row time."""
    rows, cands = result["rows"], result["candidates"]
    base = cands.get("default", {}).get(rows[0])
    lines = [f"CPU flags: {' '.join(result['cpu_flags'])}; {result['machine']['threads']} threads", "",
             "| candidate | " + " | ".join(f"k={k} ms" for k in rows) + " | " + " | ".join(
                 f"k={k} × own k=1" for k in rows[1:]) + " | k=1 × default |",
             "|---|" + "---:|" * (2 * len(rows))]
    for name, times in cands.items():
        own = times[rows[0]]
        versus_default = f"{own / base:.2f}" if base else "—"
        lines.append(f"| {name} | " + " | ".join(f"{times[k] * 1e3:.1f}" for k in rows) + " | "
                     + " | ".join(f"{times[k] / own:.2f}" for k in rows[1:]) + f" | {versus_default} |")
    for kind, why in result["skipped"].items():
        lines.append(f"\n{kind}: skipped, {why}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = rows_parser(__doc__.split("\n\n")[0], repeats=5)
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES,
                        default=[c for c in CANDIDATES if c != "inductor"])
    args = parser.parse_args(argv)
    if args.rows[0] != 1 or min(args.rows) < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--rows must start with 1; --rows, --repeats and --threads must be positive")
    return args


if __name__ == "__main__":
    main()
