"""Where one engine set's first call goes (time and device memory): the probe behind issue 23's plan.

    python benchmarks/probes/profile_build.py OUT_DIR [--config NAME] [--shape H W B] [--build-workers N]

Full-size PRX (bf16, non-degenerate), the set that serves ``--shape`` (default 1024 1024 2) under
``--config`` (default ``prx-1024-bf16-static``; ``default`` for compile_prx's own: 832 1216 2 is then
its range set). cProfile sees the main thread only: ``--build-workers 1`` (the default here) keeps
the engine builds in it. A warm-up build of a 4-block model first (imports, CUDA and
Torch-TensorRT initialisation are once per process), then the full model's first call (its set's
build, first run and CUDA graph capture) under cProfile: the top functions by cumulative and by own
time -> OUT_DIR/profile_build.txt. Device memory (allocated by PyTorch, reserved by its allocator, in
use by the process) with eager, after the first call and after ``torch.cuda.empty_cache()``, with
the set's timings and report -> OUT_DIR/profile_build.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time
from pathlib import Path

import torch

from prx_compile import compile_prx
from prx_compile.tools.bench import Case
from prx_compile.tools.testing import FULL_PRX, make_prx


def memory() -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gb": torch.cuda.memory_allocated() / 1e9,
        "reserved_gb": torch.cuda.memory_reserved() / 1e9,
        "in_use_gb": (total - free) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default="prx-1024-bf16-static")
    ap.add_argument("--shape", type=int, nargs=3, default=[1024, 1024, 2], metavar=("H", "W", "B"))
    ap.add_argument("--build-workers", type=int, default=1)
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"memory": {}, "timings": {}, "args": vars(args)}
    case = Case(tuple(args.shape[:2]), args.shape[2])
    config = {} if args.config == "default" else {"config": args.config}
    config["build_workers"] = args.build_workers

    small = make_prx({"depth": 4}, dtype=torch.bfloat16, device="cuda")  # once-per-process costs
    t0 = time.perf_counter()
    compile_prx(small, config="prx-1024-bf16-static", build_workers=args.build_workers).build()
    res["warmup_build_s"] = time.perf_counter() - t0
    del small
    gc.collect()
    torch.cuda.empty_cache()

    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = case.inputs(model.config, torch.bfloat16, "cuda")
    with torch.no_grad():
        model(**kw, return_dict=False)
    res["memory"]["eager"] = memory()
    compiled = compile_prx(model, **config)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()  # the first call: that set's build, its first run and CUDA graph capture
    with torch.no_grad():
        compiled(**kw, return_dict=False)
    torch.cuda.synchronize()
    prof.disable()
    res["first_call_s"] = time.perf_counter() - t0
    res["memory"]["after_first_call"] = memory()
    torch.cuda.empty_cache()
    res["memory"]["after_first_call_empty_cache"] = memory()
    backend = compiled.engine_set_for(kw)
    res["timings"] = dict(backend.timings)
    res["report"] = backend.report()

    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats(key).print_stats(args.top)
    (out / "profile_build.txt").write_text(text.getvalue())
    (out / "profile_build.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
