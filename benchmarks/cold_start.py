"""A server's cold start: a new process, ``load_compiled``, the first step's output, by part.

    python benchmarks/cold_start.py OUT.json [--runs 2]

Builds (once, in this process) an artifact of the 1.17 B PRX with random weights, ``prx-1024-bf16-
static`` (one engine set, 1024² batch 2), then starts new Python processes that each time, from the
moment the parent starts them: the interpreter, ``import torch``, ``import prx_compile``,
``load_compiled`` (reading and verifying 2.3 GB, the model class and weights, the engine sets' state;
Torch-TensorRT and the kernel packages imported in a thread meanwhile), the engines' deserialisation
(``build()``) and the first step's output (CUDA graph capture included). Each is run with the imports
ahead (the default) and without them (``_import_ahead`` off: 0.16's order). The kernel packages are
whatever this environment has: run it once with the default install (the ``cudnn`` extra) and once
with ``flash4`` too. The OS file cache is warm after the first child (each variant runs ``--runs``
times; the report keeps all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = r"""
import json, sys, time
T = {"start": time.time()}
import torch
T["torch"] = time.time()
import prx_compile
from prx_compile.io import saving
T["prx_compile"] = time.time()
if sys.argv[2] == "sequential":
    saving._import_ahead = lambda manifest: None
ct = prx_compile.load_compiled(sys.argv[1])
T["load_compiled"] = time.time()
ct.build()
torch.cuda.synchronize()
T["engines"] = time.time()
kw = {k: v.cuda() for k, v in torch.load(sys.argv[1] + ".inputs.pt").items()}
out = ct(**kw, return_dict=False)[0]
torch.cuda.synchronize()
T["first_step"] = time.time()
ref = torch.load(sys.argv[1] + ".ref.pt").cuda().float()
T["rel_err"] = float((out.float() - ref).norm() / ref.norm())
names = ("diffusers", "torch_tensorrt", "cudnn", "flash_attn.cute")
T["modules"] = sorted(m for m in names if m in sys.modules)
print("RESULT " + json.dumps(T))
"""


def log(msg: str) -> None:
    print(f"[cold {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build(path: Path) -> dict:
    from prx_compile import compile_prx, save_compiled
    from prx_compile.tools.bench import Case
    from prx_compile.tools.testing import FULL_PRX, make_prx

    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, config="prx-1024-bf16-static")
    kw = Case((1024, 1024), 2).inputs(model, torch.bfloat16, "cuda")
    t0 = time.perf_counter()
    out = ct(**kw, return_dict=False)[0]
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_compiled(ct, path)
    saved = time.perf_counter() - t0
    torch.save({k: v.cpu() for k, v in kw.items()}, str(path) + ".inputs.pt")
    torch.save(out.cpu(), str(path) + ".ref.pt")
    return {"first_call_s": round(first, 2), "save_s": round(saved, 2), "kernels": ct.report()["kernels"]}


def child(path: Path, mode: str) -> dict:
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, timeout=300
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": r.stderr[-2000:]}
    t = json.loads(line[7:])
    order = ["start", "torch", "prx_compile", "load_compiled", "engines", "first_step"]
    parts = {"interpreter_s": t["start"] - t0}
    for a, b in zip(order, order[1:], strict=False):
        parts[f"{b}_s"] = t[b] - t[a]
    parts = {k: round(v, 3) for k, v in parts.items()}
    parts["process_start_to_first_step_s"] = round(t["first_step"] - t0, 3)
    parts["rel_err_vs_the_building_process"] = t["rel_err"]
    parts["imported"] = t["modules"]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--artifact", default="/tmp/prx_cold.art")
    args = ap.parse_args()
    path = Path(args.artifact)
    from prx_compile.ops import cudnn_attention, flash4_attention

    result = {
        "what": "cold start: new process -> load_compiled -> first step, by part "
        "(1.17 B PRX, prx-1024-bf16-static)",
        "packages": {
            "cudnn_frontend": cudnn_attention.installed(),
            "flash_attn_4": flash4_attention.installed(),
        },
        "cpus": os.cpu_count(),
    }
    log("building the artifact ...")
    result["build"] = build(path)
    log(f"built: {result['build']}")
    torch.cuda.empty_cache()
    runs = []
    for i in range(args.runs):
        for mode in ("ahead", "sequential"):
            r = child(path, mode)
            r.update(mode=mode, run=i)
            runs.append(r)
            log(json.dumps(r))
    result["runs"] = runs
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
