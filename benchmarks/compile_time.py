"""Where a cold first call's seconds go, and whether its kernel compilations can run side by side.

    python benchmarks/compile_time.py OUT.json [--parts tilings fa4 pixel] [--cases CASE ...]

Every measurement runs in a new process with an empty Triton cache (FlashAttention-4's disk cache
off, its default), so each one is cold. Parts:

  tilings  our FP8 attention (``ops.fp8_attention``) in each of its ``TILES``, compiled and run once at
           the 7B PRXPixel's shape (1024² b2: 4096 queries, 256 text + 4096 image keys, 24 heads of
           128): one after another, then all at once in threads, then one after another beside a
           pure-Python thread (the share of the compile that holds the GIL: how much that thread's
           loop slowed down)
  fa4      FlashAttention-4's import and its first call at the same shape (``ops.flash4_attention``),
           alone, then beside a pure-Python thread
  pixel    ``compile_prx``'s first call of the 7B PRXPixel (``peers.pixel_model``) with the
           ``prx-pixel-1024-bf16`` and the ``prx-pixel-1024-fp8`` presets, a process each: seconds,
           and ``report()``'s stage timings and the kernel measurement's seconds per candidate

-> OUT.json: ``{part: {case: {...}}}``, each case as its process reported it (or its error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

B, LQ, TEXT, HEADS, D = 2, 4096, 256, 24, 128
CASES = {
    "tilings": ["serial", "threads", "serial_beside_python"],
    "fa4": ["alone", "beside_python"],
    "pixel": ["prx-pixel-1024-bf16", "prx-pixel-1024-fp8"],
}


class PythonLoad:
    """A thread running a pure-Python loop: its rate beside the main thread's work, against its rate
    alone, is the share of the GIL that work left it."""

    def __init__(self) -> None:
        self.alone = self._measure(0.5)

    def _measure(self, seconds: float | None) -> float:
        """Run the loop in a thread for ``seconds`` (None: until ``__exit__``); its rate."""
        self.count, self.stop = 0, False
        thread = threading.Thread(target=self._run, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        if seconds is None:
            self.thread, self.t0 = thread, t0
            return 0.0
        time.sleep(seconds)
        self.stop = True
        thread.join()
        return self.count / (time.perf_counter() - t0)

    def _run(self) -> None:
        while not self.stop:
            self.count += 1

    def __enter__(self) -> PythonLoad:
        self._measure(None)
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()
        self.rate = self.count / (time.perf_counter() - self.t0)

    def report(self) -> dict:
        return {"python_thread_rate_share": round(self.rate / self.alone, 3)}


def _inputs():
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    mask = torch.zeros(B, TEXT, dtype=torch.bool, device="cuda")
    mask[0, :64] = True
    mask[1, :] = True
    return (
        rand(B, LQ, HEADS, D),
        rand(B, TEXT, HEADS, D),
        rand(B, TEXT, HEADS, D),
        mask,
        rand(B, LQ, HEADS, D),
        rand(B, LQ, HEADS, D),
    )


def tilings(case: str) -> dict:
    import torch

    from prx_compile.ops.fp8_attention import TILES, joint_attention_fp8

    q, k_a, v_a, mask, k_b, v_b = _inputs()
    seconds: dict[str, float] = {}

    def one(tile: int) -> None:
        stream = torch.cuda.Stream()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            joint_attention_fp8(q, k_a, v_a, mask, k_b, v_b, D**-0.5, tile)
        stream.synchronize()
        seconds[str(tile)] = round(time.perf_counter() - t0, 3)

    t0 = time.perf_counter()
    out: dict = {}
    if case == "threads":
        with ThreadPoolExecutor(len(TILES)) as pool:
            list(pool.map(one, range(len(TILES))))
    elif case == "serial_beside_python":
        with PythonLoad() as load:
            for tile in range(len(TILES)):
                one(tile)
        out.update(load.report())
    else:
        for tile in range(len(TILES)):
            one(tile)
    out.update(wall_s=round(time.perf_counter() - t0, 3), seconds_per_tiling=seconds)
    return out


def fa4(case: str) -> dict:
    import torch

    from prx_compile.ops import cudnn_attention, flash4_attention

    q, k_a, v_a, mask, k_b, v_b = _inputs()
    k, v = torch.cat([k_b, k_a], 1), torch.cat([v_b, v_a], 1)
    seq = cudnn_attention.seq_buffer(B, q.device)
    seq[0, :B] = LQ
    seq[1, :B] = LQ + mask.sum(1).int()
    torch.cuda.synchronize()
    out: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        if flash4_attention.kernel() is None:
            raise RuntimeError("FlashAttention-4 did not load")
        out["import_s"] = round(time.perf_counter() - t0, 3)
        t1 = time.perf_counter()
        flash4_attention.padded_attention(q, k, v, seq, D**-0.5)
        torch.cuda.synchronize()
        out["first_call_s"] = round(time.perf_counter() - t1, 3)

    if case == "beside_python":
        with PythonLoad() as load:
            run()
        out.update(load.report())
    else:
        run()
    return out


def pixel(preset: str) -> dict:
    import torch
    from peers import pixel_model  # benchmarks/, beside this script

    from prx_compile import compile_prx
    from prx_compile.tools.bench import Case

    t0 = time.perf_counter()
    model = pixel_model()
    kw = Case((1024, 1024), 2, vae_scale_factor=1).inputs(model, torch.bfloat16, "cuda")
    out = {"model_s": round(time.perf_counter() - t0, 2)}
    t0 = time.perf_counter()
    ct = compile_prx(model, config=preset)
    with torch.no_grad():
        ct(**kw, return_dict=False)
    torch.cuda.synchronize()
    out["first_call_s"] = round(time.perf_counter() - t0, 2)
    report = ct.report()
    first = report["engine_sets"][0]
    out["timings"] = {k: round(v, 3) for k, v in (first.get("timings") or {}).items()}
    out["kernels"] = report["kernels"]
    return out


def child(part: str, case: str) -> None:
    result = {"tilings": tilings, "fa4": fa4, "pixel": pixel}[part](case)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--parts", nargs="+", default=list(CASES), choices=list(CASES))
    cases = [c for part in CASES.values() for c in part]
    ap.add_argument("--cases", nargs="+", choices=cases, help="only these cases of the parts")
    ap.add_argument("--child", nargs=2, metavar=("PART", "CASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    results: dict = {"what": __doc__.split("\n")[0], "parts": args.parts}
    for part in args.parts:
        results[part] = {}
        for case in [c for c in CASES[part] if not args.cases or c in args.cases]:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", part, case], env=env, capture_output=True, text=True
                )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                row = json.loads(lines[-1][len("RESULT ") :])
            else:
                row = {"error": (proc.stderr or proc.stdout)[-1500:]}
            row["process_s"] = round(time.perf_counter() - t0, 2)
            results[part][case] = row
            print(part, case, json.dumps(row)[:600], flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
