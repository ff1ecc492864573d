"""Issue 23's measurement: cold first calls, device memory and warm ms/step of ``compile_prx(model)``
against torch.compile regional (each PRXBlock compiled) and whole-model torch.compile, one process.

    python benchmarks/first_call.py OUT_DIR [--parts default miss_build ablation regional whole fp8]

Run it in a new process with no engine cache (the default config has none). Full-size PRX (1.17 B,
bf16, non-degenerate weights), the pipeline's text mask. Parts, in order, each saved when done:
  default   eager at 1024² b2, 1024² b1, 832x1216 b2, 1024² b4, 1216x832 b2 and 896x1152 b2; then
            ``compile_prx(model)``: the first call at each, in that order (832x1216 and 1216x832 get
            static sets of their own, ``auto_specialize: 2``; 1024² b4 is outside the default's sets,
            a shape miss, which runs as two b2 steps, ``on_shape_miss: split``; 896x1152 builds the
            range set), seconds from the call to its output, device memory in use after it, then
            warm ms/step and the error against eager; where each set's first call went
            (``report()["engine_sets"]``).
  miss_build the b4 miss with ``on_shape_miss: build`` on a new compiled module, after its b2 set's
            first call: a set of its own; first call, ms/step, memory added.
  ablation  the static 1024² b2 set built one engine at a time, each execution context on its own
            memory (``build_workers: 1, share_context_memory: false``: 0.7's way), with 8 workers on
            their own memory, and as the default does (8 workers, one arena): first call, build
            seconds, ms/step, memory added, and the largest difference between the outputs.
  regional  ``for b in model.blocks: b.compile(dynamic=False)`` on a copy: first call per shape (the
            default part's shapes but 1024² b4), ms/step.
  whole     ``torch.compile(model)`` at 1024² b2: first call, ms/step.
  fp8       the ``prx-1024-fp8`` preset (static 1024² b2) on a copy: first call, ms/step, engines.
-> OUT_DIR/first_call.json: records in the benchmark layout plus ``first_call_s`` and ``mem_gb``
(``torch.cuda.mem_get_info``: the whole process's device memory in use), ``mem_gb_eager`` once.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
import traceback
from pathlib import Path

import torch

from prx_compile import compile_prx, progress
from prx_compile.tools.bench import Case, environment, rel_err, time_cuda
from prx_compile.tools.testing import FULL_PRX, make_prx

SHAPES = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]
MISS = Case((1024, 1024), 4)
#: two more new shapes inside the range: the second static set ``auto_specialize`` makes, then the range set
MORE = [Case((1216, 832), 2), Case((896, 1152), 2)]
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.0f} s] {msg}", flush=True)


def mem_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


def first_call(fn, kw) -> tuple[torch.Tensor, float]:
    """fn(**kw)'s output and seconds from the call to the output (synchronised)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(**kw)
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def record(path: str, case: Case, **fields) -> dict:
    return {
        "path": path,
        "resolution": list(case.resolution),
        "batch": case.batch,
        "mask": case.mask,
        **{"dtype": "bf16", **fields},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--parts", nargs="+", default=["default", "miss_build", "ablation", "regional", "whole", "fp8"]
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "first_call.json"
    res: dict = {"environment": environment(), "records": [], "errors": {}}

    def save():
        out_json.write_text(json.dumps(res, indent=1, default=str))

    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    cases = [*SHAPES, MISS, *MORE]
    kws = {c.label(): c.inputs(model.config, torch.bfloat16, "cuda") for c in cases}
    refs = {}
    for c in cases:
        kw = kws[c.label()]
        with torch.no_grad():
            refs[c.label()] = model(**kw, return_dict=False)[0]
            ms = time_cuda(lambda kw=kw: model(**kw, return_dict=False))["ms"]
        res["records"].append(record("eager", c, ms_per_step=ms))
        log(f"eager {c.label()}: {ms:.2f} ms")
    torch.cuda.synchronize()
    res["mem_gb_eager"] = mem_gb()
    res["torch_reserved_gb_eager"] = torch.cuda.memory_reserved() / 1e9
    save()

    def run_part(name, fn):
        if name not in args.parts:
            return
        try:
            fn()
        except Exception as e:
            res["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        save()

    def default():
        with progress.reporting(True):
            compiled = compile_prx(model)
            recs = []
            for c in cases:
                kw = kws[c.label()]
                out, s = first_call(lambda **k: compiled(**k, return_dict=False), kw)
                rec = record(
                    "compile_prx",
                    c,
                    config="default",
                    weights="inputs",
                    first_call_s=s,
                    mem_gb=mem_gb(),
                    torch_reserved_gb=torch.cuda.memory_reserved() / 1e9,
                    rel_err=rel_err(out, refs[c.label()]),
                )
                log(f"compile_prx first call {c.label()}: {s:.1f} s, {rec['mem_gb']:.2f} GB in use")
                recs.append(rec)
                res["records"].append(rec)
                save()
        for c, rec in zip(cases, recs, strict=True):
            kw = kws[c.label()]
            with torch.no_grad():
                rec["ms_per_step"] = time_cuda(lambda kw=kw: compiled(**kw, return_dict=False))["ms"]
            served = compiled.engine_set_for(kw)
            if served is None:  # a batch no set takes whole: run in chunks (on_shape_miss: split)
                rec["chunks"] = compiled._chunks(kw)
                served = compiled.engine_set_for({k: v[: rec["chunks"][0]] for k, v in kw.items()})
            rep = served.report()
            rec.update(
                engines=rep["engines"],
                engine_calls=rep["engine_calls"],
                torch_segments=rep["torch_segments"],
                context_mb=rep["context_mb"],
                arena_mb=rep.get("arena_mb"),
                engine_mb=rep["engine_mb"],
                build_s=served.build_s,
                timings=dict(served.timings),
                engine_build_s=dict(list(getattr(served, "engine_build_s", {}).items())[:4]),
                engine_set=served.shapes.describe(),
            )
            log(f"compile_prx {c.label()}: {rec['ms_per_step']:.2f} ms, {rep['engines']} engines")
        res["default_report"] = compiled.report()
        res["mem_gb_after_default"] = mem_gb()

    def miss_build():  # the miss with on_shape_miss: build on a new compiled module: a set of its own
        c2, kw = SHAPES[0], kws[MISS.label()]
        compiled = compile_prx(model, on_shape_miss="build")
        first_call(lambda **k: compiled(**k, return_dict=False), kws[c2.label()])  # builds the b2 set
        before = mem_gb()
        out, s = first_call(lambda **k: compiled(**k, return_dict=False), kw)
        with torch.no_grad():
            ms = time_cuda(lambda: compiled(**kw, return_dict=False))["ms"]
        res["records"].append(
            record(
                "compile_prx[on_shape_miss=build]",
                MISS,
                config="default",
                weights="inputs",
                on_shape_miss="build",
                first_call_s=s,
                ms_per_step=ms,
                mem_gb=mem_gb(),
                mem_added_gb=mem_gb() - before,
                rel_err=rel_err(out, refs[MISS.label()]),
            )
        )
        log(f"miss with on_shape_miss=build {MISS.label()}: first {s:.2f} s, {ms:.2f} ms")

    def static_set(label: str, **overrides) -> torch.Tensor:
        c = SHAPES[0]
        kw = kws[c.label()]
        before = mem_gb()
        compiled = compile_prx(model, config="prx-1024-bf16-static", **overrides)
        out, s = first_call(lambda **k: compiled(**k, return_dict=False), kw)
        with torch.no_grad():
            ms = time_cuda(lambda: compiled(**kw, return_dict=False))["ms"]
        served = compiled.engine_set_for(kw)
        rep = served.report()
        res["records"].append(
            record(
                f"compile_prx[static, {label}]",
                c,
                config="prx-1024-bf16-static",
                weights="inputs",
                first_call_s=s,
                ms_per_step=ms,
                mem_gb=mem_gb(),
                mem_added_gb=mem_gb() - before,
                torch_reserved_gb=torch.cuda.memory_reserved() / 1e9,
                rel_err=rel_err(out, refs[c.label()]),
                engines=rep["engines"],
                engine_calls=rep["engine_calls"],
                torch_segments=rep["torch_segments"],
                context_mb=rep["context_mb"],
                arena_mb=rep.get("arena_mb"),
                engine_mb=rep["engine_mb"],
                build_s=served.build_s,
                timings=dict(served.timings),
            )
        )
        log(f"static {label}: first call {s:.1f} s, {ms:.2f} ms, {rep['engines']} engines")
        save()
        return out

    def ablation():
        outs = {}
        variants = {
            "build_workers=1, share_context_memory=False": dict(build_workers=1, share_context_memory=False),
            "build_workers=8, share_context_memory=False": dict(share_context_memory=False),
            "build_workers=8, share_context_memory=True (default)": {},
        }
        for label, overrides in variants.items():
            gc.collect()
            torch.cuda.empty_cache()
            outs[label] = static_set(label, **overrides)
        first, *rest = outs.values()
        res["ablation_max_rel_diff"] = max(rel_err(o, first) for o in rest)

    def regional():
        m = copy.deepcopy(model)
        for b in m.blocks:
            b.compile(dynamic=False)
        for c in [*SHAPES, *MORE]:
            kw = kws[c.label()]
            out, s = first_call(lambda **k: m(**k, return_dict=False), kw)
            with torch.no_grad():
                ms = time_cuda(lambda kw=kw: m(**kw, return_dict=False))["ms"]
            res["records"].append(
                record(
                    "torch.compile regional",
                    c,
                    first_call_s=s,
                    ms_per_step=ms,
                    mem_gb=mem_gb(),
                    rel_err=rel_err(out, refs[c.label()]),
                )
            )
            log(f"regional {c.label()}: first {s:.1f} s, {ms:.2f} ms")
            save()

    def whole():
        m = torch.compile(model)
        c = SHAPES[0]
        kw = kws[c.label()]
        out, s = first_call(lambda **k: m(**k, return_dict=False), kw)
        with torch.no_grad():
            ms = time_cuda(lambda: m(**kw, return_dict=False))["ms"]
        res["records"].append(
            record(
                "torch.compile",
                c,
                first_call_s=s,
                ms_per_step=ms,
                mem_gb=mem_gb(),
                rel_err=rel_err(out, refs[c.label()]),
            )
        )
        log(f"torch.compile {c.label()}: first {s:.1f} s, {ms:.2f} ms")

    def fp8():
        c = SHAPES[0]
        kw = kws[c.label()]
        m = copy.deepcopy(model)  # FP8 quantises the block linears in place
        compiled = compile_prx(m, config="prx-1024-fp8")
        out, s = first_call(lambda **k: compiled(**k, return_dict=False), kw)
        with torch.no_grad():
            ms = time_cuda(lambda: compiled(**kw, return_dict=False))["ms"]
        served = compiled.engine_set_for(kw)
        rep = served.report()
        rec = record("compile_prx", c, dtype="fp8", config="prx-1024-fp8", weights="inputs")
        rec.update(
            first_call_s=s,
            ms_per_step=ms,
            mem_gb=mem_gb(),
            rel_err=rel_err(out, refs[c.label()]),
            engines=rep["engines"],
            engine_calls=rep["engine_calls"],
            torch_segments=rep["torch_segments"],
            build_s=served.build_s,
            timings=dict(served.timings),
        )
        res["records"].append(rec)
        log(f"fp8 {c.label()}: first {s:.1f} s, {ms:.2f} ms, {rep['engines']} engines")

    run_part("default", default)
    run_part("miss_build", miss_build)
    run_part("ablation", ablation)
    run_part("regional", regional)
    run_part("whole", whole)
    run_part("fp8", fp8)
    log(f"done: {out_json}")


if __name__ == "__main__":
    main()
