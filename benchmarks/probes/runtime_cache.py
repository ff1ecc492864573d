"""Issue 23's JIT probe: where a TensorRT-RTX engine's first-call seconds go when its execution
context is created (that is when TensorRT-RTX compiles its kernels), and two runtime knobs.

    python benchmarks/probes/runtime_cache.py OUT.json [--variants base shared none shared+none]

Each variant runs in a new process with no engine cache: the full-size PRX (bf16, non-degenerate),
``compile_prx(model)``'s first calls at 1024² b2, 1024² b1 and 832x1216 b2 (the default's three
sets, in that order), then warm ms/step at each and the error against eager. Variants:
  base         as shipped: each engine's context gets a new, empty runtime cache
  shared       one runtime cache for every engine of the process (sets built later find the kernels
               the earlier ones compiled)
  none         dynamic-shape kernels never specialised (``DynamicShapesKernelSpecializationStrategy
               .NONE``; TensorRT-RTX's default, LAZY, compiles shape-specialised kernels in the
               background and runs fallback kernels until they are ready)
  shared+none  both
Per set: first-call seconds, ``timings`` and the four slowest engine conversions (context creation
included: ``engine_build_s``). -> OUT.json

Result (``runtime_cache_h200.json``): no variant moved a first call beyond the run-to-run noise
(832x1216 b2: 13.98 s as shipped, 13.93 shared, 15.71 none, 12.07 both; the static sets 5.0-6.7 s
in every variant), so neither knob was kept. A partition's conversion takes 2.3-5.7 s whatever its
size (2 ops or 168): it is the contention of 8 conversions at once (one at a time, a static set's
nine took 5.05 s in all, ``first_call_v11_b_h200.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

VARIANTS = ("base", "shared", "none", "shared+none")


def child(variant: str) -> dict:
    import torch

    from prx_compile import compile_prx
    from prx_compile.backends.tensorrt import shim
    from prx_compile.tools.bench import Case, rel_err, time_cuda
    from prx_compile.tools.testing import FULL_PRX, make_prx

    shared: list = []
    lock = threading.Lock()
    info: dict = {}

    def patched(module, blob, arena=None):  # shim.use_runtime_cache with the variant's knobs
        if not shim.has_runtime_cache(module):
            return
        cfg = module.engine.create_runtime_config()
        if "shared" in variant:
            with lock:
                if not shared:
                    shared.append(cfg.create_runtime_cache())
            cache = shared[0]
        else:
            cache = cfg.create_runtime_cache()
        if blob:
            cache.deserialize(blob)
        cfg.set_runtime_cache(cache)
        if "none" in variant:
            info.setdefault("setter", [a for a in dir(cfg) if "special" in a.lower()])
            none = shim.trt().DynamicShapesKernelSpecializationStrategy.NONE
            cfg.dynamic_shapes_kernel_specialization_strategy = none
        if arena is not None:
            strategy = shim.trt().ExecutionContextAllocationStrategy.USER_MANAGED
            cfg.set_execution_context_allocation_strategy(strategy)
        module._prx_runtime = (cfg, cache)
        module.context = module.engine.create_execution_context(cfg)
        if arena is not None and module.context is not None:
            arena.attach(module)
        if hasattr(module, "runtime_states"):
            module.runtime_states.context_changed = True

    shim.use_runtime_cache = patched
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    cases = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]
    kws = [c.inputs(model.config, torch.bfloat16, "cuda") for c in cases]
    with torch.no_grad():
        refs = [model(**kw, return_dict=False)[0] for kw in kws]
    compiled = compile_prx(model)
    rows = []
    for c, kw, ref in zip(cases, kws, refs, strict=True):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = compiled(**kw, return_dict=False)[0]
        torch.cuda.synchronize()
        served = compiled.engine_set_for(kw)
        rows.append(
            {
                "case": c.label(),
                "first_call_s": time.perf_counter() - t0,
                "rel_err": rel_err(out, ref),
                "timings": dict(served.timings),
                "engine_build_s": dict(list(served.engine_build_s.items())[:4]),
            }
        )
        print(variant, rows[-1]["case"], f"{rows[-1]['first_call_s']:.2f} s", flush=True)
    for row, kw in zip(rows, kws, strict=True):
        with torch.no_grad():
            for _ in range(5):  # LAZY: give background specialisation a chance before timing
                compiled(**kw, return_dict=False)
            row["ms_per_step"] = time_cuda(lambda kw=kw: compiled(**kw, return_dict=False))["ms"]
    return {"variant": variant, "rows": rows, **info}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--child", choices=VARIANTS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return
    res: dict = {"variants": []}
    for v in args.variants:
        p = subprocess.run(
            [sys.executable, __file__, args.out, "--child", v], capture_output=True, text=True, timeout=300
        )
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            res["variants"].append(json.loads(lines[-1][7:]))
        else:
            res["variants"].append({"variant": v, "error": (p.stderr or p.stdout)[-1500:]})
        print(json.dumps(res["variants"][-1])[:1500], flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
