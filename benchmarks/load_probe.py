"""Where a new process's load_compiled and first step spend their time (phases timed by wrapping the
loader's steps; the first step under cProfile).

    python benchmarks/load_probe.py ARTIFACT INPUTS.pt OUT.json
"""

import cProfile
import functools
import io
import json
import pstats
import sys
import time

import torch

t0 = time.perf_counter()
import diffusers  # noqa: E402,F401

import prx_compile  # noqa: E402
from prx_compile.io import artifact, saving  # noqa: E402
from prx_compile.runtime import module  # noqa: E402

art, inputs, out_path = sys.argv[1:4]
from diffusers import FluxTransformer2DModel, PRXTransformer2DModel  # noqa: E402,F401

t1 = time.perf_counter()
phases: dict[str, float] = {}


def timed(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - s

    setattr(owner, name, wrapper)


timed(artifact, "open_artifact", "open_artifact (manifest, verify)")
timed(artifact.Reader, "verify", "verify (sha256)")
timed(artifact.Reader, "read_tensors", "read_tensors")
timed(saving, "_load_model", "_load_model")
timed(saving, "check_compatible", "check_compatible")
timed(saving.Plan, "resolve", "Plan.resolve")
timed(saving, "assemble", "assemble")
timed(module, "_install_precision", "_install_precision")
timed(module.CompiledTransformer, "__init__", "CompiledTransformer.__init__")
ct = prx_compile.load_compiled(art)
t2 = time.perf_counter()
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = {k: v.to(dev) for k, v in torch.load(inputs).items()}
pr = cProfile.Profile()
pr.enable()
ct(**kw, return_dict=False)
if dev == "cuda":
    torch.cuda.synchronize()
pr.disable()
t3 = time.perf_counter()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
r = {
    "imports_s": t1 - t0,
    "load_compiled_s": t2 - t1,
    "phases_s": phases,
    "first_step_s_profiled": t3 - t2,
    "first_step_profile": s.getvalue()[-14000:],
    "report_timings": ct.report()["engine_sets"][0].get("timings"),
}
open(out_path, "w").write(json.dumps(r, indent=1, default=str))
print(json.dumps({k: v for k, v in r.items() if k != "first_step_profile"}, indent=1, default=str))
