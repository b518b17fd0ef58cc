"""One rank of the tensor-parallel tests (run by `torch.distributed.run` from tests/test_distributed.py).

Loads the tiny model folder with `tp_plan="auto"` (gloo on CPU), plans each generation on a cost curve that
differs between ranks (and on each rank's own timings), and writes what it generated to `<out>/rank<R>.json`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import lookahead
from lookahead import LookaheadConfig, hf
from lookahead.cost_curve import CURVE_SIZES, CostCurve
from lookahead.row_kernels import RowKernels

CHEAP = CostCurve(CURVE_SIZES, (1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.1, 1.2, 1.4, 1.6), 0.01)  # speculate wide
DEAR = CostCurve(CURVE_SIZES, tuple(float(k) for k in CURVE_SIZES), 0.01)  # never worth a draft


def main(folder: str, out: str, prompts: list[list[int]], new_tokens: int) -> None:
    """Generate greedy (plain and lookahead), seeded and unseeded sampled; dump per-rank results."""
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    rank = dist.get_rank()
    curve = CHEAP if rank == 0 else DEAR  # a rank that followed its own curve would verify other shapes
    hf.cost_curve_for = lambda model, refresh=False, quiet=False, batch=1, rows=None: replace(curve, batch=batch)
    hf.row_kernels_for = lambda model, refresh=False, quiet=False: RowKernels(1, 0)  # the same on every rank
    torch.manual_seed(100 + rank)  # unseeded sampling must still agree: rank 0's generator is adopted
    results = {"rank": rank, "runs": []}
    for ids in prompts:
        prompt = torch.tensor([ids])
        plain = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        decoder = lookahead.Lookahead(LookaheadConfig())
        fast = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, custom_generate=decoder)
        seeded = model.generate(prompt, max_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                                custom_generate=lookahead.Lookahead(LookaheadConfig(seed=7)))
        unseeded = model.generate(prompt, max_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                                  custom_generate=lookahead.Lookahead(LookaheadConfig()))
        results["runs"].append({"plain": plain[0].tolist(), "lookahead": fast[0].tolist(),
                                "seeded": seeded[0].tolist(), "unseeded": unseeded[0].tolist(),
                                "steps": decoder.last_stats.steps, "new_tokens": decoder.last_stats.new_tokens})
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
