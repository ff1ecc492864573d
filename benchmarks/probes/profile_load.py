"""Where ``load_compiled``'s time goes, step by step (the probe behind results/load_profile_h200.txt).

    python benchmarks/probes/profile_load.py ARTIFACT

Imports come first and are timed apart (a server imports once per process); then one load, with the
time spent in prx_compile's steps: reading and verifying files, the model and its weights, each
engine's deserialisation, the TensorRT-RTX runtime-cache contexts.
"""

import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import torch_tensorrt  # noqa: E402, F401
from diffusers import PRXTransformer2DModel  # noqa: E402, F401

from prx_compile import artifact, saving  # noqa: E402
from prx_compile.backends import trt_shim  # noqa: E402

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
    (trt_shim, "engine_module"),
    (trt_shim, "use_runtime_cache"),
]:
    timed(module, name)
t0 = time.perf_counter()
ct = saving.load_compiled(sys.argv[1])
torch.cuda.synchronize()
print(f"load {time.perf_counter() - t0:.2f} s")
print({k: round(v, 2) for k, v in spent.items()})
