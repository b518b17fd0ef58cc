"""Tree attention: the reference against a dense-mask softmax, the Triton kernel against the reference (in
Triton's interpreter on CPU, compiled on CUDA), the kernel's input validation, and that it compiles for NVIDIA
GPUs (no GPU needed)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import torch


import pytest
import triton
from triton.runtime.jit import JITFunction

from lookahead.kernels import reference, tree_attention

# The submodule, not the function of the same name that `lookahead.kernels` exports.
kernel_module = importlib.import_module("lookahead.kernels.tree_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tests/conftest.py switches Triton's interpreter on before triton is first imported when there is no GPU.
KERNEL_RUNS_HERE = DEVICE == "cuda" or kernel_module._interpreting()

needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")

TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol


def test_kernel_path_runs_in_this_process():
    """Fails (never skips) if the kernel could neither compile (CUDA) nor run in Triton's interpreter."""
    assert KERNEL_RUNS_HERE, "TRITON_INTERPRET must be set before triton is imported (see tests/conftest.py)"


@pytest.fixture
def poisoned(monkeypatch):
    """Make `torch.empty_like`, which allocates the kernel's output, return NaN-filled tensors, so an element
    the kernel does not write stays NaN. Returns the list of poisoned shapes (to check the poison was used)."""
    shapes = []
    empty_like = torch.empty_like

    def nan_like(t, *args, **kwargs):
        shapes.append(tuple(t.shape))
        return empty_like(t, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty_like", nan_like)
    return shapes


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """`[T, T]` bool: row i sees j iff j is i or an ancestor of i. `parents[i] < i`, -1 for a root."""
    T = len(parents)
    mask = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor mask of a random tree rooted at row 0: each node's parent is a uniformly chosen earlier node."""
    return ancestor_mask([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)])


def random_masks(kind: str, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """`[B, T, T]` ancestor masks of random trees ("tree") or one shared `[T, T]` random mask ("arbitrary",
    diagonal set)."""
    if kind == "tree":
        return torch.stack([random_tree_mask(T, gen) for _ in range(B)])
    return (torch.rand(T, T, generator=gen) < 0.4) | torch.eye(T, dtype=torch.bool)


def random_inputs(B, H, H_kv, T, prefix_len, D, dtype=torch.float32, device="cpu", seed=0):
    """q `[B, H, T, D]`, k and v `[B, H_kv, prefix_len + T, D]`."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, H_kv, prefix_len + T, D, generator=gen)
    v = torch.randn(B, H_kv, prefix_len + T, D, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def dense_attention(q, k, v, tree_mask, scale=None):
    """Textbook float64 attention with a dense `[T, S]` visibility mask: prefix all visible, tree block masked,
    diagonal forced on."""
    B, H, T, D = q.shape
    S = k.shape[2]
    group = H // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    tree = tree_mask.expand(B, T, T) | torch.eye(T, dtype=torch.bool)
    visible = torch.cat([torch.ones(B, T, S - T, dtype=torch.bool), tree], dim=-1)  # [B, T, S]
    scores = q.double() @ k.transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # [B, H, T, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return scores.softmax(-1) @ v  # [B, H, T, D]


# B, H, H_kv, T, prefix_len, D. Blocks: 16 query rows; 64 key rows (fp16 up to D=128, fp32 up to D=64), else
# 32 (fp32 D=128).
KERNEL_CASES = [
    (1, 1, 1, 1, 0, 32),  # one row, empty cache
    (1, 2, 2, 2, 1, 16),
    (2, 4, 2, 5, 63, 32),  # prefix one short of a block
    (1, 4, 1, 16, 64, 64),  # exactly one row block and one prefix block; multi-query
    (2, 2, 1, 17, 65, 64),  # one past both: padding rows, a 1-column prefix block
    (1, 4, 4, 33, 0, 128),  # no prefix
    (3, 2, 2, 40, 100, 32),
    (1, 2, 1, 64, 129, 128),  # the largest tree
    (2, 6, 3, 64, 7, 64),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("kind", ["tree", "arbitrary"])
def test_reference_matches_dense_softmax(case, kind):
    B, H, H_kv, T, prefix_len, D = case
    q, k, v = random_inputs(*case)
    masks = random_masks(kind, B, T, torch.Generator().manual_seed(T))
    expected = dense_attention(q, k, v, masks, scale=0.3)
    torch.testing.assert_close(reference.tree_attention(q, k, v, masks, scale=0.3), expected.float())


def test_diagonal_is_always_visible():
    q, k, v = random_inputs(2, 2, 1, 6, 5, 16)
    nothing = torch.zeros(6, 6, dtype=torch.bool)
    diagonal = torch.eye(6, dtype=torch.bool)
    torch.testing.assert_close(
        reference.tree_attention(q, k, v, nothing), reference.tree_attention(q, k, v, diagonal)
    )


def test_reference_keeps_low_precision_dtype():
    q, k, v = random_inputs(1, 2, 1, 4, 3, 16, dtype=torch.bfloat16)
    out = reference.tree_attention(q, k, v, torch.ones(4, 4, dtype=torch.bool))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("kind", ["tree", "arbitrary"])
def test_kernel_matches_reference_fp32(poisoned, case, kind):
    check_kernel(case, kind, torch.float32, poisoned)


# Triton's interpreter cannot run `tl.dot` on bfloat16 (it multiplies the raw bit patterns, triton-lang/triton
# issue 11584; unsupported upstream), so bfloat16 is checked on CUDA only.
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_cuda)])
@pytest.mark.parametrize("case", KERNEL_CASES[2:6])
def test_kernel_matches_reference_low_precision(poisoned, case, dtype):
    check_kernel(case, "tree", dtype, poisoned)


def check_kernel(case, kind, dtype, poisoned):
    """Kernel vs reference (computed from the same rounded inputs) on one case; every element written."""
    B, H, H_kv, T, prefix_len, D = case
    q, k, v = random_inputs(*case, dtype=dtype, device=DEVICE, seed=prefix_len)
    masks = random_masks(kind, B, T, torch.Generator().manual_seed(T)).to(DEVICE)
    out = tree_attention(q, k, v, masks)
    assert poisoned == [tuple(q.shape)]
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any(), "the kernel left elements unwritten"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, masks), atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix_len", [0, 20])
def test_kernel_treats_diagonal_as_visible(prefix_len):
    """With no prefix, a row of the second tree block (fp32, D=128: 32 rows per block) sees nothing in the first."""
    q, k, v = random_inputs(1, 2, 2, 40, prefix_len, 128, device=DEVICE)
    nothing = torch.zeros(40, 40, dtype=torch.bool, device=DEVICE)
    out = tree_attention(q, k, v, nothing, scale=0.5)
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, nothing, scale=0.5), atol=2e-5, rtol=2e-5)


def test_kernel_reads_bit_63():
    """Row 0 seeing row 63 sets the sign bit of row 0's bitmask word."""
    q, k, v = random_inputs(1, 1, 1, 64, 3, 16, device=DEVICE)
    mask = torch.eye(64, dtype=torch.bool, device=DEVICE)
    mask[0, 63] = mask[63, 0] = True
    torch.testing.assert_close(tree_attention(q, k, v, mask), reference.tree_attention(q, k, v, mask))


def with_shape(t: torch.Tensor, *shape: int) -> torch.Tensor:
    """Zeros of `shape` in t's dtype."""
    return torch.zeros(*shape, dtype=t.dtype)


# name, how to spoil valid (q, k, v, tree_mask), exception, message fragment
INVALID = [
    ("q rank", lambda q, k, v, m: (q[0], k, v, m), ValueError, "q must be 4D"),
    ("k/v shapes", lambda q, k, v, m: (q, k, v[:, :, 1:], m), ValueError, "same shape"),
    ("batch", lambda q, k, v, m: (q[:1], k, v, m), ValueError, "batch or head size"),
    ("heads", lambda q, k, v, m: (with_shape(q, 2, 3, 4, 16), k, v, m), ValueError, "multiple of key/value heads"),
    ("too short", lambda q, k, v, m: (q, k[:, :, :3], v[:, :, :3], m), ValueError, "must be >= the number"),
    ("mask dtype", lambda q, k, v, m: (q, k, v, m.float()), ValueError, "bool"),
    ("mask shape", lambda q, k, v, m: (q, k, v, m[:, :3]), ValueError, r"\[T, T\] or \[B, T, T\]"),
    ("T too large", lambda q, k, v, m: (with_shape(q, 2, 4, 65, 16), with_shape(k, 2, 2, 70, 16),
                                        with_shape(v, 2, 2, 70, 16), torch.eye(65, dtype=torch.bool)),
     ValueError, "at most 64 tree rows"),
    ("head size", lambda q, k, v, m: (with_shape(q, 2, 4, 4, 24), with_shape(k, 2, 2, 9, 24),
                                      with_shape(v, 2, 2, 9, 24), m), ValueError, "head sizes"),
    ("q dtype", lambda q, k, v, m: (q.double(), k.double(), v.double(), m), TypeError, "float32, float16"),
    ("dtype mismatch", lambda q, k, v, m: (q, k.half(), v, m), TypeError, "share one dtype"),
    ("non-contiguous", lambda q, k, v, m: (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, m), ValueError,
     "q must be contiguous"),
]


@pytest.mark.parametrize("name, spoil, error, match", INVALID, ids=[row[0] for row in INVALID])
def test_kernel_rejects_bad_inputs(name, spoil, error, match):
    q, k, v = random_inputs(2, 4, 2, 4, 5, 16)
    tree_mask = torch.eye(4, dtype=torch.bool)
    with pytest.raises(error, match=match):
        tree_attention(*spoil(q, k, v, tree_mask))


def test_kernel_refuses_cpu_tensors_when_compiled(monkeypatch):
    compiled = JITFunction(kernel_module._tree_attention_kernel.fn)
    monkeypatch.setattr(kernel_module, "_tree_attention_kernel", compiled)
    q, k, v = random_inputs(1, 2, 1, 4, 5, 16)
    with pytest.raises(ValueError, match="lookahead.kernels.reference.tree_attention"):
        tree_attention(q, k, v, torch.eye(4, dtype=torch.bool))


@needs_cuda
def test_kernel_refuses_mixed_devices():
    q, k, v = random_inputs(1, 2, 1, 4, 5, 16, device="cuda")
    with pytest.raises(ValueError, match="tree_mask is on cpu"):
        tree_attention(q, k, v, torch.eye(4, dtype=torch.bool))


# Run in a process without TRITON_INTERPRET (interpreted kernels cannot be compiled). Needs no GPU: Triton ships
# ptxas. 99 KB is the shared memory limit of sm_86/sm_89, the smallest of the targets from sm_80 up.
GPU_COMPILE_SCRIPT = """
import importlib, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module = importlib.import_module("lookahead.kernels.tree_attention")
kernel = module._tree_attention_kernel
names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def arg_type(name, dtype):
    if name.isupper():
        return "constexpr"
    if name.endswith("_ptr"):
        return "*i64" if name == "words_ptr" else "*" + names[dtype]
    return "fp32" if name == "qk_scale" else "i32"


for arch, dtype, head_dim in [(75, torch.float16, 256), (80, torch.float16, 128), (80, torch.float32, 256),
                              (90, torch.bfloat16, 64)]:
    signature = {name: arg_type(name, dtype) for name in kernel.arg_names}
    constants = {"HEAD_DIM": head_dim, "BLOCK_M": module.BLOCK_M, "BLOCK_N": module.key_block_rows(head_dim, dtype)}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32))
    assert compiled.metadata.shared <= 99 * 1024, (arch, dtype, head_dim, compiled.metadata.shared)
"""


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton's NVIDIA backend is not installed")
def test_kernel_compiles_for_nvidia_gpus():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", GPU_COMPILE_SCRIPT]
    result = subprocess.run(command, env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-5000:]
