"""A hand-written AVX2 small-row kernel (benchmarks/kernels/small_rows_avx2.c) against oneDNN's prepacked linear.

    python benchmarks/bench_small_gemm.py [--rows 1 2 4 8 12 16 24 32] [--threads 2] [--repeats 15] [--out FILE.json]

One candidate of issue 11 ("a verification forward without the cliff"), kept for its numbers; lookahead does
not use it. The products are the default model's MLP gate/up projections stacked ([576 → 3072]), one distinct
weight per layer for 30 layers so the weights stream from memory as in a real forward; per row count, the lower
quartile of `--repeats` timed passes over all 30 layers. Needs gcc with AVX2/FMA and OpenMP (compiled into a
temporary folder); the machine must have avx2 and fma.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from harness import command_line, cpu_flags, machine_info, markdown_table, write_json

SOURCE = Path(__file__).with_name("kernels") / "small_rows_avx2.c"
LAYERS, N, K = 30, 3072, 576


def main(argv: list[str] | None = None) -> None:
    """Compile the kernel, time both candidates at each row count, print the table, write JSON."""
    args = parse_args(argv)
    if shutil.which("gcc") is None or not {"avx2", "fma"} <= set(cpu_flags()):
        sys.exit("bench_small_gemm needs gcc and a CPU with avx2 and fma")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        kernel = compile_kernel(Path(folder))
        times = measure(kernel, args.rows, args.repeats)
    result = {"command": command_line(), "machine": machine_info(args.threads), "cpu_flags": cpu_flags(),
              "shape": {"layers": LAYERS, "out": N, "in": K}, "rows": args.rows, "ms": times}
    print(format_table(result))
    if args.out:
        write_json(result, args.out)


def compile_kernel(folder: Path):
    """The compiled `mm(x, M, K, packed_w, N, out)` from SOURCE (gcc -O3 -mavx2 -mfma -fopenmp)."""
    library = folder / "small_rows_avx2.so"
    subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o",
                    str(library)], check=True)
    kernel = ctypes.CDLL(str(library)).mm
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    kernel.argtypes = [pointer, integer, integer, pointer, integer, pointer]
    return kernel


def measure(kernel, rows: list[int], repeats: int) -> dict:
    """{"avx2": {k: ms}, "onednn": {k: ms}, "max_abs_error": float} over all layers per pass."""
    generator = np.random.default_rng(0)
    weights = [(generator.standard_normal((N, K)) * 0.02).astype(np.float32) for _ in range(LAYERS)]
    packed = [np.ascontiguousarray(w.reshape(N // 16, 16, K).transpose(0, 2, 1)) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(w), None) for w in weights]
    times = {"avx2": {}, "onednn": {}}
    for k in rows:
        x = generator.standard_normal((k, K)).astype(np.float32)
        out, xt = np.empty((k, N), np.float32), torch.from_numpy(x)

        def avx2():
            for w in packed:
                kernel(x.ctypes.data, k, K, w.ctypes.data, N, out.ctypes.data)

        def library():
            for w in onednn:
                torch.ops.mkldnn._linear_pointwise(xt, w, None, "none", [], "")

        times["avx2"][k] = lower_quartile_ms(avx2, repeats)
        times["onednn"][k] = lower_quartile_ms(library, repeats)
    kernel(x.ctypes.data, k, K, packed[0].ctypes.data, N, out.ctypes.data)
    times["max_abs_error"] = float(np.abs(out - x @ weights[0].T).max())
    return times


def lower_quartile_ms(run, repeats: int) -> float:
    """Lower quartile of `repeats` timed calls of `run` (after 3 warm-up calls), in ms."""
    for _ in range(3):
        run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return float(np.quantile(seconds, 0.25) * 1e3)


def format_table(result: dict) -> str:
    """Markdown: ms per row count for both candidates and each one's ratio to its own one-row time."""
    ms, rows = result["ms"], result["rows"]
    lines = [f"CPU flags: {' '.join(result['cpu_flags'])}; {result['machine']['cpu']}, "
             f"{result['machine']['threads']} threads; {LAYERS} layers of [{K} → {N}]", ""]
    table = [[name] + [f"{ms[name][k]:.2f}" for k in rows] + [f"{ms[name][rows[-1]] / ms[name][rows[0]]:.2f}"]
             for name in ("onednn", "avx2")]
    lines += markdown_table(["ms"] + [f"k={k}" for k in rows] + [f"k={rows[-1]} × k={rows[0]}"], table)
    return "\n".join(lines + ["", f"max |error| vs numpy: {ms['max_abs_error']:.2e}"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.threads < 1 or args.repeats < 1:
        parser.error("--rows, --threads and --repeats must be at least 1")
    return args


if __name__ == "__main__":
    main()
