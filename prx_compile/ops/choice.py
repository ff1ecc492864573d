"""Kernels chosen by measurement, per engine set.

    choice = choose(plan, model, shapes, example)   # the candidates, run and timed at the set's shape
    plan.lowering(shapes, choice)                   # the rules emit what it chose

``plan`` is a ``prx_compile.plan.Plan`` (not imported here: the plan imports the ops).

The candidates are what the config allows and this machine has (``Plan.attention_candidates``,
``Plan.gate_candidates``): PRX's joint attention on FlashAttention-4, on cuDNN, as the split path, or
(``precision: fp8``) on our FP8 kernels in each tiling of ``ops.fp8_attention.TILES``; FLUX's dense
attention on FlashAttention-4, cuDNN or PyTorch's SDPA; the MLP gate as one cuDNN GEMM with GELU * up
in its epilogue, or not. A user's explicit choice is the only candidate. Each candidate runs once at
the set's own tuning point (JIT compilation and cuDNN plans happen here, not in the first step: this
is also the step's warm-up), its output is held to an fp32 reference of the same op (relative error:
``MAX_ERROR``), then it is timed as a CUDA graph of ``REPEATS`` calls replayed ``ROUNDS`` times (the
least mean kept: launch overhead and a busy Python thread do not count). The fastest candidate within
its bound wins; candidates within ``TIE`` of the fastest count as equally fast, and the most exact of
them runs (no size rule decides). A candidate that fails to run is recorded with the reason and left
out.

No CUDA (a CPU build), nothing is measured: the first candidate is taken, and the choice says so.
The choice is kept with the engine set (``report()``, the artifact, the engine cache): a loaded
TensorRT set does not measure again; ``rebuild=True`` does (as does a PyTorch backend's set, which
exports again after a load).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .. import schema
from .fp8_attention import TILES

if TYPE_CHECKING:
    from ..shapes import ShapeRange

logger = logging.getLogger(__name__)

#: the largest relative error (against fp32) a candidate may have: bf16 kernels measure 2-3e-3 at
#: 1.17 B and 7B shapes; e4m3 keeps 3 mantissa bits, and our FP8 attention measures 5.3e-2
#: (``benchmarks/results/attention_kernels_hd128_h200.json``): the bounds reject a broken kernel
MAX_ERROR = {"bf16": 1e-2, "fp8": 8e-2}
REPEATS = 5
ROUNDS = 3
#: candidates whose times are within this fraction of the fastest's count as equally fast (CUDA graph
#: replays of one candidate vary by about 1 %): the most exact of them runs
TIE = 0.02
#: the attention candidates' names besides our FP8 kernels' ("fp8/<tiling>")
NAMES = ("flash4", "cudnn", "split", "sdpa")

_NAME = schema.Str(40)
_CHOICE = schema.Dict(
    {
        "attention": _NAME,
        "gelu_gate": schema.Bool(),
        "how": schema.Str(80),
        "ms": schema.Map(_NAME, schema.Float(0.0, 1e6), max_len=32),
        "error": schema.Map(_NAME, schema.Float(0.0, 1e6), max_len=32),
        "rejected": schema.Map(_NAME, schema.Str(300), max_len=32),
    }
)


@dataclass(frozen=True)
class KernelChoice:
    """What one engine set runs, and why.

    attention: the attention candidate it runs ("flash4", "cudnn", "split", "fp8/<tile>"; dense:
        "flash4", "cudnn", "sdpa"). gelu_gate: whether the MLP gate is one cuDNN GEMM.
    how: "measured", "the only candidates" (nothing to choose) or "not measured (no CUDA)".
    ms: candidate -> ms per call at the set's tuning point ("attention/<name>", "gelu_gate/fused",
        "gelu_gate/unfused"). error: candidate -> relative error against fp32. rejected: candidate ->
        why it was left out (its error, or what it raised).
    """

    attention: str
    gelu_gate: bool
    how: str
    ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "attention": self.attention,
            "gelu_gate": self.gelu_gate,
            "how": self.how,
            "ms": {k: round(v, 4) for k, v in self.ms.items()},
            "error": {k: float(f"{v:.3g}") for k, v in self.error.items()},
            "rejected": dict(self.rejected),
        }

    @classmethod
    def from_json(cls, data: Any) -> KernelChoice:
        """The choice ``data`` records (an artifact's or the engine cache's): ValueError naming what
        is malformed or unknown. The record says what was measured where the set was built; the
        set's program runs what it holds (on another machine a kernel not installed there runs its
        named fallback)."""
        try:
            d = schema.check(_CHOICE, data, "kernels")
        except schema.SchemaError as e:
            raise ValueError(str(e)) from e
        names = {*NAMES, *(f"fp8/{i}" for i in range(len(TILES)))}
        if d["attention"] not in names:
            raise ValueError(f"kernels.attention={d['attention']!r} is not a kernel prx_compile has")
        return cls(d["attention"], d["gelu_gate"], d["how"], d["ms"], d["error"], d["rejected"])

    def describe(self) -> str:
        """One line: what runs, and the timings it was chosen on."""
        line = f"attention {self.attention}" + self._times("attention")
        if any(k.startswith("gelu_gate/") for k in self.ms):
            line += f"; MLP gate {'fused' if self.gelu_gate else 'unfused'}" + self._times("gelu_gate")
        if self.rejected:
            line += "; left out: " + "; ".join(f"{k}: {v}" for k, v in self.rejected.items())
        return f"{line} [{self.how}]"

    def _times(self, group: str) -> str:
        """ " (ms: a 0.123, b 0.456)" for the candidates of ``group`` that were timed, else ""."""
        times = [f"{k.split('/', 1)[1]} {v:.3f}" for k, v in self.ms.items() if k.startswith(f"{group}/")]
        return f" (ms: {', '.join(times)})" if times else ""


def unmeasured(plan: Any, shapes: ShapeRange | None, how: str) -> KernelChoice:
    """The first candidates, not measured (``how`` says why)."""
    return KernelChoice(plan.attention_candidates[0], plan.gate_candidates(shapes)[0], how)


def choose(
    plan: Any,
    model: torch.nn.Module,
    shapes: ShapeRange,
    example: dict[str, torch.Tensor],
    timer: Callable[[str, Callable[[], Any]], float] | None = None,
) -> KernelChoice:
    """Run, check and time every candidate at ``example``'s shape (the set's tuning point); the
    fastest within its bound. ``timer(key, run)`` -> ms per call (default: CUDA graphs, ``_time``).
    Without CUDA and without a timer, the first candidates (nothing measured)."""
    param = next(model.parameters(), None)
    if param is None or (param.device.type != "cuda" and timer is None):
        return unmeasured(plan, shapes, "not measured (no CUDA)")
    timer = timer or (lambda key, run: _time(run))
    attention, gates = plan.attention_candidates, plan.gate_candidates(shapes)
    bench = _Bench(plan, model, example, param.device, param.dtype)
    ms: dict[str, float] = {}
    errors: dict[str, float] = {}
    rejected: dict[str, str] = {}
    picks = []
    for group, names in (
        ("attention", attention),
        ("gelu_gate", ["fused" if g else "unfused" for g in gates]),
    ):
        if names == ["unfused"]:  # no gate to fuse
            continue
        ref = bench.reference(group)
        for name in names:
            key = f"{group}/{name}"
            try:
                fn, bound = bench.candidate(group, name)
                err = _rel_err(fn(), ref)
                errors[key] = err
                if not math.isfinite(err) or err > bound:
                    rejected[key] = f"relative error {err:.3g} over its bound {bound:g}"
                    continue
                ms[key] = timer(key, fn)
            except Exception as e:  # a kernel that cannot run here is left out, with the reason
                rejected[key] = f"{type(e).__name__}: {str(e)[:200]}"
                logger.info("kernel candidate %s left out: %s", key, rejected[key])
        best = _fastest(
            {n: (ms[f"{group}/{n}"], errors[f"{group}/{n}"]) for n in names if f"{group}/{n}" in ms}
        )
        if best is None:  # not silent: the step runs a candidate that failed here
            logger.warning(
                "every %s candidate failed its measurement (%s): %s runs unmeasured.",
                group,
                "; ".join(f"{k}: {v}" for k, v in rejected.items() if k.startswith(group)),
                names[0],
            )
        picks.append(best if best is not None else names[0])
        del ref
    if param.device.type == "cuda":
        bench.warm_gemm()
    gate = len(picks) > 1 and picks[1] == "fused"
    several = len(attention) > 1 or len(gates) > 1
    return KernelChoice(
        picks[0], gate, "measured" if several else "the only candidates", ms, errors, rejected
    )


def _fastest(timed: dict[str, tuple[float, float]]) -> str | None:
    """The candidate to run of ``timed`` (name -> (ms, relative error)): among those within ``TIE``
    of the fastest, the most exact (timings closer than that are noise; the most exact one is then
    the same in every build); None when there is none."""
    if not timed:
        return None
    least = min(t for t, _ in timed.values())
    return min((n for n, (t, _) in timed.items() if t <= least * (1 + TIE)), key=lambda n: timed[n][1])


def in_background(
    plan: Any, model: torch.nn.Module, shapes: ShapeRange, example: dict[str, torch.Tensor]
) -> _Choosing:
    """``choose`` in a thread on a stream of its own (the export runs meanwhile); ``result()`` joins."""
    return _Choosing(plan, model, shapes, example)


class _Choosing:
    def __init__(self, plan, model, shapes, example):
        self.plan, self.shapes = plan, shapes
        self.choice: KernelChoice | None = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")

        def run() -> None:
            t0 = time.perf_counter()
            try:
                if device.type != "cuda":
                    self.choice = choose(plan, model, shapes, example)
                    return
                with torch.cuda.device(device), torch.no_grad():
                    stream = torch.cuda.Stream(device)
                    with torch.cuda.stream(stream):
                        self.choice = choose(plan, model, shapes, example)
                    stream.synchronize()
            except BaseException as e:  # noqa: BLE001 (reported by result())
                self.error = e
            finally:
                self.seconds = time.perf_counter() - t0

        self.thread = threading.Thread(target=run, name="prx-kernel-choice", daemon=True)
        self.thread.start()

    def result(self) -> KernelChoice:
        self.thread.join()
        if self.choice is None:
            logger.warning("measuring the kernels failed (%s): the first candidates run.", self.error)
            return unmeasured(self.plan, self.shapes, f"not measured ({type(self.error).__name__})")
        return self.choice


# -- the candidates, as the step runs them --------------------------------------------------------
class _Bench:
    """Inputs at the step's shape and one callable per candidate."""

    def __init__(self, plan: Any, model, example, device, dtype):
        spec = plan.spec
        self.plan, self.dtype, self.device = plan, dtype, device
        self.heads, self.head_dim = spec.attention_dims(model)
        self.b, self.seq, self.t = spec.step_tokens(model, example)
        self.gate_width = spec.gate_width(model)
        self.width = self.heads * self.head_dim
        self.g = torch.Generator(device=device).manual_seed(0)
        self.dense = spec.attention == "dense"
        self.inputs: dict[str, tuple] = {}

    def rand(self, *shape, dtype=None, std=1.0):
        return torch.randn(*shape, generator=self.g, device=self.device, dtype=dtype or self.dtype) * std

    def candidate(self, group: str, name: str):
        """(run, error bound) of one candidate."""
        if group == "gelu_gate":
            return self._gate(name == "fused"), MAX_ERROR["bf16"]
        if self.dense:
            q, k, v = self._dense_inputs()
            return (lambda: self.attention(q, k, v, self.head_dim**-0.5, name)), MAX_ERROR["bf16"]
        fp8 = int(name.split("/", 1)[1]) if name.startswith("fp8/") else None
        padded = name if name in ("flash4", "cudnn") else None
        args = self._joint_inputs()
        return (lambda: self._prx(*args, fp8, padded)), MAX_ERROR["fp8" if fp8 is not None else "bf16"]

    def reference(self, group: str) -> torch.Tensor:
        """The group's op on batch row 0 (the gate: one row's tokens) in fp32 PyTorch ops."""
        if group == "gelu_gate":
            x, w, up = self._gate_inputs()
            rows = slice(0, max(1, x.shape[0] // self.b))
            return F.gelu(F.linear(x[rows].float(), w.float()), approximate="tanh") * up[rows].float()
        if self.dense:
            q, k, v = (x[:1].float() for x in self._dense_inputs())
            return self.attention(q, k, v, self.head_dim**-0.5, "sdpa")
        img_qkv, txt_kv, mask, rope, *ws = self._joint_inputs()
        return self._prx(
            img_qkv[:1].float(), txt_kv[:1].float(), mask[:1], rope[:1], *(w.float() for w in ws)
        )

    def _prx(self, img_qkv, txt_kv, mask, rope, qw, kw, tw, fp8=None, padded=None):
        from .library import _prx_attention

        h, scale = self.heads, self.head_dim**-0.5
        return _prx_attention(img_qkv, txt_kv, mask, rope, qw, kw, tw, h, 1e-6, scale, fp8, padded)

    @staticmethod
    def attention(q, k, v, scale, kernel):
        from .library import attention

        return attention(q, k, v, scale, kernel)

    def _joint_inputs(self):
        """PRX's attention inputs: (img_qkv, txt_kv, text mask, RoPE rotations, three norm weights)."""
        if "joint" not in self.inputs:
            b, seq, t, h, d = self.b, self.seq, self.t, self.heads, self.head_dim
            mask = torch.zeros(b, t, dtype=torch.bool, device=self.device)
            mask[:, : max(1, t // 4)] = True  # a short prompt in a padded text: the pipelines' case
            angle = torch.rand(b, 1, seq, d // 2, generator=self.g, device=self.device) * (2 * math.pi)
            cos, sin = angle.cos(), angle.sin()
            rope = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
            w = 1 + 0.1 * self.rand(d)
            self.inputs["joint"] = (
                self.rand(b, seq, 3 * h * d),
                self.rand(b, t, 2 * h * d),
                mask,
                rope,
                w,
                w,
                w,
            )
        return self.inputs["joint"]

    def _dense_inputs(self):
        """FLUX's: q, k, v (B, image + text tokens, H, D)."""
        if "dense" not in self.inputs:
            n = self.seq + self.t
            self.inputs["dense"] = tuple(self.rand(self.b, n, self.heads, self.head_dim) for _ in range(3))
        return self.inputs["dense"]

    def _gate_inputs(self):
        """x (B*L, width), the gate's weight (N, width), up (B*L, N)."""
        if "gate" not in self.inputs:
            tokens, n, k = self.b * self.seq, self.gate_width, self.width
            self.inputs["gate"] = (self.rand(tokens, k), self.rand(n, k, std=k**-0.5), self.rand(tokens, n))
        return self.inputs["gate"]

    def _gate(self, fused: bool):
        from .library import gelu_gate

        x, w, up = self._gate_inputs()
        if fused:
            return lambda: gelu_gate(x, w, up)
        return lambda: F.gelu(F.linear(x, w), approximate="tanh") * up

    def warm_gemm(self) -> None:
        """One (B*L, width) x (width, width) GEMM: cuBLAS's set-up, off the first step."""
        x = self.rand(self.b * self.seq, self.width)
        F.linear(x, self.rand(self.width, self.width, std=self.width**-0.5))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``out``'s leading rows (as many as ``ref`` has) against ``ref``."""
    got = out[: ref.shape[0]].float()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _time(fn) -> float:
    """ms per call of ``fn``: a CUDA graph of ``REPEATS`` calls, replayed ``ROUNDS`` times, the least
    mean (eager calls where the candidate cannot be captured). Run on a side stream (``in_background``
    gives one): a capture on the default stream fails, and is timed eagerly."""
    stream = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(REPEATS):
                fn()
        run = graph.replay
    except RuntimeError as e:
        logger.debug("timing without a CUDA graph: %s", e)
        graph = None

        def run():
            for _ in range(REPEATS):
                fn()

    run()
    best = math.inf
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / REPEATS)
    del graph
    return best
