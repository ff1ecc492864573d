"""Benchmark harness: per-step latency, build time, peak memory and accuracy of several paths,
measured in one process on the same inputs and weights. See ``run_bench`` and ``prx-compile bench``.
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||out - ref|| / ||ref|| in fp32 (NaN anywhere -> nan)."""
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().float() - ref.detach().float()).abs().max())


def time_cuda(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Per-call milliseconds with CUDA events (synchronised): median ``ms``, mean, p50, p90.

    On a CPU, wall-clock time with the same statistics.
    """
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "ms": statistics.median(times),
        "mean": statistics.fmean(times),
        "p50": statistics.median(times),
        "p90": times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))],
        "iters": iters,
    }


# -- harness -----------------------------------------------------------------------------------
#: Paths the harness knows. compile_prx variants are written "compile_prx[key=value,...]".
PATHS = ("eager", "torch.compile", "plain_mttm", "compile_prx")
MASKS = ("pipeline", "none", "full")


@dataclass
class Case:
    """One input configuration: pixel resolution (h, w), transformer batch, text mask kind.

    mask: "pipeline" — what PRXPipeline passes with guidance (row 0: empty negative prompt, 1 token
    kept; row 1: a 40-token prompt; all padded to ``text_len``); "full" — every token kept;
    "none" — attention_mask=None.
    """

    resolution: tuple[int, int] = (1024, 1024)
    batch: int = 2
    mask: str = "pipeline"
    text_len: int = 256

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"Case.mask={self.mask!r} is not one of {MASKS}")

    def inputs(self, config: Any, dtype: torch.dtype, device: str, vae_scale_factor: int = 8, seed: int = 0):
        from .export import example_inputs

        h, w = (r // vae_scale_factor for r in self.resolution)
        kw = example_inputs(config, self.batch, h, w, self.text_len, dtype=dtype, device=device, seed=seed)
        if self.mask == "none":
            kw["attention_mask"] = None
        elif self.mask == "pipeline":
            keep = [1, 40] if self.batch == 2 else [40] * self.batch
            mask = torch.zeros(self.batch, self.text_len, dtype=torch.bool, device=device)
            for i, n in enumerate(keep):
                mask[i, :n] = True
            kw["attention_mask"] = mask
        return kw

    def label(self) -> str:
        return f"{self.resolution[0]}x{self.resolution[1]} b{self.batch} mask={self.mask}"


@dataclass
class Record:
    path: str
    resolution: list[int]
    batch: int
    mask: str
    dtype: str
    ms_per_step: float | None = None
    build_s: float | None = None
    peak_mem_gb: float | None = None
    rel_err: float | None = None
    engines: int | None = None
    torch_segments: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def environment() -> dict[str, Any]:
    """GPU and library versions for the results file."""
    import diffusers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        from .backends import trt_shim

        env.update(trt_shim.versions())
    except Exception as e:  # no TensorRT here: say so in the file
        env["torch_tensorrt"] = f"unavailable ({type(e).__name__})"
    return env


def parse_path(path: str) -> tuple[str, dict[str, Any]]:
    """``compile_prx[attention=tensorrt,text_len=[1,77]]`` -> ("compile_prx", {...}), YAML-typed values."""
    import yaml

    if "[" not in path:
        return path, {}
    name, body = path[:-1].split("[", 1)
    overrides = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", body)):  # commas outside [...]
        k, v = item.split("=", 1)
        overrides[k.strip()] = yaml.safe_load(v)
    return name, overrides


class _Runner:
    """Builds one path lazily and runs it on PRX forward kwargs."""

    def __init__(self, path: str, model: torch.nn.Module, config_for_prx: dict[str, Any]):
        self.path = path
        self.name, self.overrides = parse_path(path)
        if self.name not in PATHS:
            raise ValueError(f"unknown benchmark path {path!r}; known: {PATHS}")
        self.model = model
        self.base_config = config_for_prx
        self.fn = None
        self.build_s = None
        self.info: dict[str, Any] = {}

    def build(self, kw: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        if self.name == "eager":
            self.fn = self.model
        elif self.name == "torch.compile":
            self.fn = torch.compile(self.model, **self.overrides)
        elif self.name == "plain_mttm":
            from .backends import trt_shim

            ttrt = trt_shim.torch_tensorrt()
            self.fn = ttrt.MutableTorchTensorRTModule(self.model, strict=False, **self.overrides)
        else:
            from .module import compile_prx

            self.fn = compile_prx(self.model, **{**self.base_config, **self.overrides})
        with torch.no_grad():
            self.fn(**kw, return_dict=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0
        self.info = self.partition_info()

    def partition_info(self) -> dict[str, Any]:
        if self.name == "compile_prx":
            r = self.fn.report()
            return {
                "engines": r["engines"],
                "torch_segments": r["torch_segments"],
                "torch_ops": r["torch_ops"],
            }
        if self.name == "plain_mttm":
            from .backends import trt_shim

            return {
                "engines": len(trt_shim.engine_modules(self.fn.gm)),
                "torch_segments": len(trt_shim.torch_segments(self.fn.gm)),
            }
        return {}

    def __call__(self, kw):
        with torch.no_grad():
            return self.fn(**kw, return_dict=False)[0]


def run_bench(
    cases: list[Case],
    paths: list[str],
    *,
    model_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    patchify: str = "reshape",
    prx_config: dict[str, Any] | None = None,
    warmup: int = 3,
    iters: int = 10,
    out_json: str | Path | None = None,
    out_png: str | Path | None = None,
    progress: bool = True,
    first_case_only: tuple[str, ...] = ("plain_mttm",),
    runtime_ablation: bool = False,
) -> dict[str, Any]:
    """Time every path on every case in this process, on the same non-degenerate weights and inputs.

    Args:
        cases: input configurations; each path is built once, on the first case.
        paths: names from ``PATHS``; "compile_prx[k=v,...]" adds CompileConfig overrides.
        model_config: PRX constructor kwargs ({} = the 1.17 B default; None = the tiny test PRX).
        prx_config: CompileConfig keys shared by every compile_prx path.
        first_case_only: paths timed on the first case only (plain MTTM rebuilds for every new shape).
        runtime_ablation: for compile_prx paths, also time the first case without CUDA graphs and with
            each joint-attention kernel pair — same build, same process.

    Returns:
        {"env": {...}, "records": [Record as dict, ...]} — also written to ``out_json``.
    """
    from .testing import make_prx

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_prx(model_config, patchify=patchify, dtype=dtype, device=device)
    prx_config = {"device": device, **(prx_config or {})}
    if device == "cpu":
        prx_config.setdefault("backend", "eager")
    records: list[Record] = []
    env = environment()
    refs = {}
    for case in cases:
        kw = case.inputs(model.config, dtype, device)
        with torch.no_grad():
            refs[case.label()] = (kw, model(**kw, return_dict=False)[0].float())
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    for path in paths:
        runner = _Runner(path, model, prx_config)
        for i, case in enumerate(cases):
            if i > 0 and parse_path(path)[0] in first_case_only:
                break
            kw, ref = refs[case.label()]
            rec = Record(
                path=path,
                resolution=list(case.resolution),
                batch=case.batch,
                mask=case.mask,
                dtype=dtype_name,
            )
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if i == 0:
                    if progress:
                        print(f"[bench] building {path} ...", flush=True)
                    runner.build(kw)
                    rec.build_s = runner.build_s
                else:
                    t0 = time.perf_counter()
                    runner(kw)  # a new shape: counts as this case's first call
                    rec.extra["first_call_s"] = time.perf_counter() - t0
                out = runner(kw)
                rec.rel_err = rel_err(out, ref)
                rec.extra["max_abs_err"] = max_abs_err(out, ref)
                rec.extra["nan"] = bool(torch.isnan(out).any())
                t = time_cuda(lambda kw=kw, runner=runner: runner(kw), warmup=warmup, iters=iters)
                rec.ms_per_step = t["ms"]
                rec.extra.update({k: t[k] for k in ("mean", "p50", "p90")})
                rec.engines = runner.info.get("engines")
                rec.torch_segments = runner.info.get("torch_segments")
                if runner.info.get("torch_ops"):
                    rec.extra["kept_in_pytorch"] = runner.info["torch_ops"]
                if runner.name == "compile_prx":
                    rec.extra["builds"] = runner.fn.builds
                if device == "cuda":
                    rec.peak_mem_gb = torch.cuda.max_memory_allocated() / 2**30
                    free, total = torch.cuda.mem_get_info()
                    rec.extra["device_mem_in_use_gb"] = (total - free) / 2**30
            except Exception as e:
                logger.exception("bench path %s failed on %s", path, case.label())
                rec.extra["error"] = f"{type(e).__name__}: {e}"[:500]
            records.append(rec)
            if progress:
                line = (
                    f"{path:40s} {case.label():28s} {fmt(rec.ms_per_step)} ms  rel_err {fmt(rec.rel_err, 4)}"
                )
                print(f"[bench] {line}", flush=True)
            if i == 0 and runtime_ablation and runner.name == "compile_prx" and runner.fn is not None:
                records += _runtime_ablation(runner, rec, kw, ref, warmup, iters)
            if out_json:  # partial results survive a run cut short
                Path(out_json).write_text(
                    json.dumps({"env": env, "records": [asdict(r) for r in records]}, indent=1, default=str)
                )
        if runner.name in ("plain_mttm", "compile_prx", "torch.compile"):
            runner.fn = None  # free engines / compiled graphs before the next path
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    result = {"env": env, "records": [asdict(r) for r in records]}
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=1, default=str))
    if out_png:
        plot(result, out_png)
    print(table(result))
    return result


def _runtime_ablation(runner: _Runner, base: Record, kw, ref, warmup: int, iters: int) -> list[Record]:
    """Switches that need no rebuild, timed on the same build: CUDA graphs off; joint-attention kernels."""
    from . import ops

    ct = runner.fn
    out = []

    def record(label: str) -> Record:
        r = Record(
            path=f"{runner.path} ({label})",
            resolution=base.resolution,
            batch=base.batch,
            mask=base.mask,
            dtype=base.dtype,
            engines=base.engines,
            torch_segments=base.torch_segments,
        )
        try:
            r.rel_err = rel_err(runner(kw), ref)
            t = time_cuda(lambda: runner(kw), warmup=warmup, iters=iters)
            r.ms_per_step = t["ms"]
            r.extra.update({k: t[k] for k in ("mean", "p50", "p90")})
        except Exception as e:
            r.extra["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[bench] {r.path:60s} {fmt(r.ms_per_step)} ms", flush=True)
        return r

    graphs, ct._graphs = ct._graphs, None
    out.append(record("no CUDA graphs"))
    ct._graphs = graphs
    default = ops.DEFAULT_JOINT_IMPL
    for impl in ops.JOINT_IMPLS[1:]:
        if impl == default:
            continue
        ops.DEFAULT_JOINT_IMPL = impl
        if ct._graphs is not None:
            ct._graphs.reset()  # captured launches hold the old kernels
        out.append(record(f"joint attention {impl}"))
    ops.DEFAULT_JOINT_IMPL = default
    if ct._graphs is not None:
        ct._graphs.reset()
    return out


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e-2 and v != 0 else f"{v:.{digits}f}"
    return str(v)


def table(result: dict[str, Any]) -> str:
    """A plain-text table of the records, with speedups against eager and torch.compile of the same case."""
    recs = result["records"]
    base = {}
    for r in recs:
        key = (tuple(r["resolution"]), r["batch"], r["mask"])
        if r["path"] in ("eager", "torch.compile") and r["ms_per_step"]:
            base[(key, r["path"])] = r["ms_per_step"]
    head = (
        f"{'path':38s} {'case':26s} {'ms/step':>8s} {'x eager':>8s} {'x t.c':>6s} {'build s':>8s} "
        f"{'rel err':>8s} {'eng':>4s} {'seg':>4s}"
    )
    lines = [head, "-" * len(head)]
    for r in recs:
        key = (tuple(r["resolution"]), r["batch"], r["mask"])
        ms = r["ms_per_step"]
        sp = [
            f"{base[(key, p)] / ms:.2f}" if ms and (key, p) in base else "-"
            for p in ("eager", "torch.compile")
        ]
        case = f"{r['resolution'][0]}x{r['resolution'][1]} b{r['batch']} {r['mask']}"
        err = r["extra"].get("error")
        lines.append(
            f"{r['path'][:38]:38s} {case:26s} {fmt(ms):>8s} {sp[0]:>8s} {sp[1]:>6s} "
            f"{fmt(r['build_s'], 1):>8s} "
            f"{fmt(r['rel_err'], 4):>8s} {fmt(r['engines']):>4s} {fmt(r['torch_segments']):>4s}"
            + (f"  ERROR {err[:60]}" if err else "")
        )
    return "\n".join(lines)


def _case_name(r: dict[str, Any]) -> str:
    h, w = r["resolution"]
    return f"{h}² b{r['batch']} {r['mask']}" if h == w else f"{h}x{w} b{r['batch']} {r['mask']}"


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Bar chart of ms/step, one group per case, one bar per path; NaN outputs are labelled NaN."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no chart written (pip install 'prx_compile[plot]')")
        return
    recs = [r for r in result["records"] if r["ms_per_step"]]
    cases = list(dict.fromkeys(_case_name(r) for r in recs))
    paths = list(dict.fromkeys(r["path"] for r in recs))
    width = 0.8 / max(1, len(paths))
    fig, ax = plt.subplots(figsize=(min(24, 3 + 0.45 * len(recs)), 4.2), dpi=100)
    for j, p in enumerate(paths):
        mine = [(cases.index(_case_name(r)), r) for r in recs if r["path"] == p]
        bars = ax.bar([i + j * width for i, _ in mine], [r["ms_per_step"] for _, r in mine], width, label=p)
        labels = ["NaN" if r["rel_err"] != r["rel_err"] else f"{r['ms_per_step']:.1f}" for _, r in mine]
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(cases))], cases, fontsize=8)
    ax.set_ylabel("ms per transformer step (lower is better)")
    env = result["env"]
    ax.set_title(
        f"PRX on {env.get('gpu')} — torch {env.get('torch')}, Torch-TensorRT {env.get('torch_tensorrt')} "
        f"({env.get('tensorrt_package', 'no TensorRT')} {env.get('tensorrt', '')})",
        fontsize=8,
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
