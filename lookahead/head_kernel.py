"""The learned draft head's whole forward in one compiled call (`draft_head.DraftHead` on the streamed kernel).

The head is five small products and a dozen small operations between them. Run as PyTorch operations, a call
took ~0.31 ms inside a step where its products alone need ~0.14 ms (the default model's head, Zen 5, 2 threads):
every operation's dispatch runs after the model's forward has streamed ~80 MB of weights through the caches and
evicted the dispatcher's working set. Here one numba function does it all: it builds [h; e], calls the streamed
int8 kernel for each product (its panels split between the threads as `streamed_gemm.product` splits them), applies
the per-row scales and biases, the RMS norm, SiLU, the residual add, and picks the k best scores with their softmax
probabilities. The arithmetic is the same formulas in float32 (sums in another order than PyTorch's, so the scores
differ in the last bits: the head only proposes, so nothing here can change an output).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .recycle import _row_top_k
from .streamed_gemm import StreamedWeight, _call_address, _kernel_address, vector_width
from .thread_governor import numba_threads


class CompiledHead:
    """The int8 streamed products of a head (`fc`, per block `gate_up` and `down`, `out`), its biases and norms,
    called as one compiled function. `propose(hidden, embedding, k)`: (token rows [k] int64, probabilities [k])."""

    def __init__(self, fc: StreamedWeight, gate_up: list[StreamedWeight], down: list[StreamedWeight],
                 out: StreamedWeight, norms: list[torch.Tensor], eps: float):
        if len(gate_up) != 1 or len(down) != 1:
            raise ValueError("the compiled head computes heads of one block")
        self._keep = (fc, gate_up, down, out)  # the panels the addresses below point into
        products = [fc, gate_up[0], down[0], out]
        self.panels = np.array([w.panels.data_ptr() for w in products], dtype=np.int64)
        self.blocks = np.array([w.panels.shape[0] for w in products], dtype=np.int64)
        self.widths = np.array([w.in_features for w in products], dtype=np.int64)
        self.outputs = np.array([w.out_features for w in products], dtype=np.int64)
        self.scales = [w.scales.numpy() for w in products]
        self.fc_bias = fc.bias.numpy()
        self.norm = norms[0].numpy()
        self.eps = np.float32(eps)
        self.address = _kernel_address("int8")[0]

    def propose(self, hidden: np.ndarray, embedding: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The `k` best output rows (indices into the head's output vocabulary, best first) and their softmax
        probabilities, for `hidden` [size] and the root's `embedding` [size] (float32)."""
        rows, probs = np.empty(k, np.int64), np.empty(k, np.float32)
        threads = numba_threads(torch.get_num_threads())
        _forward(self.address, self.panels, self.blocks, self.widths, self.outputs, self.scales[0], self.scales[1],
                 self.scales[2], self.scales[3], self.fc_bias, self.norm, self.eps, hidden, embedding,
                 vector_width(), threads, rows, probs)
        return rows, probs


@numba.njit(parallel=True, nogil=True, cache=True)
def _product(address, panels, blocks, width, x, out, threads):  # pragma: no cover - compiled
    """out[:blocks · P] = the int8 kernel's unscaled sums of one row x [width] against `blocks` panels."""
    threads = min(threads, blocks)
    for t in numba.prange(threads):
        _call_address(address, 1, np.int64(x.ctypes.data), 1, panels, np.int64(out.ctypes.data), width,
                      out.shape[0], t * blocks // threads, (t + 1) * blocks // threads)


@numba.njit(nogil=True, cache=True)
def _forward(address, panels, blocks, widths, outputs, s_fc, s_gate_up, s_down, s_out, fc_bias, norm, eps, hidden,
             embedding, vector, threads, rows, probs):  # pragma: no cover - compiled
    """The head's forward (see the module docstring) into rows [k] / probs [k]."""
    size = hidden.shape[0]
    x = np.empty(2 * size, np.float32)
    x[:size] = hidden
    x[size:] = embedding
    a = _scaled(address, panels[0], blocks[0], widths[0], outputs[0], s_fc, x, vector, threads)
    a += fc_bias
    squares = np.float32(0.0)
    for i in range(size):
        squares += a[i] * a[i]
    normed = a * (np.float32(1.0) / np.sqrt(squares / np.float32(size) + eps)) * norm
    gate_up = _scaled(address, panels[1], blocks[1], widths[1], outputs[1], s_gate_up, normed, vector, threads)
    inter = gate_up.shape[0] // 2
    mixed = np.empty(inter, np.float32)
    for i in range(inter):
        gate = gate_up[i]
        mixed[i] = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[inter + i]
    a += _scaled(address, panels[2], blocks[2], widths[2], outputs[2], s_down, mixed, vector, threads)
    scores = _scaled(address, panels[3], blocks[3], widths[3], outputs[3], s_out, a, vector, threads)
    _top(scores, rows, probs)


@numba.njit(nogil=True, cache=True)
def _scaled(address, panels, blocks, width, outputs, scales, x, vector, threads):  # pragma: no cover - compiled
    """[outputs] float32: x's product with the int8 panels, each output scaled by its row's scale."""
    sums = np.empty(blocks * vector, np.float32)
    _product(address, panels, blocks, width, x, sums, threads)
    return sums[:outputs] * scales


@numba.njit(nogil=True, cache=True)
def _top(scores, rows, probs):  # pragma: no cover - compiled
    """rows [k] = the indices of the k largest scores, best first (`recycle._row_top_k`: ties to the lower index,
    NaN never picked, -1 where nothing was); probs [k] = their softmax probabilities over all scores."""
    best = np.empty(rows.shape[0], np.float32)
    _row_top_k(scores, rows, best)
    total = 0.0
    for v in range(scores.shape[0]):
        total += np.exp(np.float64(scores[v] - best[0]))
    for j in range(rows.shape[0]):
        probs[j] = np.exp(np.float64(best[j] - best[0])) / total
