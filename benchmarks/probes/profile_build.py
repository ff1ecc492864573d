"""Where one engine set's first call goes (time and device memory): the probe behind issue 23's plan.

    python benchmarks/probes/profile_build.py OUT_DIR

Full-size PRX (bf16, non-degenerate), the static 1024² b2 set of ``prx-1024-bf16-static``. A warm-up
build of a 4-block model first (imports, CUDA and Torch-TensorRT initialisation are once per
process), then the full model's build under cProfile: the top functions by cumulative and by own time
-> OUT_DIR/profile_build.txt. Device memory (allocated by PyTorch, reserved by its allocator, in use
by the process) before the build, after it, after ``torch.cuda.empty_cache()``, after the first call
(CUDA graph capture) and after emptying the cache again -> OUT_DIR/profile_build.json.
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import sys
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
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"memory": {}, "timings": {}}
    case = Case((1024, 1024), 2)

    small = make_prx({"depth": 4}, dtype=torch.bfloat16, device="cuda")  # once-per-process costs
    t0 = time.perf_counter()
    compile_prx(small, config="prx-1024-bf16-static").build()
    res["warmup_build_s"] = time.perf_counter() - t0
    del small
    gc.collect()
    torch.cuda.empty_cache()

    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = case.inputs(model.config, torch.bfloat16, "cuda")
    with torch.no_grad():
        model(**kw, return_dict=False)
    res["memory"]["eager"] = memory()
    compiled = compile_prx(model, config="prx-1024-bf16-static")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    compiled.build()
    prof.disable()
    res["build_s"] = time.perf_counter() - t0
    res["memory"]["after_build"] = memory()
    torch.cuda.empty_cache()
    res["memory"]["after_build_empty_cache"] = memory()
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(**kw, return_dict=False)
    torch.cuda.synchronize()
    res["first_call_s"] = time.perf_counter() - t0
    res["memory"]["after_first_call"] = memory()
    torch.cuda.empty_cache()
    res["memory"]["after_first_call_empty_cache"] = memory()
    backend = compiled.backends[0]
    res["timings"] = dict(backend.timings)
    res["report"] = backend.report()

    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats(key).print_stats(60)
    (out / "profile_build.txt").write_text(text.getvalue())
    (out / "profile_build.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
