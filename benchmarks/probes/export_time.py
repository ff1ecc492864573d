"""How long ``export_prx`` takes with every block traced and with one block traced and copied (CPU).

    python benchmarks/probes/export_time.py OUT.json [--reps 2] [--depth 16]

The full-size PRX config (hidden 1792, 28 heads, ``--depth`` blocks), bf16 on the CPU: export runs on
fake tensors, so no device is needed and its time is the build's export phase. Two engine sets of
the default call: the static 1024² batch-2 set, and the range set (batch 1..2, latent 88..180,
text 1..256) exported at 832x1216. For each, ``--reps`` rounds of (every block, one block copied),
alternating in one process, each followed by ``run_decompositions({})`` (the retrace a backend
does next: Torch-TensorRT's own decompositions retrace the same way). Minimum and all times ->
OUT.json. A CPU measurement: it says nothing of the GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from prx_compile.export import example_inputs, export_prx
from prx_compile.shapes import ShapeRange
from prx_compile.tools.testing import make_prx

SETS = {
    "static 1024x1024 b2": (ShapeRange.static(2, 128, 128, 256), (2, 128, 128)),
    "range (default), at 832x1216 b2": (ShapeRange((1, 2), (88, 180), (88, 180), (1, 256)), (2, 104, 152)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--depth", type=int, default=16)
    args = ap.parse_args()
    model = make_prx({"depth": args.depth}, dtype=torch.bfloat16)
    res: dict = {
        "what": "export_prx seconds on the CPU, every block traced vs one block traced and copied",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "depth": args.depth,
        "sets": {},
    }
    for label, (shapes, (b, h, w)) in SETS.items():
        kw = example_inputs(model.config, b, h, w, 256, dtype=torch.bfloat16, masked_tokens=64)
        export_prx(make_prx({"depth": 2}, dtype=torch.bfloat16), kw, shapes, weights="inputs")  # warm
        times: dict[str, list] = {"every block": [], "one block copied": []}
        for _ in range(args.reps):
            for name, once in (("every block", False), ("one block copied", True)):
                t0 = time.perf_counter()
                ep, _ = export_prx(
                    model, kw, shapes, weights="inputs", fuse_attention=True, trace_blocks_once=once
                )
                export_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                ep.run_decompositions({})
                times[name].append({"export_s": export_s, "decompositions_s": time.perf_counter() - t0})
                print(label, name, times[name][-1], flush=True)
        res["sets"][label] = {
            name: {
                "export_s_min": min(t["export_s"] for t in runs),
                "decompositions_s_min": min(t["decompositions_s"] for t in runs),
                "runs": runs,
            }
            for name, runs in times.items()
        }
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
