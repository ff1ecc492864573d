"""Benchmark harness: per-step latency, build time, memory and accuracy of several paths, measured in
one process on the same weights and inputs (``run_bench`` and ``prx-compile bench``).

A path is a name and a function that turns the eager transformer into something callable with PRX's
forward kwargs. ``PATHS`` holds the peers (eager, torch.compile in two modes, plain MTTM,
torch.compile + torchao float8) and
``compile_prx``; ``compile_path`` makes a compile_prx path for any config. Each path is built once, on
the first case, then timed warm (warm-up calls, CUDA synchronised, median of ``iters`` calls).
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import CompiledTransformer

logger = logging.getLogger(__name__)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||out - ref|| / ||ref|| in fp32 (NaN anywhere -> nan)."""
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().float() - ref.detach().float()).abs().max())


def time_cuda(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Per-call milliseconds, synchronised: median ``ms``, mean, p90 (CUDA events; wall clock on CPU)."""
    if iters < 1:
        raise ValueError("iters must be at least 1")
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
        "min": times[0],
        "max": times[-1],
        "p90": times[min(len(times) - 1, round(0.9 * (len(times) - 1)))],
        "iters": iters,
    }


def time_back_to_back(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Milliseconds per call of ``iters`` calls made back to back, as a pipeline makes its steps (no
    synchronisation between them: the CPU's work of one call overlaps the GPU's of the last), after
    ``warmup`` calls. The per-call synchronised figure is ``time_cuda``'s."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / iters


MASKS = ("pipeline", "none", "full")


@dataclass
class Case:
    """One input configuration: pixel resolution (h, w), transformer batch, text mask kind.

    mask: "pipeline": what PRXPipeline passes with guidance (row 0: empty negative prompt, 1 token
    kept; row 1: a 40-token prompt; all padded to ``text_len``); "full": every token kept;
    "none": attention_mask=None.
    """

    resolution: tuple[int, int] = (1024, 1024)
    batch: int = 2
    mask: str = "pipeline"
    text_len: int = 256
    vae_scale_factor: int = 8  # pixels per latent (1 for the tiny demo model)

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"Case.mask={self.mask!r} is not one of {MASKS}")

    def inputs(self, model: torch.nn.Module, dtype: torch.dtype, device: str, seed: int = 0):
        from ..export import example_inputs

        h, w = (r // self.vae_scale_factor for r in self.resolution)
        kw = example_inputs(model, self.batch, h, w, self.text_len, dtype=dtype, device=device, seed=seed)
        if self.mask == "none":
            kw["attention_mask"] = None
        elif self.mask == "pipeline":
            keep = [1, 40] if self.batch == 2 else [40] * self.batch
            mask = torch.zeros(self.batch, self.text_len, dtype=torch.bool, device=device)
            for i, n in enumerate(keep):
                mask[i, : min(n, self.text_len)] = True
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
    config: str | None = None
    weights: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def environment() -> dict[str, Any]:
    """GPU and library versions for the results file."""
    import diffusers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "gpu": None,
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            from ..backends.tensorrt import shim

            env.update(shim.versions())
        except Exception as e:  # no TensorRT here: say so in the file
            env["torch_tensorrt"] = f"unavailable ({type(e).__name__})"
    else:
        env["torch_tensorrt"] = "unavailable (no GPU)"
    return env


Factory = Callable[[torch.nn.Module], Callable[..., Any]]


def compile_path(config: Any = None, **overrides: Any) -> Factory:
    """A compile_prx path: ``compile_prx(model, config=config, **overrides)``. With ``precision:
    fp8`` it compiles a copy of the model (FP8 quantises the block linears in place), so the paths
    after it still run the original."""
    from ..config import CompileConfig

    fp8 = CompileConfig.resolve(config, **overrides).precision == "fp8"

    def make(model):
        from ..runtime.module import compile_prx

        return compile_prx(copy.deepcopy(model) if fp8 else model, config=config, **overrides)

    make.config = config if isinstance(config, str) else ("default" if config is None else "custom")
    make.weights = overrides.get("weights")
    make.dtype = "fp8" if fp8 else None
    return make


def _torchao_fp8(model):
    """torch.compile + torchao float8 (row-wise dynamic activation scales, per-channel weight
    scales) on the same block linears as ``precision: fp8``, on a copy of the model."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    from ..models import spec_for

    targets = spec_for(model).block_linears
    model = copy.deepcopy(model)
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    quantize_(
        model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and bool(targets.match(fqn))
    )
    return torch.compile(model)


_torchao_fp8.dtype = "fp8"


def _mttm(model):
    from ..backends.tensorrt import shim

    return shim.torch_tensorrt().MutableTorchTensorRTModule(model, strict=False)


PATHS: dict[str, Factory] = {
    "eager": lambda model: model,
    "torch.compile": lambda model: torch.compile(model),
    "torch.compile-max-autotune": lambda model: torch.compile(model, mode="max-autotune"),
    "plain_mttm": _mttm,
    "torch.compile+torchao": _torchao_fp8,
    "compile_prx": compile_path(),
}


def run_bench(
    cases: list[Case],
    paths: list[str] | dict[str, Factory],
    *,
    model: torch.nn.Module,
    warmup: int = 3,
    iters: int = 10,
    out_json: str | Path | None = None,
    out_png: str | Path | None = None,
    progress: bool = True,
    first_case_only: tuple[str, ...] = ("plain_mttm",),
    reference_fp32: bool = False,
) -> dict[str, Any]:
    """Time every path on every case in this process, on ``model``'s weights and the same inputs.

    paths: names from ``PATHS``, or {label: factory}. Each path is built on the first case.
    first_case_only: paths timed on the first case only (plain MTTM rebuilds for every new shape).
    reference_fp32: also hold every output to an fp32 copy of ``model`` run eagerly on the same
        inputs (``extra["rel_err_fp32"]``; eager's own is the floor a ``dtype`` path can reach
        against eager).

    Returns {"env": ..., "records": [Record as dict]}, also written to ``out_json`` after every record
    (so a run cut short keeps what it measured). A path that fails gets a record with
    ``extra["error"]``; ``failures(result)`` lists them.
    """
    if isinstance(paths, list):
        unknown = [p for p in paths if p not in PATHS]
        if unknown:
            raise ValueError(f"unknown benchmark path(s) {unknown}; known: {list(PATHS)}")
        paths = {p: PATHS[p] for p in paths}
    p0 = next(model.parameters())
    device, dtype = str(p0.device.type), p0.dtype
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    env, records, refs = environment(), [], {}
    for case in cases:
        kw = case.inputs(model, dtype, device)
        with torch.no_grad():
            refs[case.label()] = (kw, model(**kw, return_dict=False)[0].float())
    refs32 = {}
    if reference_fp32:
        full = copy.deepcopy(model).float()
        for label, (kw, _) in refs.items():
            kw32 = {
                k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()
            }
            with torch.no_grad():
                refs32[label] = full(**kw32, return_dict=False)[0].float()
        del full
        if device == "cuda":
            torch.cuda.empty_cache()

    def save():
        if out_json:
            Path(out_json).write_text(
                json.dumps({"env": env, "records": [asdict(r) for r in records]}, indent=1, default=str)
            )

    for label, factory in paths.items():
        fn = step = out = served = None  # each holds the previous path's module
        gc.collect()  # the previous path's module (its reference cycles too): not counted as this one's
        if device == "cuda":
            torch.cuda.empty_cache()
        for i, case in enumerate(cases):
            if i > 0 and label in first_case_only:
                break
            kw, ref = refs[case.label()]
            rec = Record(
                label,
                list(case.resolution),
                case.batch,
                case.mask,
                getattr(factory, "dtype", None) or dtype_name,
                config=getattr(factory, "config", None),
                weights=getattr(factory, "weights", None),
            )
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                if fn is None:
                    if progress:
                        print(f"[bench] building {label} ...", flush=True)
                    fn = factory(model)
                with torch.no_grad():
                    out = fn(**kw, return_dict=False)[0]
                if device == "cuda":
                    torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                if i == 0:
                    rec.build_s = first_s
                else:
                    rec.extra["first_call_s"] = first_s
                rec.rel_err = rel_err(out, ref)
                rec.extra["max_abs_err"] = max_abs_err(out, ref)
                rec.extra["nan"] = bool(torch.isnan(out).any())
                if refs32:
                    rec.extra["rel_err_fp32"] = rel_err(out, refs32[case.label()])

                def step(fn=fn, kw=kw):
                    with torch.no_grad():
                        return fn(**kw, return_dict=False)

                rec.ms_per_step = time_back_to_back(step, warmup=warmup, iters=iters)
                t = time_cuda(step, warmup=0, iters=iters)
                rec.extra.update(ms_synchronised=t["ms"], min=t.get("min"), max=t.get("max"), p90=t["p90"])
                if isinstance(fn, CompiledTransformer):
                    r = fn.report()
                    # engines and segments of the set that ran this case
                    served = fn.engine_set_for(kw)
                    s = served.report() if served is not None and served.is_built else r
                    rec.engines, rec.torch_segments = s["engines"], s["torch_segments"]
                    rec.weights = r["weights"]
                    rec.extra.update(
                        kept_in_pytorch=s["torch_ops"],
                        engine_set=served.shapes.describe() if served is not None else None,
                        builds=r["builds"],
                        engine_sets=r["engine_sets"],
                    )
                if device == "cuda":
                    rec.peak_mem_gb = torch.cuda.max_memory_allocated() / 2**30
                    free, total = torch.cuda.mem_get_info()
                    rec.extra["device_mem_in_use_gb"] = (total - free) / 2**30
                    rec.extra["allocated_gb"] = torch.cuda.memory_allocated() / 2**30  # what tensors hold
            except Exception as e:
                logger.debug("bench path %s failed on %s", label, case.label(), exc_info=True)
                rec.extra["error"] = f"{type(e).__name__}: {e}"[:500]
            records.append(rec)
            if progress:
                print(
                    f"[bench] {label:40s} {case.label():28s} {fmt(rec.ms_per_step)} ms  "
                    f"rel_err {fmt(rec.rel_err, 4)}"
                    + (f"  ERROR {rec.extra['error'][:200]}" if "error" in rec.extra else ""),
                    flush=True,
                )
            save()
        fn = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result = {"env": env, "records": [asdict(r) for r in records]}
    save()
    if out_png:
        plot(result, out_png)
    return result


def failures(result: dict[str, Any]) -> list[str]:
    """'path on case: error' for every record that failed."""
    return [
        f"{r['path']} on {r['resolution'][0]}x{r['resolution'][1]} b{r['batch']}: {r['extra']['error']}"
        for r in result["records"]
        if "error" in r["extra"]
    ]


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e-2 and v != 0 else f"{v:.{digits}f}"
    return str(v)


def _env(result: dict[str, Any]) -> dict[str, Any]:
    """The results file's environment (``env``; ``environment`` in ``benchmarks/first_call.py``'s)."""
    return result.get("env") or result.get("environment") or {}


def table(result: dict[str, Any]) -> str:
    """A plain-text table of the records, with speedups against eager and torch.compile of the same case.
    Records of other benchmark files may lack ``build_s``, ``engines``, ... (shown as "-")."""
    recs = result["records"]
    base = {}
    for r in recs:
        key = (tuple(r["resolution"]), r["batch"], r["mask"])
        if r["path"] in ("eager", "torch.compile") and r.get("ms_per_step"):
            base[(key, r["path"])] = r["ms_per_step"]
    head = (
        f"{'path':38s} {'case':26s} {'ms/step':>8s} {'sync min-max':>15s} {'x eager':>8s} {'x t.c':>6s} "
        f"{'build s':>8s} {'rel err':>8s} {'eng':>4s} {'seg':>4s}"
    )
    lines = [head, "-" * len(head)]
    env = _env(result)
    if not env.get("gpu"):
        where = env.get("cpu") or "no GPU"
        lines.insert(
            0,
            f"CPU timings ({where}): they show the harness, not a GPU's speed; a tiny model's step is "
            "mostly Python overhead, so its ratios vary from run to run (see the min-max spread).",
        )
    for r in recs:
        key = (tuple(r["resolution"]), r["batch"], r["mask"])
        ms = r.get("ms_per_step")
        sp = [
            f"{base[(key, p)] / ms:.2f}" if ms and (key, p) in base else "-"
            for p in ("eager", "torch.compile")
        ]
        case = f"{r['resolution'][0]}x{r['resolution'][1]} b{r['batch']} {r['mask']}"
        extra = r.get("extra") or {}
        err = extra.get("error")
        label = _label(r)
        spread = f"{fmt(extra.get('min'))}-{fmt(extra.get('max'))}" if extra.get("min") is not None else "-"
        lines.append(
            f"{label[:38]:38s} {case:26s} {fmt(ms):>8s} {spread:>15s} {sp[0]:>8s} {sp[1]:>6s} "
            f"{fmt(r.get('build_s'), 1):>8s} {fmt(r.get('rel_err'), 4):>8s} {fmt(r.get('engines')):>4s} "
            f"{fmt(r.get('torch_segments')):>4s}" + (f"  ERROR: {err}" if err else "")
        )
    return "\n".join(lines)


def _label(r: dict[str, Any]) -> str:
    """A record's path, with its precision where that is fp8 (the same path can run both)."""
    return r["path"] + (" (fp8)" if r.get("dtype") == "fp8" else "")


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
    import textwrap

    recs = [r for r in result["records"] if r.get("ms_per_step")]
    cases = list(dict.fromkeys(_case_name(r) for r in recs))
    paths = list(dict.fromkeys(_label(r) for r in recs))
    width = 0.8 / max(1, len(paths))
    fig_w = min(24, max(7, 2 + 0.45 * len(recs)))
    fig, ax = plt.subplots(figsize=(fig_w, 4.8), dpi=100)
    for j, p in enumerate(paths):
        mine = [(cases.index(_case_name(r)), r) for r in recs if _label(r) == p]
        bars = ax.bar([i + j * width for i, _ in mine], [r["ms_per_step"] for _, r in mine], width, label=p)
        labels = [
            "NaN" if r.get("rel_err") != r.get("rel_err") else f"{r['ms_per_step']:.1f}" for _, r in mine
        ]
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_xticks([i + width * (len(paths) - 1) / 2 for i in range(len(cases))], cases, fontsize=8)
    ax.set_ylabel("ms per transformer step (lower is better)")
    env = _env(result)
    where = env.get("gpu") or "a CPU (timings of the harness, not of a GPU)"
    title = (
        f"PRX on {where}, torch {env.get('torch')}, Torch-TensorRT {env.get('torch_tensorrt')} "
        f"({env.get('tensorrt_package', 'no TensorRT')} {env.get('tensorrt', '')})"
    )
    ax.set_title(textwrap.fill(title, width=int(fig_w * 14)), fontsize=8)  # fits the figure's width
    # the legend under the axes, so it covers no bar
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=min(4, len(paths)), fontsize=7)
    rows = -(-len(paths) // 4)
    fig.tight_layout(rect=(0, 0.03 + 0.04 * rows, 1, 1))
    fig.savefig(path)
    plt.close(fig)
