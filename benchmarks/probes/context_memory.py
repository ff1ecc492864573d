"""What a TensorRT-RTX execution context costs in device memory outside PyTorch, made six ways.

    python benchmarks/probes/context_memory.py OUT_DIR

``step_anatomy.py`` found each engine set adding ~0.67 GB that PyTorch's allocator does not hold,
73.5 MB at each engine's deserialisation + context creation, for engines whose contexts report no
memory of their own (``device_memory_size`` 0). This probe builds the static preset's set (9
distinct engines) of the full PRX once, then makes one more context per engine in each of these
ways, keeping all of them alive, and reads the process's device memory in use
(``torch.cuda.mem_get_info``) and PyTorch's reserved bytes around each batch of 9:

  plain            ``engine.create_execution_context()``
  own cache        a runtime config with its own empty runtime cache (what a set does today)
  own cache, user  the same with ``USER_MANAGED`` allocation (``share_context_memory``)
  shared cache     one runtime cache for all 9 configs
  no cache         a runtime config without a runtime cache
  no cuda graphs   a runtime config with TensorRT-RTX's own CUDA graphs off (where it has the switch)

then drops them all and reads memory again (is it given back?), and makes the "own cache" batch
once more (is what was dropped reused?). -> OUT_DIR/context_memory.json
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

from prx_compile import compile_prx
from prx_compile.backends.tensorrt import shim
from prx_compile.tools.bench import Case
from prx_compile.tools.testing import FULL_PRX, make_prx


def memory() -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {"in_use_gb": (total - free) / 1e9, "outside_torch_gb": (total - free - reserved) / 1e9}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"variants": {}}
    path = out / "context_memory.json"
    trt = shim.trt()
    model = make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")
    kw = Case((1024, 1024), 2).inputs(model.config, torch.bfloat16, "cuda")
    res["before_build"] = memory()
    ct = compile_prx(model, config="prx-1024-bf16-static")
    with torch.no_grad():
        ct(**kw, return_dict=False)
    res["after_set"] = memory()
    engines = [m.engine for m in ct.backends[0].engines.values()]
    res["engines"] = len(engines)
    res["context_memory_bytes"] = [int(getattr(e, "device_memory_size_v2", 0) or 0) for e in engines]
    probe_cfg = engines[0].create_runtime_config()
    res["runtime_config_api"] = [n for n in dir(probe_cfg) if not n.startswith("__")]
    shared = probe_cfg.create_runtime_cache()

    def config(engine, cache="own", strategy=None, graphs_off=False):
        """(config, its cache): both kept alive as long as the context (TensorRT holds pointers)."""
        cfg = engine.create_runtime_config()
        own = None
        if cache == "own":
            own = cfg.create_runtime_cache()
            cfg.set_runtime_cache(own)
        elif cache == "shared":
            cfg.set_runtime_cache(shared)
        if strategy is not None:
            cfg.set_execution_context_allocation_strategy(strategy)
        if graphs_off:
            cfg.set_cuda_graph_strategy(trt.CudaGraphStrategy.DISABLED)
        return cfg, own

    def with_config(**kwargs):
        def make(engine):
            cfg = config(engine, **kwargs)
            return cfg, engine.create_execution_context(cfg[0])

        return make

    variants = {
        "plain": lambda e: (None, e.create_execution_context()),
        "own cache": with_config(),
        "own cache, user": with_config(strategy=trt.ExecutionContextAllocationStrategy.USER_MANAGED),
        "shared cache": with_config(cache="shared"),
        "no cache": with_config(cache=None),
        "no cuda graphs": with_config(graphs_off=True),
    }
    res["plain_only"] = "--plain" in sys.argv
    if not hasattr(probe_cfg, "set_cuda_graph_strategy"):
        variants.pop("no cuda graphs")
    held = {}
    for name, make in variants.items():
        before, t0 = memory(), time.perf_counter()
        try:
            held[name] = [make(e) for e in engines]
        except Exception as e:  # one way refused: say so, go on
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        after = memory()
        res["variants"][name] = {
            "seconds": round(time.perf_counter() - t0, 3),
            "contexts_none": sum(c is None for _, c in held[name]),
            "outside_torch_mb_per_context": round(
                (after["outside_torch_gb"] - before["outside_torch_gb"]) * 1e3 / len(engines), 2
            ),
            "in_use_mb_per_context": round(
                (after["in_use_gb"] - before["in_use_gb"]) * 1e3 / len(engines), 2
            ),
        }
        print(name, res["variants"][name], flush=True)
        path.write_text(json.dumps(res, indent=1, default=str))
    before = memory()
    held.clear()
    gc.collect()
    res["dropped_all"] = {"before": before, "after": memory()}
    before = memory()
    again = [with_config()(e) for e in engines]
    res["own cache again, after the drop"] = {
        "outside_torch_mb_per_context": round(
            (memory()["outside_torch_gb"] - before["outside_torch_gb"]) * 1e3 / len(engines), 2
        )
    }
    del again
    del ct
    gc.collect()
    torch.cuda.empty_cache()
    res["after_deleting_the_set"] = memory()
    print(json.dumps({k: v for k, v in res.items() if k != "runtime_config_api"}, default=str), flush=True)
    path.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
