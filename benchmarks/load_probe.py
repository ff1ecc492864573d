"""Where a new process's load_compiled and first step spend their time (phases timed by wrapping the
loader's steps), then the first and second steps.

    python benchmarks/load_probe.py ARTIFACT INPUTS.pt OUT.json [--profile] [--workers N] [--group G]
        [--digest | --no-verify] [--preimport] [--cuda-ready]

``--profile``: the first step runs under cProfile (its time then includes the profiler's).
``--workers N``: ``io.fast_read.WORKERS`` (threads reading, hashing and copying); ``--group G``:
``io.fast_read.GROUP`` (64 MiB chunks per read).
``--digest``: load pinned to the artifact's digest (its files checked against their sha256, not
their crc32); ``--no-verify``: ``verify=False`` (nothing hashed). ``--preimport``: the kernel
packages the load imports beside its read (FlashAttention-4, cuDNN's frontend, TensorRT's bindings)
are imported before it is timed (``preimport_s``: seconds per package), so the load's time is its
own. ``--cuda-ready``: the CUDA context made before the load (``cuda_init_s``), as in a pipeline's
process whose text encoders already run on the GPU. ``spans_s["read_file"]`` starts where the read
begins planning; the imports start (``import tensorrt``) once its tensors are allocated.
"""

import cProfile
import functools
import hashlib
import io
import json
import os
import pstats
import sys
import time

import torch

t0 = time.perf_counter()
import diffusers  # noqa: E402,F401

import prx_compile  # noqa: E402
from prx_compile.io import artifact, fast_read, saving  # noqa: E402
from prx_compile.runtime import module  # noqa: E402

art, inputs, out_path = sys.argv[1:4]
profile = "--profile" in sys.argv
if "--workers" in sys.argv:
    fast_read.WORKERS = int(sys.argv[sys.argv.index("--workers") + 1])
if "--group" in sys.argv:
    fast_read.GROUP = int(sys.argv[sys.argv.index("--group") + 1])
from diffusers import FluxTransformer2DModel, PRXTransformer2DModel  # noqa: E402,F401

t_imported = time.perf_counter()
preimport_s = None
if "--preimport" in sys.argv and torch.cuda.is_available():
    from prx_compile.backends.tensorrt import engine  # noqa: E402
    from prx_compile.ops import cudnn_attention, flash4_attention  # noqa: E402

    preimport_s = {}
    for name, load in (
        ("tensorrt", engine.bindings),
        ("cudnn_frontend", cudnn_attention.frontend),
        ("flash4", flash4_attention.kernel),
    ):
        s = time.perf_counter()
        load()
        preimport_s[name] = time.perf_counter() - s
phases: dict[str, float] = {}
spans: dict[str, list[float]] = {}  # label -> [start, end] in seconds from load_compiled's call


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


def spanned(owner, name, label):
    """Where ``owner.name`` ran, from whichever thread (the import-ahead thread's imports)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spans.setdefault(label, [s - t1, time.perf_counter() - t1])

    setattr(owner, name, wrapper)


if torch.cuda.is_available():
    from prx_compile.backends.tensorrt import engine  # noqa: E402
    from prx_compile.ops import cudnn_attention, flash4_attention  # noqa: E402

    spanned(engine, "bindings", "import tensorrt")
    spanned(cudnn_attention, "frontend", "import cudnn_frontend")
    spanned(flash4_attention, "kernel", "import flash4")
    spanned(fast_read, "read_file", "read_file")
timed(artifact, "open_artifact", "open_artifact (manifest)")
timed(artifact.Reader, "verify", "verify (sha256)")
timed(artifact.Reader, "read_tensors", "read_tensors (read and check)")
timed(artifact.Reader, "read_bytes", "read_bytes (read and check)")
timed(saving, "_load_model", "_load_model")
timed(saving, "check_compatible", "check_compatible")
timed(saving.Plan, "resolve", "Plan.resolve")
timed(saving, "assemble", "assemble")
timed(module, "_install_precision", "_install_precision")
timed(module.CompiledTransformer, "__init__", "CompiledTransformer.__init__")
options = {}
if "--digest" in sys.argv:  # the digest save_compiled printed: sha256 of the manifest's bytes
    with open(f"{art}/manifest.json", "rb") as f:
        options["digest"] = "sha256:" + hashlib.sha256(f.read()).hexdigest()
if "--no-verify" in sys.argv:
    options["verify"] = False
cuda_init_s = None
if "--cuda-ready" in sys.argv and torch.cuda.is_available():
    s = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda_init_s = time.perf_counter() - s
t1 = time.perf_counter()
ct = prx_compile.load_compiled(art, **options)
t2 = time.perf_counter()
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = {k: v.to(dev) for k, v in torch.load(inputs).items()}
pr = cProfile.Profile()
if profile:
    pr.enable()
got = ct(**kw, return_dict=False)[0]
if dev == "cuda":
    torch.cuda.synchronize()
pr.disable()
t3 = time.perf_counter()
ct(**kw, return_dict=False)
if dev == "cuda":
    torch.cuda.synchronize()
t4 = time.perf_counter()
s = io.StringIO()
if profile:
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
want = torch.load(inputs + ".out").to(got.device) if os.path.exists(inputs + ".out") else None
r = {
    "rel_err_to_saved": None
    if want is None
    else float((got.float() - want.float()).norm() / want.float().norm()),
    "workers": fast_read.WORKERS,
    "group": fast_read.GROUP,
    "options": sorted(options),
    "preimport_s": preimport_s,
    "cuda_init_s": cuda_init_s,
    "imports_s": t_imported - t0,
    "load_compiled_s": t2 - t1,
    "phases_s": phases,
    "spans_s": spans,
    "first_step_s" + ("_profiled" if profile else ""): t3 - t2,
    "second_step_s": t4 - t3,
    "load_and_first_step_s": t3 - t1,
    "first_step_profile": s.getvalue()[-14000:],
    "report_timings": ct.report()["engine_sets"][0].get("timings"),
}
open(out_path, "w").write(json.dumps(r, indent=1, default=str))
print(json.dumps({k: v for k, v in r.items() if k != "first_step_profile"}, indent=1, default=str))
