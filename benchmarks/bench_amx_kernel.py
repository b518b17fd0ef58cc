"""The AMX kernels against the streamed kernel on the default model's products: its 4-bit layers on the AMX
kernel (`lookahead/amx_kernel.py`), or with `--head` its 8-bit LM head on the AMX-INT8 kernel (`amx_int8.py`).

    python benchmarks/bench_amx_kernel.py [--rows 1 2 4 8 12 16] [--repeats 12] [--threads 2] [--layers 30]
                                          [--head] [--out FILE.json]

Each kernel computes the model's layer products (q/k/v, o, gate/up, down of its first `--layers` layers: all 30,
120 products, by default) for a given number of rows, called as a fused step calls them (`streamed_gemm._launch`,
no Python between the products, each product's rows prepared or transposed before its threads start): "cached",
the first layer's four products once per layer (their weights stay in the core's caches), and "streamed", every
layer's (the default model's 66 MB of 4-bit weights read from memory each pass, as in a step). Per row count: the
median of `--repeats` passes, the kernels interleaved, and each kernel's largest error relative to float64 over
one layer's products. With `--head`: the LM head's product (49152 × 576, Q8_0), "cached" called back to back and
"evicted" after writing 256 MB (untimed) before each call, as a step's layers evict it. Needs a CPU with AMX (and
AMX-INT8 for `--head`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harness import command_line, machine_info, markdown_table, write_json

KINDS = ("amx4", "affine4h")  # the layers: the AMX kernel's layout, the streamed kernel's
HEAD_KINDS = ("amx8", "scaled8")  # the LM head: the AMX-INT8 kernel's layout, the streamed kernel's
EVICT_BYTES = 256 << 20  # written before each "evicted" call of the head


def main(argv: list[str] | None = None) -> None:
    """Time both kernels at each row count, print the table, write JSON."""
    args = parse_args(argv)
    from lookahead import amx_int8, amx_kernel
    from lookahead.models import load_model

    if not amx_kernel.available() or (args.head and not amx_int8.available()):
        sys.exit("bench_amx_kernel needs a CPU with AMX (amx_tile, amx_bf16; amx_int8 for --head) and AVX-512, and "
                 "AMX granted by Linux")
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    kinds = HEAD_KINDS if args.head else KINDS
    if args.head:
        products = [layer_product(model.lm_head.weight.detach(), kinds)]
        modes = (("cached", products, None), ("evicted", products, torch.zeros(EVICT_BYTES // 4)))
    else:
        products = [layer_product(weight, kinds) for weight in layer_weights(model)[:4 * args.layers]]
        modes = (("cached", products[:4] * args.layers, None), ("streamed", products, None))
    results = []
    for rows in args.rows:
        errors = {kind: accuracy(products[:4], kind, rows) for kind in kinds}
        for mode, chosen, evict in modes:
            times = timed(chosen, rows, args.repeats, args.threads, kinds, evict)
            results.append({"rows": rows, "mode": mode, **{f"{kind}_ms": times[kind] for kind in kinds},
                            **{f"{kind}_error": errors[kind] for kind in kinds}})
    tile, other = kinds
    header = ["rows", "weights", f"{tile} ms", f"{other} ms", f"{tile} / {other}", f"{tile} rel. error",
              f"{other} rel. error"]
    print("\n".join(markdown_table(header, [
        [str(r["rows"]), r["mode"], f"{r[f'{tile}_ms']:.2f}", f"{r[f'{other}_ms']:.2f}",
         f"{r[f'{tile}_ms'] / r[f'{other}_ms']:.2f}", f"{r[f'{tile}_error']:.1e}", f"{r[f'{other}_error']:.1e}"]
        for r in results])))
    if args.out:
        write_json({"command": command_line(), "machine": machine_info(args.threads), "results": results},
                   Path(args.out))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16], choices=range(1, 65))
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="threads splitting each product's panels")
    parser.add_argument("--layers", type=int, default=30, choices=range(1, 31), metavar="1..30")
    parser.add_argument("--head", action="store_true", help="the 8-bit LM head on the AMX-INT8 kernel instead")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def layer_weights(model) -> list[torch.Tensor]:
    """The 120 layer products of the model as its fused steps stack them: q/k/v, o, gate/up, down per layer."""
    out = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for parts in ([attention.q_proj, attention.k_proj, attention.v_proj], [attention.o_proj],
                      [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
            out.append(torch.cat([part.weight.detach() for part in parts]))
    return out


def layer_product(weight: torch.Tensor, kinds: tuple[str, str] = KINDS) -> dict:
    """The weight (float32, as a key "weight") and its two layouts `kinds` (a tile kernel's, the streamed
    kernel's), by kind."""
    from lookahead import affine_weights

    tile, other = kinds
    packed = {"weight": weight, tile: affine_weights.pack_stacked([weight]),
              other: affine_weights.pack_stacked([weight], amx=False)}
    if packed[tile].kind != tile or packed[other].kind != other:
        raise ValueError(f"a product of width {weight.shape[1]} does not run on the {tile} and {other} kernels")
    return packed


def accuracy(products: list[dict], kind: str, rows: int) -> float:
    """The largest error of `kind`'s products relative to the largest float64 result, over `products`."""
    from lookahead import streamed_gemm

    worst = 0.0
    for product in products:
        weight = product["weight"]
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ weight.double().t()
        got = streamed_gemm.product(x, product[kind])
        worst = max(worst, ((got.double() - exact).abs().max() / exact.abs().max()).item())
    return worst


def timed(products: list[dict], rows: int, repeats: int, threads: int, kinds: tuple[str, str] = KINDS,
          evict: torch.Tensor | None = None) -> dict[str, float]:
    """Median ms of one pass over `products` on each kernel of `kinds`, interleaved; `evict`: a buffer written
    before each pass (untimed)."""
    from lookahead import streamed_gemm

    kept: list = []  # the tensors the calls' addresses point into
    calls = {kind: [launch_arguments(product[kind], rows, threads, kept) for product in products] for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            if evict is not None:
                evict.add_(1.0)
            start = time.perf_counter()
            for call in calls[kind]:
                streamed_gemm._launch(*call)
            times[kind].append(time.perf_counter() - start)
    return {kind: float(np.median(values) * 1e3) for kind, values in times.items()}


def launch_arguments(weight, rows: int, threads: int, kept: list) -> tuple:
    """The arguments of `streamed_gemm._launch` computing `rows` random rows times `weight`, as
    `fused_kernels.product` passes them; the tensors they point into are appended to `kept`."""
    from lookahead import streamed_gemm

    k, panels = weight.in_features, weight.panels.shape[0]
    x = torch.randn(rows, k)
    scratch = torch.empty(streamed_gemm.product_scratch(rows, k))
    y = torch.empty(rows, panels * 16)
    kept.append((x, scratch, y))
    address, transpose = streamed_gemm._kernel_address(weight.kind)
    return (address, transpose, rows, x.data_ptr(), scratch.data_ptr() if rows > 1 else x.data_ptr(),
            weight.panels.data_ptr(), y.data_ptr(), k, panels * 16, panels, min(threads, panels))


if __name__ == "__main__":
    main()
