"""Where ``load_compiled``'s time goes, step by step (the probe behind results/load_profile_h200.txt).

    python benchmarks/probes/profile_load.py ARTIFACT

Imports come first and are timed apart (a server imports once per process); then one load, with the
time spent in prx_compile's steps: reading and verifying files, the model and its weights; then
``build()``, which deserialises every engine set (a load defers that to each set's first call). Last,
for a few engines of set 0, one at a time: TensorRT-RTX's deserialisation, a default execution context,
and a context with a runtime config holding the saved runtime cache, then an empty one.
"""

import sys
import time
from pathlib import Path

t0 = time.perf_counter()
import torch  # noqa: E402
import torch_tensorrt  # noqa: E402, F401
from diffusers import PRXTransformer2DModel  # noqa: E402, F401

from prx_compile.backends.tensorrt import shim  # noqa: E402
from prx_compile.io import artifact, saving  # noqa: E402

print(f"imports {time.perf_counter() - t0:.2f} s")
spent: dict[str, float] = {}


def timed(module, name):
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

    setattr(module, name, wrapper)


for module, name in [
    (artifact, "open_artifact"),
    (saving, "_load_model"),
    (artifact, "read_state"),
    (saving, "check_compatible"),
    (shim, "engine_module"),
    (shim, "use_runtime_cache"),
]:
    timed(module, name)
t0 = time.perf_counter()
ct = saving.load_compiled(sys.argv[1])
torch.cuda.synchronize()
print(f"load {time.perf_counter() - t0:.2f} s")
t0 = time.perf_counter()
ct.build()  # deserialise every engine set now
torch.cuda.synchronize()
print(f"engines {time.perf_counter() - t0:.2f} s ({ct.report()['engines']} engines)")
print({k: round(v, 2) for k, v in spent.items()})

# one engine at a time: where an engine's load goes
t = shim.trt()
from torch_tensorrt.logging import TRT_LOGGER  # noqa: E402

steps: dict[str, list[float]] = {}


def step(name, fn):
    t0 = time.perf_counter()
    out = fn()
    steps.setdefault(name, []).append(round(time.perf_counter() - t0, 4))
    return out


folder = Path(sys.argv[1]) / "sets" / "0"
for path in sorted(folder.glob("*.engine"))[:4]:
    blob, cache = path.read_bytes(), path.with_suffix(".rtcache")
    engine = step("deserialize", lambda blob=blob: t.Runtime(TRT_LOGGER).deserialize_cuda_engine(blob))
    step("default_context", engine.create_execution_context)
    if hasattr(engine, "create_runtime_config"):
        for label, data in (
            ("cached_context", cache.read_bytes() if cache.exists() else b""),
            ("empty_cache_context", b""),
        ):

            def make(data=data, engine=engine):
                cfg = engine.create_runtime_config()
                rc = cfg.create_runtime_cache()
                if data:
                    rc.deserialize(data)
                cfg.set_runtime_cache(rc)
                return engine.create_execution_context(cfg)

            step(label, make)
print("per engine (s):", steps)
