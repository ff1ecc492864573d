"""Where one engine set's first call goes (time and device memory): the probe behind issue 23's plan.

    python benchmarks/probes/profile_build.py OUT_DIR [--config NAME] [--shape H W B] [--build-workers N]
        [--sampler | --no-profile] [--set KEY=JSON ...]

Full-size PRX (bf16, non-degenerate), the set that serves ``--shape`` (default 1024 1024 2) under
``--config`` (default ``prx-1024-bf16-static``; ``default`` for compile_prx's own: 832 1216 2 is then
its range set). cProfile sees the main thread only: ``--build-workers 1`` (the default here) keeps
the engine builds in it. A warm-up build of a 4-block model first (imports, CUDA and
Torch-TensorRT initialisation are once per process), then the full model's first call (its set's
build, first run and CUDA graph capture) under cProfile: the top functions by cumulative and by own
time -> OUT_DIR/profile_build.txt. Device memory (allocated by PyTorch, reserved by its allocator, in
use by the process) with eager, after the first call and after ``torch.cuda.empty_cache()``, with
the set's timings, report and warm ms/step -> OUT_DIR/profile_build.json. ``--sampler`` samples every
thread's stack instead (the conversion threads too); ``--no-profile`` only times; ``--set`` passes
compile_prx overrides (``--set optimization_level=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from prx_compile import compile_prx
from prx_compile.tools.bench import Case, time_cuda
from prx_compile.tools.testing import FULL_PRX, make_prx


def memory() -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_gb": torch.cuda.memory_allocated() / 1e9,
        "reserved_gb": torch.cuda.memory_reserved() / 1e9,
        "in_use_gb": (total - free) / 1e9,
    }


def _short(path: str) -> str:
    return path.rsplit("site-packages/", 1)[-1].rsplit(".prx-site/", 1)[-1]


class Sampler:
    """Every ``interval`` s, the stack of every other thread: how often each function is on a stack
    (inclusive) and which line runs (own), over all threads' samples."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.samples = interval, 0
        self.inclusive: Counter = Counter()
        self.own: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            frame = top = None
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                seen = set()
                top = frame
                while frame is not None:
                    code = frame.f_code
                    key = f"{_short(code.co_filename)}:{code.co_name}"
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[key] += 1
                    frame = frame.f_back
                if top.f_code.co_name != "wait":  # idle pool workers
                    c = top.f_code
                    self.own[f"{_short(c.co_filename)}:{top.f_lineno} {c.co_name}"] += 1
                self.samples += 1
            del frame, top  # no frame outlives its sample (frames hold their locals)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def text(self, top: int) -> str:
        lines = [f"{self.samples} thread samples every {self.interval * 1e3:.0f} ms", "", "inclusive:"]
        lines += [f"{n:7d}  {k}" for k, n in self.inclusive.most_common(top * 3)]
        lines += ["", "own line:"]
        lines += [f"{n:7d}  {k}" for k, n in self.own.most_common(top)]
        return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default="prx-1024-bf16-static")
    ap.add_argument("--shape", type=int, nargs=3, default=[1024, 1024, 2], metavar=("H", "W", "B"))
    ap.add_argument("--build-workers", type=int, default=1)
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--sampler", action="store_true", help="sample every thread instead of cProfile")
    ap.add_argument("--no-profile", action="store_true", help="timings and memory only")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON", help="compile_prx overrides")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"memory": {}, "timings": {}, "args": vars(args)}
    case = Case(tuple(args.shape[:2]), args.shape[2])
    config = {} if args.config == "default" else {"config": args.config}
    config["build_workers"] = args.build_workers
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = json.loads(value)

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
    prof = Sampler() if args.sampler else None if args.no_profile else cProfile.Profile()
    t0 = time.perf_counter()
    with prof if args.sampler else contextlib.nullcontext():
        if isinstance(prof, cProfile.Profile):
            prof.enable()  # the first call: that set's build, its first run and CUDA graph capture
        with torch.no_grad():
            compiled(**kw, return_dict=False)
        torch.cuda.synchronize()
        if isinstance(prof, cProfile.Profile):
            prof.disable()
    res["first_call_s"] = time.perf_counter() - t0
    res["memory"]["after_first_call"] = memory()
    torch.cuda.empty_cache()
    res["memory"]["after_first_call_empty_cache"] = memory()
    backend = compiled.engine_set_for(kw)
    res["timings"] = dict(backend.timings)
    res["report"] = backend.report()

    res["ms_per_step"] = time_cuda(lambda: compiled(**kw, return_dict=False), iters=10)
    if args.sampler:
        (out / "profile_build.txt").write_text(prof.text(args.top))
    elif prof is not None:
        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats(key).print_stats(args.top)
        (out / "profile_build.txt").write_text(text.getvalue())
    (out / "profile_build.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
