"""What the benchmarks share: timing (back to back and synchronised), first calls, device memory,
kernel profiles by category, and full-size models with random non-degenerate weights made on the GPU.

Every benchmark writes one JSON file; the README and docs cite them from benchmarks/results/.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from prx_compile.tools.bench import rel_err, time_back_to_back, time_cuda

__all__ = [
    "WEIGHTS",
    "first_call",
    "init_random_",
    "made_model",
    "kernel_ms",
    "kernel_profile",
    "memory_gb",
    "rel_err",
    "speed",
    "step_timeline",
    "timeline_of",
    "time_back_to_back",
    "time_cuda",
]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_gb() -> float:
    """This process's resident host memory (pinned memory included once touched), GB; 0 where
    /proc is not there."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**30


def memory_gb() -> float:
    """Device memory in use (the driver's view: every allocation, engines and workspaces included);
    0 without a GPU."""
    if not torch.cuda.is_available():
        return 0.0
    free_b, total = torch.cuda.mem_get_info()
    return (total - free_b) / 2**30


def first_call(fn, kwargs: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(output, seconds) of the first call of ``fn`` (builds, JIT compiles and captures included)."""
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(**kwargs, return_dict=False)[0]
    sync()
    return out, time.perf_counter() - t0


def speed(fn, kwargs: dict[str, Any], iters: int = 20, warmup: int = 3) -> dict[str, float]:
    """ms per step back to back (as a pipeline runs its steps) and synchronised per call (median,
    min, max) of ``fn(**kwargs)``."""

    def step():
        with torch.no_grad():
            return fn(**kwargs, return_dict=False)

    b2b = [time_back_to_back(step, warmup=warmup, iters=iters) for _ in range(3)]
    sync = time_cuda(step, warmup=1, iters=iters)
    return {
        "ms_back_to_back": statistics.median(b2b),
        "ms_back_to_back_runs": b2b,
        "ms_synchronised": sync["ms"],
        "ms_synchronised_min": sync["min"],
        "ms_synchronised_max": sync["max"],
    }


@torch.no_grad()
def kernel_ms(fn, calls: int = 50, runs: int = 5) -> float:
    """A kernel's time alone (CUDA): the least over ``runs`` of the mean ms per call of ``calls``
    launches queued back to back between two CUDA events."""
    best = float("inf")
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return round(best, 4)


#: how a benchmark's full-size model gets its random weights: "constructed", as diffusers' constructor
#: leaves them (PyTorch's default init of each layer) plus the spec's ``nondegenerate_`` (PRX's zero
#: modulation; nothing for FLUX), what ``tools.testing.make_prx`` gives the 1.17 B; "scaled",
#: ``init_random_`` (every 2-D weight N(0, 0.02) scaled to its fan-in), what 0.17-0.30's FLUX and 7B
#: runs used. The errors differ: on a CPU, at reduced depth and full width, FP8's error against bf16
#: was 2.5x (FLUX.1) and 1.3x (PRXPixel) larger with "scaled" (``docs/design-notes.md``).
WEIGHTS = ("constructed", "scaled")


def made_model(
    spec, config: dict, weights: str, device: str, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """``spec``'s model of ``config`` with ``weights`` (``WEIGHTS``), made on ``device`` in ``dtype``
    (no CPU copy), in eval mode without gradients."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHTS}")
    if weights == "scaled":
        model = spec.construct(config).to_empty(device=device).requires_grad_(False)
        init_random_(model, seed=seed)
    else:
        cls = spec.model_class()  # imported first: module-level tensors keep their own dtype and device
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # each layer's default init, drawn in the model's dtype
        try:
            with torch.device(device):
                model = cls(**config)
        finally:
            torch.set_default_dtype(default)
    spec.nondegenerate_(model, seed=seed)
    return model.to(dtype).eval().requires_grad_(False)


def init_random_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """Random non-degenerate weights, in place and on the model's device (a model made on the meta
    device and ``to_empty``'d): every 2-D weight ~ N(0, std) scaled by 1/sqrt(fan_in / 1024), biases
    ~ N(0, std/4), norm weights 1 (diffusers' norms), everything else ~ N(0, std)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            scale = std * min(1.0, (1024 / p.shape[1]) ** 0.5)
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * scale)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * std / 4)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * std)
    return model


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernel_categories(names_ms: dict[str, tuple[int, float]]) -> dict[str, float]:
    """Kernel name -> (calls, ms) summed into coarse categories (ms per step)."""
    exact = {"_kernel": "triton q/k norm + rope", "_merge_kernel": "triton attention merge"}
    rules = [
        ("FP8 GEMM (torch._scaled_mm)", ("f8f8bf16", "scaled_mm", "e4m3")),
        ("triton fp8 quantisation", ("_row_quant", "_gelu_mul_quant", "_quant")),
        ("triton fp8 attention", ("_fp8_attn", "fp8_attention", "_attn_fwd")),
        ("attention (FlashAttention-4)", ("flash_attncute", "flashattention")),
        ("attention (cuDNN)", ("sdpa", "flash", "fmha", "cudnn_generated_fort_native_sdpa")),
        ("cuDNN GEMM + epilogue (the MLP gate)", ("cudnn_generated_fort_native_sm90_matmul",)),
        ("cuBLAS GEMM", ("nvjet", "cutlass", "sm90_xmma", "gemm")),
        ("tensorrt (myelin fusions)", ("__myl", "myl")),
        ("inductor (triton fusions)", ("triton_",)),
    ]
    out: dict[str, float] = {}
    for name, (_, ms) in names_ms.items():
        low = name.lower()
        cat = exact.get(name) or next((c for c, keys in rules if any(k in low for k in keys)), "other")
        out[cat] = out.get(cat, 0.0) + ms
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def kernel_profile(fn, kwargs: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """The kernels of one step of ``fn`` (a compiled module built with CUDA graphs off, or any
    callable): ms per step by name and by category (torch.profiler over ``steps`` steps)."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        with torch.no_grad():
            return fn(**kwargs, return_dict=False)

    no_graph_ms = time_cuda(step, warmup=2, iters=5)["ms"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3 / steps
        if ms > 0:
            kernels[e.key] = (e.count // steps, ms)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    return {
        "ms_per_step_without_graphs": no_graph_ms,
        "kernel_ms_total": round(sum(ms for _, ms in kernels.values()), 3),
        "by_category": kernel_categories(kernels),
        "top_kernels": [{"name": k[:160], "calls": c, "ms": round(ms, 4)} for k, (c, ms) in top],
    }


def step_timeline(fn, kwargs: dict[str, Any], steps: int = 5, top: int = 15) -> dict[str, Any]:
    """Where a step's time goes as it runs, CUDA graphs and all: ``steps`` steps queued back to back
    under torch.profiler, then per step the span from the first kernel's start to the last one's end,
    the time some kernel ran (``busy_ms``, the union of their intervals), the idle rest, the kernels'
    summed durations by category (to compare with ``kernel_profile``'s, taken without graphs), and the
    ``top`` longest idle gaps with the kernels on either side. 0 everywhere on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        with torch.no_grad():
            return fn(**kwargs, return_dict=False)

    for _ in range(2):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if "CUDA" in str(getattr(e, "device_type", "")) and e.time_range.end > e.time_range.start
    )
    return timeline_of(spans, steps, top)


def timeline_of(spans: list[tuple[float, float, str]], steps: int, top: int = 15) -> dict[str, Any]:
    """``step_timeline``'s figures from (start µs, end µs, kernel name) triples sorted by start."""
    if not spans:
        return {"steps": steps, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "by_category": {}, "gaps": []}
    busy, gaps, end, last = 0.0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    span = end - spans[0][0]
    names: dict[str, tuple[int, float]] = {}
    for start, stop, name in spans:
        calls, ms = names.get(name, (0, 0.0))
        names[name] = (calls + 1, ms + (stop - start) / 1e3 / steps)
    gaps.sort(reverse=True)
    return {
        "steps": steps,
        "span_ms": round(span / 1e3 / steps, 3),
        "busy_ms": round(busy / 1e3 / steps, 3),
        "idle_ms": round((span - busy) / 1e3 / steps, 3),
        "gaps_over_10us": sum(1 for g in gaps if g[0] > 10) / steps,
        "idle_ms_in_gaps_over_10us": round(sum(g[0] for g in gaps if g[0] > 10) / 1e3 / steps, 3),
        "by_category": kernel_categories(names),
        "gaps": [{"us": round(g, 1), "after": a[:100], "before": b[:100]} for g, a, b in gaps[:top]],
    }
