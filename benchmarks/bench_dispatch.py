"""What a dispatched operation costs inside a forward: small operations of a decoding row, warm and right after a
decoder layer's weights have streamed through the caches.

A one-row forward of the default model runs ~30 small operations per decoder layer between its four matrix
products, and each product streams megabytes of weights through the caches, evicting what the next small
operation needs (PyTorch's dispatcher, the kernel's code, the allocator's lists). This script times each
operation warm (called again and again) and cold (right after a product of `--stream-mb` MB of fp32 weights, as
in a forward), medians of `--repeats` interleaved rounds, and counts the operations each one dispatches (torch's
profiler). The RMS norm rows compare `torch.rms_norm` with `lean_layers.LeanNorm`; the RoPE rows compare
transformers' `apply_rotary_pos_emb` (queries and keys apart), the same formula on queries and keys as one tensor,
and `lean_layers`' folded form (rotate_half's sign folded into the sin, which is computed once per forward). The
forms of each give the same numbers, checked here bit for bit.

    python benchmarks/bench_dispatch.py --out benchmarks/results/dispatch-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from harness import cpu_flags, default_out, headed, machine_info, markdown_table, publish

HIDDEN, QUERY_HEADS, KEY_HEADS, HEAD_DIM = 576, 9, 3, 64  # the default model (SmolLM2-135M)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options: rows per step, repeats, threads, stream size (MB; default ~ one decoder layer of the default
    model: q/k/v, o, gate/up and down products, 14 MB), output path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of the decoding step (default 1)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stream-mb", type=float, default=14.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("rows", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not args.stream_mb > 0:
        parser.error(f"--stream-mb must be positive, got {args.stream_mb}")
    return args


def operations(rows: int) -> dict:
    """{name: a no-argument callable} of the small operations of a `rows`-row decoding step; raises
    `AssertionError` if the RoPE forms do not give the same numbers."""
    from lookahead.lean_layers import FoldedRotary, LeanNorm

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, rows, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen)
    heads = torch.randn(1, QUERY_HEADS + KEY_HEADS, rows, HEAD_DIM, generator=gen)
    query, key = heads[:, :QUERY_HEADS], heads[:, QUERY_HEADS:]
    angles = torch.randn(1, rows, HEAD_DIM, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    folded = FoldedRotary()
    lean_norm = LeanNorm(SimpleNamespace(weight=weight, variance_epsilon=1e-5))
    half = HEAD_DIM // 2

    def rope_folded():
        cos_, sin_ = folded((cos, sin))  # computed once per forward in a real step: cached after the first call
        return (heads * cos_).add_(heads.roll(half, -1).mul_(sin_))  # in place on the fresh products

    ops = {
        "add": lambda: x + x,
        "RMS norm, torch.rms_norm": lambda: torch.rms_norm(x, (HIDDEN,), weight, 1e-5),
        "RMS norm, LeanNorm (used)": lambda: lean_norm(x),
        "RoPE, transformers (q, k apart)": lambda: apply_rotary_pos_emb(query, key, cos, sin),
        "RoPE, q and k as one": lambda: heads * cos.unsqueeze(1) + rotate_half(heads) * sin.unsqueeze(1),
        "RoPE, sign folded into the sin (used)": rope_folded,
    }
    assert torch.equal(ops["RMS norm, LeanNorm (used)"](), ops["RMS norm, torch.rms_norm"]())
    q_ref, k_ref = ops["RoPE, transformers (q, k apart)"]()
    for name in ("RoPE, q and k as one", "RoPE, sign folded into the sin (used)"):
        out = ops[name]()
        assert torch.equal(out[:, :QUERY_HEADS], q_ref) and torch.equal(out[:, QUERY_HEADS:], k_ref), name
    return ops


def dispatched(op) -> int:
    """How many operator calls `op()` dispatches (torch's profiler, nested calls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        op()
    return len(prof.events())


def measure(args: argparse.Namespace) -> dict:
    """Median microseconds of every operation warm and after the weight stream, and its dispatch count."""
    torch.set_num_threads(args.threads)
    ops = operations(args.rows)
    columns = int(args.stream_mb * 2**20 / 4 / HIDDEN)
    stream_weight, row = torch.randn(columns, HIDDEN), torch.randn(1, HIDDEN)

    def stream():
        torch.nn.functional.linear(row, stream_weight)

    times = {name: {"warm": [], "cold": []} for name in ops}
    for _ in range(args.repeats):
        for name, op in ops.items():
            op()  # warm: right after the same operation
            start = time.perf_counter()
            op()
            times[name]["warm"].append(time.perf_counter() - start)
            stream()
            start = time.perf_counter()
            op()
            times[name]["cold"].append(time.perf_counter() - start)
    return {name: {"warm_us": 1e6 * statistics.median(t["warm"]), "cold_us": 1e6 * statistics.median(t["cold"]),
                   "dispatched": dispatched(ops[name])} for name, t in times.items()}


def format_table(result: dict) -> str:
    """The markdown table of `measure`'s result."""
    rows = [[name, str(m["dispatched"]), f"{m['warm_us']:.1f}", f"{m['cold_us']:.1f}",
             f"{m['cold_us'] / m['warm_us']:.1f}x"] for name, m in result["operations"].items()]
    header = ["operation", "ops dispatched", "warm µs", f"after {result['settings']['stream_mb']:g} MB of weights µs",
              "cold / warm"]
    return "\n".join(markdown_table(header, rows))


def main(argv: list[str] | None = None) -> None:
    """Run the measurement, print the table, write the JSON."""
    args = parse_args(argv)
    machine = {**machine_info(args.threads), "cpu_flags": cpu_flags()}
    result = {"settings": {"rows": args.rows, "repeats": args.repeats, "stream_mb": args.stream_mb},
              "operations": measure(args)}
    result = headed(result, machine)
    publish(result, default_out("dispatch") if args.out is None else args.out, format_table(result))


if __name__ == "__main__":
    main()
