"""Kernels chosen by measurement, per engine set.

    choice = choose(plan, model, shapes, example)   # the candidates, run and timed at the set's shape
    plan.lowering(shapes, choice)                   # the rules emit what it chose
    Measurement(plan, model, shapes, example)       # the same in two parts, around a TensorRT build

``plan`` is a ``prx_compile.plan.Plan`` (not imported here: the plan imports the ops).

The candidates are what the config allows and this machine has (``Plan.attention_candidates``,
``Plan.gate_candidates``): PRX's joint attention on FlashAttention-4, on cuDNN, as the split path, or
(``precision: fp8``) on our FP8 kernels in each tiling of ``ops.fp8_attention.TILES`` or on cuDNN's
FP8 SDPA ("cudnn_fp8"); FLUX's dense attention on FlashAttention-4, cuDNN or PyTorch's SDPA; the MLP
gate as one cuDNN GEMM with GELU * up in its epilogue, or not. A user's explicit choice is the only
candidate. Each candidate runs once at the set's own tuning point (JIT compilation and cuDNN plans
happen here, not in the first step: this is also the step's warm-up), its output is held to an fp32
reference of the same op (relative error: ``MAX_ERROR``), then it is timed as a CUDA graph of
``REPEATS`` calls replayed ``ROUNDS`` times (the least mean kept: launch overhead and a busy Python
thread do not count). Beside a TensorRT build the
candidates only run and are checked; they are timed after the build, alone on the GPU (timed beside
it, FlashAttention-4 measured 0.88 ms instead of 0.48 at 832x1216 and lost to cuDNN:
``benchmarks/results/peers_v20_prx_bf16_h200.json``). The fastest candidate within
its bound wins; candidates within ``TIE`` of the fastest count as equally fast, and the most exact of
them runs (no size rule decides). The candidates that compile a kernel at their first call run once
side by side first (``compiles``), so their compilations overlap. A candidate that fails to run
is recorded with the reason and left out.

No CUDA (a CPU build), nothing is measured: the first candidate is taken, and the choice says so.
The choice is kept with the engine set (``report()``, the artifact, the engine cache): a loaded
TensorRT set does not measure again; ``rebuild=True`` does (as does a PyTorch backend's set, which
exports again after a load).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
NAMES = ("flash4", "cudnn", "split", "sdpa", "cudnn_fp8")


def compiles(name: str) -> bool:
    """Whether a candidate's first call compiles a kernel (Triton, CuTe DSL): ``Measurement`` runs
    these once side by side before checking them one by one. Triton's compilations leave the GIL to
    each other: our four FP8 tilings at the 7B shape compiled in 7.9 s in threads, against 16.8 s one
    after another (``benchmarks/results/compile_time_v22_h200.json``)."""
    return name.startswith("fp8/") or name in ("flash4", "cudnn_fp8")


_NAME = schema.Str(40)
_CHOICE = schema.Dict(
    {
        "attention": _NAME,
        "gelu_gate": schema.Bool(),
        "how": schema.Str(80),
        "ms": schema.Map(_NAME, schema.Float(0.0, 1e6), max_len=32),
        "error": schema.Map(_NAME, schema.Float(0.0, 1e6), max_len=32),
        "rejected": schema.Map(_NAME, schema.Str(300), max_len=32),
        "seconds": schema.Map(_NAME, schema.Float(0.0, 1e6), max_len=32),
    },
    optional=("seconds",),  # 0.18's records have none
)


@dataclass(frozen=True)
class KernelChoice:
    """What one engine set runs, and why.

    attention: the attention candidate it runs ("flash4", "cudnn", "split", "fp8/<tile>", "cudnn_fp8"; dense:
        "flash4", "cudnn", "sdpa"). gelu_gate: whether the MLP gate is one cuDNN GEMM.
    how: "measured", "the only candidates" (nothing to choose) or "not measured (no CUDA)".
    ms: candidate -> ms per call at the set's tuning point ("attention/<name>", "gelu_gate/fused",
        "gelu_gate/unfused"). error: candidate -> relative error against fp32. rejected: candidate ->
        why it was left out (its error, or what it raised). seconds: candidate -> wall seconds its
        measurement took (its JIT compilation or cuDNN plan, the check and the timing; "<group>/reference":
        the fp32 reference's).
    """

    attention: str
    gelu_gate: bool
    how: str
    ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "attention": self.attention,
            "gelu_gate": self.gelu_gate,
            "how": self.how,
            "ms": {k: round(v, 4) for k, v in self.ms.items()},
            "error": {k: float(f"{v:.3g}") for k, v in self.error.items()},
            "rejected": dict(self.rejected),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
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
        return cls(
            d["attention"], d["gelu_gate"], d["how"], d["ms"], d["error"], d["rejected"], d.get("seconds", {})
        )

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
    Without CUDA and without a timer, the first candidates (nothing measured). ``Measurement`` does
    the same in two parts, around a TensorRT build."""
    measurement = Measurement(plan, model, shapes, example, timer)
    measurement.gate()
    measurement.start_attention(background=False)
    return measurement.result()


class Measurement:
    """One engine set's measurement, in the two parts a TensorRT build needs apart:

        m = Measurement(plan, model, shapes, example)
        fused = m.gate()        # the MLP gate's form: the engines' lowering depends on it
        ... export and decompose (nothing else runs meanwhile) ...
        m.start_attention()     # in a thread, on a stream of its own, while the engines build:
                                # each candidate compiled, run and checked
        choice = m.result()     # joins, then times the attention candidates alone; the attention
                                # only picks which op a kept call runs

    Nothing is measured beside torch.export or a decomposition (they change process-wide dispatch
    state for a while: 0.19's FLUX builds, measuring beside the export, saw FlashAttention-4 and cuDNN
    fail there with errors they never raise alone). A candidate that raised while the engines built
    is measured once more after them, alone, before it is left out. Each part runs on a side
    stream: a CUDA graph capture on the default stream fails."""

    def __init__(self, plan, model, shapes, example, timer=None):
        self.plan, self.shapes = plan, shapes
        self.attention_names = list(plan.attention_candidates)
        self.gate_names = ["fused" if g else "unfused" for g in plan.gate_candidates(shapes)]
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.measured = param is not None and (self.device.type == "cuda" or timer is not None)
        self.timer = timer or (lambda key, run: _time(run))
        self.bench = _Bench(plan, model, example, self.device, param.dtype) if self.measured else None
        self.ms: dict[str, float] = {}
        self.errors: dict[str, float] = {}
        self.rejected: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.raised: set[str] = set()  # candidates rejected for what they raised
        self.untimed: dict[str, Callable[[], Any]] = {}  # checked beside a build, timed in result()
        self.fused_gate: bool | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        #: wall seconds the measurement took (both parts)
        self.wall_s = 0.0

    @property
    def gate_to_measure(self) -> bool:
        """Whether ``gate()`` measures anything (a gate that may be fused, and CUDA or a timer)."""
        return self.measured and self.gate_names != ["unfused"]

    def gate(self) -> bool:
        """Measure the MLP gate's forms (where there is a choice); whether it runs fused."""
        if self.fused_gate is None:
            pick = self.gate_names[0]
            if self.gate_to_measure:
                self._part(lambda: self._group("gelu_gate", self.gate_names))
                if self.error is None:
                    pick = self._pick("gelu_gate", self.gate_names)
            self.fused_gate = pick == "fused"
        return self.fused_gate

    def start_attention(self, background: bool = True) -> None:
        """Measure the attention candidates, in a thread (``background``) or here."""

        def run() -> None:
            if self.measured and self.error is None:
                self._part(lambda: self._group("attention", self.attention_names, timed=not background))

        if background:
            self.thread = threading.Thread(target=run, name="prx-kernel-choice", daemon=True)
            self.thread.start()
        else:
            run()

    def join(self) -> bool:
        """Wait for the attention's thread, if one runs; whether one ran."""
        if self.thread is None:
            return False
        self.thread.join()
        self.thread = None
        return True

    def result(self) -> KernelChoice:
        """The choice (``gate()`` and ``start_attention()`` first); a one-line warning where the
        measurement itself failed (the first candidates then run)."""
        if self.join():
            retry = [k.split("/", 1)[1] for k in sorted(self.raised) if k.startswith("attention/")]
            if retry and self.error is None:  # alone now: what raised beside the build, once more
                logger.info("measuring again, alone: %s", retry)
                self._part(lambda: self._group("attention", retry))
            if self.untimed and self.error is None:  # the GPU to themselves now: timed
                self._part(self._time_untimed)
        gate = self.gate()
        if not self.measured:
            first = unmeasured(self.plan, self.shapes, "not measured (no CUDA)")
            return dataclasses.replace(first, gelu_gate=gate)
        if self.error is not None:
            logger.warning("measuring the kernels failed (%s): the first candidates run.", self.error)
            first = unmeasured(self.plan, self.shapes, f"not measured ({type(self.error).__name__})")
            return dataclasses.replace(first, gelu_gate=gate)
        several = len(self.attention_names) > 1 or len(self.gate_names) > 1
        return KernelChoice(
            self._pick("attention", self.attention_names),
            gate,
            "measured" if several else "the only candidates",
            self.ms,
            self.errors,
            self.rejected,
            self.seconds,
        )

    # -- the parts ---------------------------------------------------------------------------------
    def _on_side_stream(self, fn: Callable[[], Any]) -> None:
        """``fn()`` on a new stream of the device, waited for (CUDA); on a CPU, ``fn()`` as it is."""
        if self.device.type != "cuda":
            fn()
            return
        with torch.cuda.device(self.device), torch.no_grad():
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()

    def _part(self, fn: Callable[[], None]) -> None:
        """``fn()`` on a side stream (CUDA), timed into ``wall_s``; what it raises is kept in
        ``error`` (reported by ``result()``)."""
        t0 = time.perf_counter()
        try:
            self._on_side_stream(fn)
        except Exception as e:  # noqa: BLE001 (reported by result())
            self.error = e
        finally:
            self.wall_s += time.perf_counter() - t0

    def _group(self, group: str, names: list[str], timed: bool = True) -> None:
        """Check each of ``names`` against the group's fp32 reference, then time the ones within their
        bound (into ``ms``, ``errors``, ``rejected``, ``seconds``: keys "<group>/<name>"); with
        ``timed=False`` they wait in ``untimed`` for ``_time_untimed``."""
        self._warm_up(group, [n for n in names if compiles(n)])
        t0 = time.perf_counter()
        ref = self.bench.reference(group)
        key = f"{group}/reference"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
        for name in names:
            key = f"{group}/{name}"
            self.rejected.pop(key, None)
            self.raised.discard(key)
            t0 = time.perf_counter()
            try:
                fn, bound = self.bench.candidate(group, name)
                err = _rel_err(fn(), ref)
                self.errors[key] = err
                if not math.isfinite(err) or err > bound:
                    self.rejected[key] = f"relative error {err:.3g} over its bound {bound:g}"
                    continue
                self.untimed[key] = fn
            except Exception as e:  # a kernel that cannot run here is left out, with the reason
                self.rejected[key] = f"{type(e).__name__}: {str(e)[:200]}"
                self.raised.add(key)
                logger.info("kernel candidate %s left out: %s", key, self.rejected[key])
            finally:
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
        del ref
        if timed:
            self._time_untimed([f"{group}/{name}" for name in names])
        if group == "attention" and self.device.type == "cuda":
            self.bench.warm_gemm()

    def _warm_up(self, group: str, names: list[str]) -> None:
        """Run each of ``names`` once, all at once in threads, each on a stream of its own: their JIT
        compilations overlap instead of queueing. The candidates and their inputs are made here
        first, in this thread. The wall seconds add to ``seconds["<group>/warm-up"]``; what a
        candidate raises here is left to its check, which runs it again."""
        if len(names) < 2:
            return
        t0 = time.perf_counter()
        fns = []
        for name in names:
            try:
                fns.append((name, self.bench.candidate(group, name)[0]))
            except Exception as e:  # noqa: BLE001 (its check makes it again and records the reason)
                logger.debug("warm-up of %s/%s not made: %s", group, name, e)

        def run(item: tuple[str, Callable[[], Any]]) -> None:
            name, fn = item
            try:
                self._on_side_stream(fn)
            except Exception as e:  # noqa: BLE001 (its check runs it again and records the reason)
                logger.debug("warm-up of %s/%s raised: %s", group, name, e)

        with ThreadPoolExecutor(len(fns) or 1, thread_name_prefix="prx-kernel-warm-up") as pool:
            list(pool.map(run, fns))
        key = f"{group}/warm-up"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def _time_untimed(self, keys: list[str] | None = None) -> None:
        """Time the candidates ``_group`` checked and left in ``untimed`` (those of ``keys``; None:
        all)."""
        for key in [k for k in (self.untimed if keys is None else keys) if k in self.untimed]:
            fn = self.untimed.pop(key)
            t0 = time.perf_counter()
            try:
                self.ms[key] = self.timer(key, fn)
            except Exception as e:  # ran in its check, then failed when timed: left out, with the reason
                self.raised.add(key)
                self.rejected[key] = f"{type(e).__name__}: {str(e)[:200]}"
                logger.info("kernel candidate %s left out: %s", key, self.rejected[key])
            finally:
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def _pick(self, group: str, names: list[str]) -> str:
        """The candidate of ``names`` to run: the fastest within its bound, or the first (warned)."""
        timed = {n: (self.ms[k], self.errors[k]) for n in names if (k := f"{group}/{n}") in self.ms}
        best = _fastest(timed)
        if best is None:  # not silent: the step runs a candidate that failed here
            logger.warning(
                "every %s candidate failed its measurement (%s): %s runs unmeasured.",
                group,
                "; ".join(f"{k}: {v}" for k, v in self.rejected.items() if k.startswith(group)),
                names[0],
            )
        return best if best is not None else names[0]


def _fastest(timed: dict[str, tuple[float, float]]) -> str | None:
    """The candidate to run of ``timed`` (name -> (ms, relative error)): among those within ``TIE``
    of the fastest, the most exact (timings closer than that are noise; the most exact one is then
    the same in every build); None when there is none."""
    if not timed:
        return None
    least = min(t for t, _ in timed.values())
    return min((n for n, (t, _) in timed.items() if t <= least * (1 + TIE)), key=lambda n: timed[n][1])


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
        padded = name if name in ("flash4", "cudnn", "cudnn_fp8") else None
        args = self._joint_inputs()
        bound = MAX_ERROR["fp8" if fp8 is not None or name == "cudnn_fp8" else "bf16"]
        return (lambda: self._prx(*args, fp8, padded)), bound

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
    mean (eager calls where the candidate cannot be captured). Run on a side stream (``Measurement``'s
    parts are): a capture on the default stream fails, and is timed eagerly."""
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
