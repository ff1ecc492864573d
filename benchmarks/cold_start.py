"""A server's cold start: a new process, ``load_compiled``, the first step's output, by part.

    python benchmarks/cold_start.py OUT.json [--runs 2] [--modes ahead parts profile]

Builds (once, in this process) an artifact of the 1.17 B PRX with random weights, ``prx-1024-bf16-
static`` (one engine set, 1024² batch 2), then starts new Python processes that each time, from the
moment the parent starts them: the interpreter, ``import torch``, ``import prx_compile``,
``load_compiled`` (reading and verifying 2.3 GB, the model class and weights, the engine sets' state;
TensorRT's bindings and the kernel packages imported in a thread meanwhile), the engines' deserialisation
(``build()``) and the first step's output (CUDA graph capture included). The OS file cache is warm
after the first child (each variant runs ``--runs`` times; the report keeps all).

``--floor N``: N new processes that import only torch and diffusers' PRX classes (the model, then
the pipeline), nothing of ours: what any process that makes a diffusers module pays before it can
step; and ``python -X importtime`` of that and of ``import prx_compile`` (the slowest modules).

Modes: ``ahead`` (the default load, the figure a server sees), ``parts`` (each import timed on its
own before the load, no overlap), ``profile`` (cProfile of the load and the first step: the functions
with the most cumulative time). Extras: ``cudnn`` (an artifact built with ``attention_kernel:
cudnn``, run with only the cuDNN frontend importable of the extras: no flash-attn-4, no torchao) and,
where installed, ``flash4``.
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
mode, extras = sys.argv[2], sys.argv[3]
import torch
T["torch"] = time.time()
import prx_compile
from prx_compile.io import saving
T["prx_compile"] = time.time()
parts = {}
if mode == "parts":  # each import the load needs, on its own, before it (no overlap)
    import threading
    def _started(manifest):
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread
    saving._import_ahead = _started
    t = time.time(); from diffusers import PRXTransformer2DModel; parts["diffusers_s"] = time.time() - t
    from prx_compile.backends.tensorrt import engine
    t = time.time(); engine.bindings(); parts["tensorrt_bindings_s"] = time.time() - t
    t = time.time(); import cudnn; parts["cudnn_frontend_s"] = time.time() - t
    if extras != "cudnn":
        t = time.time(); import flash_attn.cute; parts["flash_attn_4_s"] = time.time() - t
T["imports"] = time.time()
prof = None
if mode == "profile":
    import cProfile
    prof = cProfile.Profile(); prof.enable()
ct = prx_compile.load_compiled(sys.argv[1])
T["load_compiled"] = time.time()
ct.build()
torch.cuda.synchronize()
T["engines"] = time.time()
kw = {k: v.cuda() for k, v in torch.load(sys.argv[1] + ".inputs.pt").items()}
out = ct(**kw, return_dict=False)[0]
torch.cuda.synchronize()
T["first_step"] = time.time()
if prof is not None:
    import pstats
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:45]
    T["profile"] = [
        [f"{k[0].split('site-packages/')[-1]}:{k[1]}:{k[2]}", round(v[3], 3), round(v[2], 3)] for k, v in rows
    ]
ref = torch.load(sys.argv[1] + ".ref.pt").cuda().float()
T["rel_err"] = float((out.float() - ref).norm() / ref.norm())
names = ("diffusers", "torch_tensorrt", "tensorrt_rtx", "tensorrt", "cudnn", "flash_attn.cute")
T["modules"] = sorted(m for m in names if m in sys.modules)
T["parts"] = parts
T["set_timings"] = {k: round(v, 3) for k, v in ct.backends[0].timings.items()}
T["load_s"] = round(ct.load_s, 3)
print("RESULT " + json.dumps(T))
"""


FLOOR = r"""
import json, sys, time
T = {"start": time.time()}
import torch
T["torch"] = time.time()
from diffusers import PRXTransformer2DModel
T["diffusers_model_class"] = time.time()
from diffusers import PRXPipeline
T["diffusers_pipeline_class"] = time.time()
print("RESULT " + json.dumps(T))
"""


def floor(runs: int) -> dict:
    """The imports a process that makes a diffusers PRX module cannot skip, and where they go."""
    out: dict = {"runs": [], "importtime": {}}
    env = cudnn_only_env()
    for _ in range(runs):
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-c", FLOOR], capture_output=True, text=True, timeout=300, env=env
        )
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            out["runs"].append({"error": r.stderr[-2000:]})
            continue
        t = json.loads(line[7:])
        order = ["start", "torch", "diffusers_model_class", "diffusers_pipeline_class"]
        row = {"interpreter_s": round(t["start"] - t0, 3)}
        row.update({f"{b}_s": round(t[b] - t[a], 3) for a, b in zip(order, order[1:], strict=False)})
        row["process_start_to_model_class_s"] = round(t["diffusers_model_class"] - t0, 3)
        out["runs"].append(row)
        log(f"floor: {row}")
    for name, code in (
        ("diffusers_model_class", "import torch; from diffusers import PRXTransformer2DModel"),
        ("prx_compile", "import torch; import prx_compile; from prx_compile.io import saving"),
    ):
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        rows = []
        for ln in r.stderr.splitlines():  # "import time: self | cumulative | name"
            parts = ln.split("|")
            if ln.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
                rows.append((int(parts[1]), parts[2].rstrip()))
        rows.sort(reverse=True)
        out["importtime"][name] = [[n, round(us / 1e6, 3)] for us, n in rows[:30]]
    return out


def log(msg: str) -> None:
    print(f"[cold {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build(path: Path, **overrides) -> dict:
    from prx_compile import compile_prx, save_compiled
    from prx_compile.tools.bench import Case
    from prx_compile.tools.testing import FULL_PRX, make_prx

    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    ct = compile_prx(model, config="prx-1024-bf16-static", **overrides)
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


def cudnn_only_env() -> dict:
    """This process's environment with only the ``cudnn`` extra importable: every PYTHONPATH entry that
    holds flash-attn-4 or torchao (the device kit's extras) is replaced by a folder that links the
    cuDNN frontend alone."""
    import cudnn

    package = Path(cudnn.__file__).resolve().parent
    only = Path("/tmp/prx_cudnn_only")
    only.mkdir(exist_ok=True)
    for src in [package, *package.parent.glob("nvidia_cudnn_frontend*.dist-info")]:
        link = only / src.name
        if not link.exists():
            link.symlink_to(src)
    paths = os.environ.get("PYTHONPATH", "").split(":")
    kept = [p for p in paths if p and not any((Path(p) / n).exists() for n in ("flash_attn", "torchao"))]
    return {**os.environ, "PYTHONPATH": ":".join([str(only), *kept])}


def child(path: Path, mode: str, extras: str) -> dict:
    t0 = time.time()
    env = cudnn_only_env() if extras == "cudnn" else None
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode, extras],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": r.stderr[-2000:]}
    t = json.loads(line[7:])
    order = ["start", "torch", "prx_compile", "imports", "load_compiled", "engines", "first_step"]
    parts = {"interpreter_s": t["start"] - t0}
    for a, b in zip(order, order[1:], strict=False):
        parts[f"{b}_s"] = t[b] - t[a]
    parts = {k: round(v, 3) for k, v in parts.items()}
    parts["process_start_to_first_step_s"] = round(t["first_step"] - t0, 3)
    parts["rel_err_vs_the_building_process"] = t["rel_err"]
    parts["imported"] = t["modules"]
    parts["import_parts"] = {k: round(v, 3) for k, v in t["parts"].items()}
    parts["set_timings"] = t["set_timings"]
    if "profile" in t:
        parts["profile_cumulative_s"] = t["profile"]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--modes", nargs="*", default=["ahead", "parts", "profile"])
    ap.add_argument("--artifact", default="/tmp/prx_cold")
    ap.add_argument(
        "--floor", type=int, default=0, help="also N processes importing torch and diffusers only"
    )
    ap.add_argument(
        "--compileall",
        nargs="*",
        default=[],
        help="folders whose Python files get bytecode first, as pip install writes it (a kit installed "
        "with --no-compile would otherwise compile every module in every new process)",
    )
    args = ap.parse_args()
    for folder in args.compileall:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", folder], check=False)
    from prx_compile.ops import cudnn_attention, flash4_attention

    result = {
        "what": "cold start: new process -> load_compiled -> first step, by part "
        "(1.17 B PRX, prx-1024-bf16-static); extras 'cudnn': flash-attn-4 hidden from the process and "
        "the artifact built with attention_kernel: cudnn; 'flash4': both extras",
        "packages": {
            "cudnn_frontend": cudnn_attention.installed(),
            "flash_attn_4": flash4_attention.installed(),
        },
        "cpus": os.cpu_count(),
        "builds": {},
        "runs": [],
    }
    if args.floor:
        result["floor"] = floor(args.floor)
        Path(args.out).write_text(json.dumps(result, indent=1))
    variants = {"cudnn": {"attention_kernel": "cudnn"}} if args.modes else {}
    if args.modes and flash4_attention.installed():
        variants["flash4"] = {}
    for extras, overrides in variants.items():
        path = Path(f"{args.artifact}_{extras}.art")
        log(f"building the {extras} artifact ...")
        result["builds"][extras] = build(path, **overrides)
        log(f"built: {result['builds'][extras]}")
        torch.cuda.empty_cache()
        for i in range(args.runs):
            for mode in args.modes:
                r = child(path, mode, extras)
                r.update(mode=mode, extras=extras, run=i)
                result["runs"].append(r)
                log(json.dumps({k: v for k, v in r.items() if k != "profile_cumulative_s"}))
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
