"""Where an engine set's device memory goes, and where a graphed step's time goes between kernels.

    python benchmarks/probes/step_anatomy.py OUT_DIR [--parts memory timeline] [--config NAME ...]

Full-size PRX (bf16, non-degenerate), the pipeline's text mask, one new process.

memory    ``compile_prx(model)`` (the default config), then its first call at 1024² b2, 1024² b1,
          832×1216 b2 and a batch-4 miss, in that order. Around each phase of each set (Torch-TensorRT's
          build, ``load`` with its context arena, the CUDA graph's warm-up runs, its capture) the
          process's device memory in use (``torch.cuda.mem_get_info``), PyTorch's reserved and
          allocated bytes; "outside PyTorch" is in use minus reserved. At the end PyTorch's segments
          by memory pool (the graphs' private pool apart from the default one).
          -> OUT_DIR/step_anatomy.json ``memory``
timeline  for each ``--config`` (default: the default config and ``prx-1024-fp8``), 1024² b2, CUDA
          graphs on: five replays under torch.profiler, a pause between them; per replay the span from
          the first kernel's start to the last one's end, the time some kernel runs, the gaps between
          consecutive kernels summed by the category of the kernel after the gap, and the largest
          gaps by the pair of kernels around them (median replay); the CPU time of 40 calls; ms per
          call of the forward, of the CUDA graph runner and of the replay alone (``overhead``).
          -> OUT_DIR/step_anatomy.json ``timeline``
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prx_compile import compile_prx
from prx_compile.backends.tensorrt import shim
from prx_compile.backends.tensorrt.backend import TensorRTBackend
from prx_compile.runtime import cudagraphs
from prx_compile.tools.bench import Case, time_cuda
from prx_compile.tools.testing import FULL_PRX, make_prx

CATEGORIES = [  # (category, substrings of the lower-cased kernel name), first match wins
    ("gemm (cuBLAS)", ("nvjet", "scaled_mm", "f8f8bf16", "cublas")),
    ("attention", ("sdpa", "flash", "fmha", "_attention")),
    ("attention merge", ("_merge_kernel",)),
    ("fp8 quantisation", ("_row_quant", "_gelu_mul_quant", "_quant_kv")),
    ("tensorrt", ("__myl", "matmul", "xmma", "gemm")),
    ("memset", ("memset",)),
    ("memcpy", ("memcpy",)),
    ("q/k norm + rope", ("_kernel",)),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other (PyTorch)")


def memory() -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {
        "in_use_gb": round((total - free) / 1e9, 4),
        "reserved_gb": round(reserved / 1e9, 4),
        "allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 4),
        "outside_torch_gb": round((total - free - reserved) / 1e9, 4),
    }


def hook_phases(log: list):
    """Wrap the phases of a set's first call so that each logs memory before and after (probe only).
    Returns a function that takes the wrappers out."""
    originals = []

    def wrap(owner, name, label, before=True, after=True):  # no synchronize while a capture is open
        inner = getattr(owner, name)
        originals.append((owner, name, inner))

        def wrapped(*a, **k):
            if before and not torch.cuda.is_current_stream_capturing():
                log.append({"phase": f"{label} start", **memory()})
            out = inner(*a, **k)
            if after and not torch.cuda.is_current_stream_capturing():
                log.append({"phase": f"{label} end", **memory()})
            return out

        setattr(owner, name, wrapped)

    wrap(TensorRTBackend, "build", "build (Torch-TensorRT)")
    wrap(shim, "_setup_engine", "engine: deserialise + context")
    wrap(shim.DeviceArena, "allocate", "arena")
    wrap(cudagraphs.CUDAGraphRunner, "_capture", "graph warm-ups + capture")
    wrap(torch.cuda.CUDAGraph, "capture_begin", "capture (warm-ups done)", after=False)
    wrap(torch.cuda.CUDAGraph, "capture_end", "capture + instantiate", before=False)

    def restore():
        for owner, name, inner in originals:
            setattr(owner, name, inner)

    return restore


def pools() -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        key = str(seg.get("segment_pool_id", "?"))
        d = out.setdefault(key, {"segments": 0, "total_gb": 0.0, "allocated_gb": 0.0})
        d["segments"] += 1
        d["total_gb"] += seg["total_size"] / 1e9
        d["allocated_gb"] += seg["allocated_size"] / 1e9
    return {k: {kk: round(v, 4) for kk, v in d.items()} for k, d in out.items()}


def memory_part(model, res: dict) -> None:
    cases = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2), Case((1024, 1024), 4)]
    kws = {c.label(): c.inputs(model.config, torch.bfloat16, "cuda") for c in cases}
    with torch.no_grad():
        for kw in kws.values():
            model(**kw, return_dict=False)
    gc.collect()
    torch.cuda.empty_cache()
    res["eager"] = memory()
    compiled = compile_prx(model, engine_cache_dir=tempfile.mkdtemp())
    log: list = []
    restore = hook_phases(log)
    res["sets"] = []
    for i, c in enumerate(cases):
        log.clear()
        before = memory()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        with torch.no_grad():
            if i == 0:  # the process's first set: its first call under cProfile (main thread only)
                prof.enable()
            compiled(**kws[c.label()], return_dict=False)
            torch.cuda.synchronize()
            prof.disable()
        if i == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(80)
            res["first_call_profile"] = text.getvalue()
        after = memory()
        gc.collect()
        torch.cuda.empty_cache()
        entry = {
            "shape": c.label(),
            "first_call_s": round(time.perf_counter() - t0, 2),
            "before": before,
            "phases": list(log),
            "after": after,
            "after_empty_cache": memory(),
            "timings": dict(compiled.engine_set_for(kws[c.label()]).timings),
        }
        res["sets"].append(entry)
        print(json.dumps({k: entry[k] for k in ("shape", "before", "after_empty_cache")}), flush=True)
    res["pools"] = pools()
    res["report"] = compiled.report()
    for label, overrides in {
        "workers 1": {"build_workers": 1},
        "own context memory": {"build_workers": 1, "share_context_memory": False},
    }.items():
        log.clear()
        before = memory()
        one = compile_prx(model, config="prx-1024-bf16-static", **overrides)
        with torch.no_grad():
            one(**kws[cases[0].label()], return_dict=False)
        res[f"static set, {label}"] = {"before": before, "phases": list(log), "after": memory()}
        del one
        gc.collect()
        torch.cuda.empty_cache()
        res[f"static set, {label}"]["after_del"] = memory()
    restore()
    del compiled
    gc.collect()
    torch.cuda.empty_cache()
    res["after_del_all"] = memory()


def overhead(compiled, kw: dict) -> dict:
    """ms per call (CUDA events, synchronised each call) of the whole forward, of the CUDA graph
    runner on already normalised inputs (input copies, replay, output copy), and of the replay
    alone: the differences are what Python costs before the GPU starts."""
    with torch.no_grad():
        compiled(**kw, return_dict=False)
        inputs = compiled._normalise(**kw)
        backend = compiled._backend_for(inputs)
        runner = compiled._graphs[id(backend)]
        graph = next(iter(runner.graphs.values()))[0]
        return {
            "forward_ms": time_cuda(lambda: compiled(**kw, return_dict=False), iters=50)["ms"],
            "runner_ms": time_cuda(lambda: runner(**inputs), iters=50)["ms"],
            "replay_ms": time_cuda(graph.replay, iters=50)["ms"],
        }


def timeline(compiled, kw: dict, replays: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step = lambda: compiled(**kw, return_dict=False)  # noqa: E731
    with torch.no_grad():
        ms = time_cuda(step)["ms"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                step()
                torch.cuda.synchronize()
                time.sleep(0.01)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    gpu = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
    ]
    gpu.sort(key=lambda e: e["ts"])
    steps, cur = [], []
    for e in gpu:
        if cur and e["ts"] - max(x["ts"] + x["dur"] for x in cur[-8:]) > 3000:  # the pause: a new replay
            steps.append(cur)
            cur = []
        cur.append(e)
    steps.append(cur)
    per = [(one_replay(s), s) for s in steps if s]
    per.sort(key=lambda d: d[0]["span_ms"])
    mid, events = per[len(per) // 2]
    t0 = events[0]["ts"]
    mid["events"] = [[e["name"][:70], round(e["ts"] - t0, 1), round(e["dur"], 1)] for e in events]
    enqueue = []
    prof = cProfile.Profile()
    with torch.no_grad():
        for i in range(40):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if i >= 20:
                prof.enable()
            step()
            prof.disable()
            enqueue.append((time.perf_counter() - t) * 1e3)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    per = [d for d, _ in per]
    return {
        "enqueue_ms_median": statistics.median(enqueue[:20]),
        "forward_profile_20_calls": text.getvalue(),
        "ms_per_step": ms,
        "replays_seen": len(per),
        "span_ms": [d["span_ms"] for d in per],
        "median": mid,
        "report": compiled.report(),
    }


def one_replay(events: list) -> dict:
    end = events[0]["ts"]
    busy = 0.0
    gaps_by_next: dict[str, float] = {}
    gaps_by_pair: dict[str, list] = {}
    kernels_by_cat: dict[str, list] = {}
    n_gaps = []
    for i, e in enumerate(events):
        start, stop = e["ts"], e["ts"] + e["dur"]
        c = category(e["name"])
        kc = kernels_by_cat.setdefault(c, [0, 0.0])
        kc[0] += 1
        kc[1] += e["dur"] / 1e3
        if i and start > end:
            gap = start - end
            n_gaps.append(gap)
            gaps_by_next[c] = gaps_by_next.get(c, 0.0) + gap / 1e3
            pair = f"{category(events[i - 1]['name'])} -> {c}"
            p = gaps_by_pair.setdefault(pair, [0, 0.0])
            p[0] += 1
            p[1] += gap / 1e3
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = (end - events[0]["ts"]) / 1e3
    return {
        "span_ms": round(span, 3),
        "busy_ms": round(busy / 1e3, 3),
        "gap_ms": round(span - busy / 1e3, 3),
        "gpu_ops": len(events),
        "gap_us_median": round(statistics.median(n_gaps), 2) if n_gaps else 0.0,
        "gaps_over_20us": sum(g > 20 for g in n_gaps),
        "kernels_by_category": {k: [n, round(ms, 3)] for k, (n, ms) in sorted(kernels_by_cat.items())},
        "gap_ms_by_next_category": {
            k: round(v, 3) for k, v in sorted(gaps_by_next.items(), key=lambda kv: -kv[1])
        },
        "gap_ms_by_pair": {
            k: [n, round(ms, 3)] for k, (n, ms) in sorted(gaps_by_pair.items(), key=lambda kv: -kv[1][1])[:15]
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--parts", nargs="+", default=["memory", "timeline"], choices=["memory", "timeline"])
    ap.add_argument("--config", nargs="+", default=["default", "prx-1024-fp8"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "memory": {}, "timeline": {}}
    path = args.out / "step_anatomy.json"
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    if "memory" in args.parts:
        memory_part(model, res["memory"])
        path.write_text(json.dumps(res, indent=1, default=str))
        gc.collect()
        torch.cuda.empty_cache()
    if "timeline" in args.parts:
        kw = Case((1024, 1024), 2).inputs(model.config, torch.bfloat16, "cuda")
        for name in args.config:
            config = {} if name == "default" else {"config": name}
            compiled = compile_prx(model, **config)
            res["timeline"][name] = timeline(compiled, kw)
            res["timeline"][name]["overhead"] = overhead(compiled, kw)
            print(name, json.dumps(res["timeline"][name]["median"]), flush=True)
            path.write_text(json.dumps(res, indent=1, default=str))
            del compiled
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
