"""Tree attention (Triton) vs SDPA with a dense 4D mask, per call, for several tree sizes and prefix lengths.

    python benchmarks/bench_tree_attention.py [--dtype bf16] [--heads 32] [--kv-heads 8] [--head-dim 128]

Needs a CUDA GPU; on a machine without one it says so and exits 0. The SDPA side is what a model runs without the
kernel: key/value heads repeated for GQA (as transformers does when a mask is given) and the additive mask
`[B, 1, T, prefix_len + T]`, built once outside the timing. Each configuration is checked for agreement first.
"""

from __future__ import annotations

import argparse
import sys

import torch

PREFIX_LENS = (128, 512, 2048, 8192)
TREE_SIZES = (8, 16, 32, 64)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    return parser.parse_args(argv)


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """`[T, T]` ancestor mask of a random tree rooted at row 0."""
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def dense_additive_mask(tree_mask: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`[T, T]` bool -> `[1, 1, T, prefix_len + T]` additive mask (0 = attend, dtype min = blocked)."""
    T = tree_mask.shape[0]
    visible = torch.cat([torch.ones(T, prefix_len, dtype=torch.bool, device=tree_mask.device), tree_mask], dim=1)
    zero = torch.zeros((), dtype=dtype, device=tree_mask.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[None, None]


def measure(args: argparse.Namespace, prefix_len: int, T: int) -> tuple[float, float]:
    """Median milliseconds per call of (tree_attention, SDPA with a dense mask) for one configuration."""
    from triton.testing import do_bench

    from lookahead.kernels import tree_attention

    dtype, group = DTYPES[args.dtype], args.heads // args.kv_heads
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(args.batch, args.heads, T, args.head_dim, dtype=dtype, device="cuda")
    k, v = (
        torch.randn(args.batch, args.kv_heads, prefix_len + T, args.head_dim, dtype=dtype, device="cuda")
        for _ in range(2)
    )
    tree_mask = random_tree_mask(T, gen).cuda()
    dense = dense_additive_mask(tree_mask, prefix_len, dtype)

    def sdpa() -> torch.Tensor:
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=dense)

    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tree_attention(q, k, v, tree_mask), sdpa(), atol=tolerance, rtol=tolerance)
    return (
        do_bench(lambda: tree_attention(q, k, v, tree_mask), return_mode="median"),
        do_bench(sdpa, return_mode="median"),
    )


def main(argv: list[str] | None = None) -> int:
    """Print a table of timings; returns the exit status."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tree_attention needs a CUDA GPU (Triton has no CPU backend); nothing measured.")
        return 0
    print(
        f"{torch.cuda.get_device_name()}  {args.dtype}  B={args.batch} H={args.heads} "
        f"H_kv={args.kv_heads} D={args.head_dim}"
    )
    print(f"{'prefix':>7} {'T':>4} {'tree ms':>9} {'sdpa ms':>9} {'speedup':>8}")
    for prefix_len in PREFIX_LENS:
        for T in TREE_SIZES:
            tree_ms, sdpa_ms = measure(args, prefix_len, T)
            print(f"{prefix_len:>7} {T:>4} {tree_ms:>9.4f} {sdpa_ms:>9.4f} {sdpa_ms / tree_ms:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
