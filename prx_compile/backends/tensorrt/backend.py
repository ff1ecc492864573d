"""Torch-TensorRT backend: the exported, lowered step compiled into TensorRT engines.

    export_step (one block per list traced; lower, then Torch-TensorRT's decompositions, on it; copied
    for the others)
        -> torch_tensorrt.dynamo.compile (its own decompositions skipped: done) -> Program

``torch_tensorrt.dynamo.compile`` is the compiler inside Torch-TensorRT's MutableTorchTensorRTModule;
compile_prx calls it on its own export, so the model is exported once, and keeps the result as a
``Program`` (``program``, beside this module) that runs, saves, loads and refits the same way.

Weights, by ``config.weights``:

* ``"inputs"`` (default): the parameters are engine inputs. The engines read the transformer's own
  tensors at every call, so one copy of the weights exists, a LoRA is an in-place update, CUDA graphs
  stay valid and nothing is refit. Engines are small, and their cache key leaves the weights out.
  Partitions that compute the same thing (the blocks) share one engine (``share_engines``,
  ``repeats.SharedEngines``): built once, one execution context, called once per block.
* ``"engine"``: weights are baked into each engine (TensorRT may fold and re-layout them). After a
  LoRA, only the engine weights derived from changed parameters are refit (``trt.Refitter``); which
  engine weight comes from which parameter is recorded at build time by a post-lowering pass that
  matches every graph constant to a parameter by value (constant folding turns ``W`` into ``W.T``).

Torch-TensorRT hooks (``lowering.ENGINE_RULES``, that provenance pass, and ``shim.building``: the
per-partition converter and cheap example tensors) are active only while ``build`` runs. Settings
correctness depends on are required (``shim.compile_settings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ... import progress, schema
from ...errors import ArtifactError, LoRAError, PRXCompileError, one_line
from ...export import export_step, weight_tensors
from ...lowering import ENGINE_RULES, lower, lower_kernels
from ...ops import choice
from ...ops.choice import KernelChoice, unmeasured
from ..base import Backend, BackendState, SetReport
from . import engine, shim
from .program import Program, from_graph_module
from .repeats import SharedEngines

logger = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9_]{1,100}")
_STEP_PREFIX = "model."  # export.Step holds the transformer as ``model`` (weights="engine")


class TensorRTBackend(Backend):
    kind = "tensorrt"

    def __init__(self, model, config, shapes):
        super().__init__(model, config, shapes)
        engine.bindings()  # BackendUnavailableError with an install hint (build() needs Torch-TensorRT too)
        self.program: Program | None = None
        self.engines: dict[str, engine.Engine] = {}
        self.constants: dict[str, torch.Tensor] = {}
        #: graph constant name -> (parameter FQN, "id" | "t"), weights="engine" only
        self.provenance: dict[str, tuple[str, str]] = {}
        self.refits = 0
        self._slots: list[tuple[str, torch.nn.Module, str]] = []
        self._pending: _Pending | None = None  # engines read from an artifact, not deserialised yet
        self._load_lock = threading.Lock()
        #: the execution contexts' device memory, one block for the set (``share_context_memory``)
        self.arena: engine.DeviceArena | None = None

    # -- build ----------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """``torch_tensorrt.dynamo.compile`` keyword arguments."""
        cfg = self.config
        required = {
            "attn_bias_is_causal": False,  # Torch-TRT 2.11 would otherwise make masked attention causal
            "truncate_double": True,  # RoPE's float64 frequency table (TensorRT has no float64)
            "use_python_runtime": True,  # live engines: partial refit, runtime cache
            "immutable_weights": cfg.weights == "inputs",  # "engine": refittable
            "device": _cuda_device(cfg.device),
        }
        kept = self.plan.kept_ops(self.shapes)  # ops.registry: attention, FP8 GEMMs, cuBLAS linears
        if kept:
            required["torch_executed_ops"] = kept
        linears_in_torch = self.plan.linears_in_torch(self.shapes)
        optional: dict[str, Any] = {"decompose_attention": False, "use_explicit_typing": True}
        if cfg.precision == "fp8" or linears_in_torch:
            optional["min_block_size"] = 1  # the few ops between two GEMM ops (GELU * up, a residual)
        if cfg.optimization_level is not None:
            optional["optimization_level"] = cfg.optimization_level
        return shim.compile_settings(required, optional)

    def _engine_passes(self) -> list:
        """Our post-lowering passes for one compile (``shim.lowering_passes`` registers them)."""
        passes = list(ENGINE_RULES.values())
        if self.config.weights == "engine":
            passes.append(self._record_provenance)
        return passes

    def build(self, example: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        cfg, ttrt = self.config, shim.torch_tensorrt()
        times = self.timings = {}
        # the kernel candidates run and are timed at the set's shape (the kernels kept in PyTorch are
        # compiled and warm before the first step): the MLP gate before the export, as the engines'
        # lowering depends on it; the attention while the engines build, as it only picks which op a
        # kept call runs (applied to the partitioned module after the build). Nothing is measured
        # beside the export or a decomposition (``choice.Measurement``).
        measurement = choice.Measurement(self.plan, self.model, self.shapes, example)
        if measurement.gate_to_measure:  # kernels_s: the gate's measurement, where there is one
            with progress.stage("MLP gate measured at the set's shape", times, "kernels_s"):
                measurement.gate()
        gate = measurement.gate()
        first = unmeasured(self.plan, self.shapes, "the engines' lowering")
        lowering = self.plan.lowering(self.shapes, dataclasses.replace(first, gelu_gate=gate))
        settings = self.settings()

        def prepare(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
            """Our rules, then Torch-TensorRT's decompositions: on one block, before it is copied."""
            with progress.stage("lower (prx_compile rules)", times, "lower_s"):
                lower(ep.graph_module, lowering, kernels=False)
            with progress.stage("decompose (Torch-TensorRT's table)", times, "decompose_s"):
                return ep.run_decompositions(shim.decompositions(settings))

        t_export = time.perf_counter()
        with progress.stage(f"export ({self.shapes.describe()}), lowering and decomposition included"):
            ep, names = export_step(
                self.model,
                example,
                self.shapes,
                weights=cfg.weights,
                fuse_attention=cfg.attention == "fused",
                prepare=prepare,
            )
        times["export_s"] = time.perf_counter() - t_export - times["lower_s"] - times["decompose_s"]
        # weights as inputs: identical partitions (the blocks) are one engine, built once; distinct
        # ones are converted build_workers at a time
        workers = min(cfg.build_workers, os.cpu_count() or 1)
        sharing = SharedEngines(workers) if cfg.weights == "inputs" and cfg.share_engines else None
        self.arena = self._new_arena()

        def converter(convert):  # each engine built as an engine.Engine, shared where it can be
            convert = shim.as_engines(convert, self.arena)
            return sharing.wrap(convert) if sharing is not None else convert

        with (
            progress.stage("build TensorRT engines", times, "compile_s"),
            shim.lowering_passes(self._engine_passes()),
            shim.building(converter, release_memory=cfg.weights == "engine"),
            sharing if sharing is not None else contextlib.nullcontext(),
            shim.decomposed(ep),  # by ``prepare``
            torch.no_grad(),
        ):
            kwarg_inputs: dict[str, Any] = {k: example[k] for k in self.spec.inputs(self.model)}
            if names is not None:  # shapes only (Input.from_tensor would hold every weight)
                params = weight_tensors(self.model)
                kwarg_inputs["weights"] = [
                    ttrt.Input(shape=tuple(params[n].shape), dtype=params[n].dtype) for n in names
                ]
            measurement.start_attention()
            try:
                gm = ttrt.dynamo.compile(ep, arg_inputs=(), kwarg_inputs=kwarg_inputs, **settings)
                if sharing is not None:
                    sharing.finish(gm)  # the engines still converting in threads
            except BaseException:
                measurement.join()  # nothing left measuring after a failed build
                raise
        with progress.stage("attention kernels measured at the set's shape", times, "kernels_wait_s"):
            self.kernels = measurement.result()
        times["kernels_measure_s"] = measurement.wall_s
        progress.note(f"kernels for {self.shapes.describe()}: {self.kernels.describe()}")
        logger.info("kernels for %s: %s", self.shapes.describe(), self.kernels.describe())
        lower_kernels(gm, self.plan.lowering(self.shapes, self.kernels))
        self.program, self.engines, self.constants = program_of(
            gm, (engine.Engine,), names, weight_tensors(self.model), self.spec.inputs(self.model)
        )
        if sharing is not None:
            times["engines_build_s"] = sum(sharing.seconds.values())
            times["engines_wall_s"] = sharing.wall_s
            times["engines_longest_s"] = max(sharing.seconds.values(), default=0.0)
            self.engine_build_s = {  # partition -> [seconds, ops, commonest ops], slowest first
                n: [round(s, 3), sum(sharing.ops[n].values()), dict(sharing.ops[n].most_common(6))]
                for n, s in sorted(sharing.seconds.items(), key=lambda kv: -kv[1])
            }
        if self.arena is not None:
            self.arena.allocate()
        self._bind()
        torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0

    # -- the step -------------------------------------------------------------------------------
    def _bind(self) -> None:
        """Where each parameter the program reads lives (module, attribute): read live per call."""
        modules = dict(self.model.named_modules())
        self._slots = []
        for fqn in sorted(self.program.refs("w:")):
            mod, _, attr = fqn.rpartition(".")
            self._slots.append((fqn, modules[mod], attr))

    def rebind(self) -> bool:
        if self.config.weights == "engine":  # the engines hold the old modules' weights
            return False
        self._bind()
        return True

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        self.load()
        params = {fqn: getattr(m, a) for fqn, m, a in self._slots}
        out = self.program.run(inputs, params, self.engines, self.constants)
        return out[0] if isinstance(out, (list, tuple)) else out

    # -- reports --------------------------------------------------------------------------------
    def report(self) -> SetReport:
        pending = self._pending  # read once: a load in another thread may finish meanwhile
        sizes = [len(pending.blobs[f"{n}.engine"]) for n in pending.records] if pending else []
        sizes += [len(m.serialized_engine) for m in self.engines.values()]
        return SetReport(
            engines=len(sizes),
            engine_calls=sum(st.op == "engine" for st in self.program.steps),
            torch_segments=self.program.segments,
            torch_ops=self.program.torch_ops(),
            context_mb=sum(engine.context_memory_bytes(m) for m in self.engines.values()) / 2**20,
            arena_mb=self.arena.nbytes / 2**20 if self.arena is not None else 0.0,
            engine_mb=sum(sizes) / 2**20,
        )

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, **shim.versions()}

    # -- state ----------------------------------------------------------------------------------
    def state(self) -> BackendState:
        pending = self._pending  # read from an artifact and not run yet: the bytes as they were read
        blobs = dict(pending.blobs) if pending else {}
        records = dict(pending.records) if pending else {}
        records.update({n: m.record for n, m in self.engines.items()})
        for name, module in self.engines.items():
            blobs[f"{name}.engine"] = engine.engine_bytes(module, self.needs_refit)
            cache = module.runtime_cache_bytes()
            if cache:
                blobs[f"{name}.rtcache"] = cache
        meta = {
            "kind": self.kind,
            "weights": self.config.weights,
            "program": self.program.to_json(),
            "kernels": self.kernels.to_json(),
            "engines": records,
            "provenance": {k: list(v) for k, v in sorted(self.provenance.items())},
        }
        return BackendState(meta, blobs, dict(self.constants))

    @classmethod
    def from_state(cls, model, plan, shapes, state: BackendState) -> TensorRTBackend:
        meta = schema.check(_STATE, state.meta, "tensorrt backend state")
        if meta["kind"] != cls.kind:
            raise ValueError(f"a backend state of kind {meta['kind']!r} is not a {cls.kind!r} one")
        config = plan.config
        if meta["weights"] != config.weights:
            raise ValueError(f"weights={meta['weights']!r} does not match the config's {config.weights!r}")
        records = meta["engines"]
        tensors = weight_tensors(model)
        params = set(tensors)
        provenance = _check_provenance(meta["provenance"], {n: t.dim() for n, t in tensors.items()})
        program = Program.from_json(
            meta["program"],
            engines=set(records),
            params=params,
            constants=set(state.tensors),
            inputs=plan.spec.inputs(model),
        )
        extra = set(state.blobs) - {f"{n}.{s}" for n in records for s in ("engine", "rtcache")}
        if extra:
            raise ValueError(f"unexpected files {sorted(extra)[:3]}")
        backend = cls(model, plan, shapes)
        backend.kernels = KernelChoice.from_json(meta["kernels"])
        device = _cuda_device(config.device)
        for name in records:
            if f"{name}.engine" not in state.blobs:
                raise ValueError(f"engine {name!r} has no .engine file")
        backend._pending = _Pending(records, state.blobs, device)  # deserialised at first use
        backend.program = program
        backend.constants = {k: v.to(device) for k, v in state.tensors.items()}
        backend.provenance = provenance
        backend._bind()
        backend.build_s = 0.0
        return backend

    @property
    def is_loaded(self) -> bool:
        """False while the engines ``from_state`` read are still bytes (until ``load``)."""
        return self._pending is None

    def load(self) -> None:
        """Deserialise the engines ``from_state`` read (no-op when they are live). A set loaded from an
        artifact loads at its first call, so a process pays only for the sets it runs;
        ``CompiledTransformer.build()`` loads them all ahead."""
        if self._pending is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise PRXCompileError(
                f"the engines of {self.shapes.describe()} are not loaded yet, and TensorRT cannot load "
                "them during a CUDA graph capture.",
                "call .build() on the compiled module before capturing.",
            )
        with self._load_lock:  # two first calls at once load the set once
            if self._pending is not None:
                self._load(self._pending)

    def _load(self, pending: _Pending) -> None:
        t0 = time.perf_counter()

        def load(name: str) -> torch.nn.Module:
            with torch.cuda.device(pending.device):  # the current device is per thread
                try:
                    return engine.Engine(
                        pending.blobs[f"{name}.engine"],
                        pending.records[name],
                        name,
                        pending.device,
                        runtime_cache=pending.blobs.get(f"{name}.rtcache"),
                        arena=self.arena,
                    )
                except Exception as e:  # TensorRT's own errors on bytes it cannot read
                    raise ArtifactError(
                        f"TensorRT cannot load engine {name!r} of the set {self.shapes.describe()}: "
                        f"{type(e).__name__}: {one_line(e)}",
                        "load the artifact with rebuild=True (another GPU or TensorRT version).",
                    ) from e

        # engines load side by side (TensorRT-RTX runs much of it one at a time: measured no faster)
        self.arena = self._new_arena()
        with progress.stage(f"load engines ({self.shapes.describe()})"):
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                self.engines = dict(zip(pending.records, pool.map(load, pending.records), strict=True))
        if self.arena is not None:
            self.arena.allocate()
        self._pending = None
        self.timings["load_s"] = time.perf_counter() - t0
        logger.info(
            "loaded %d engines in %.2f s: %s",
            len(self.engines),
            time.perf_counter() - t0,
            self.shapes.describe(),
        )

    def _new_arena(self) -> engine.DeviceArena | None:
        """One block of context memory for this set's engines (None: each context keeps its own)."""
        if not self.config.share_context_memory:
            return None
        return engine.DeviceArena(_cuda_device(self.config.device))

    # -- refit (weights="engine") ---------------------------------------------------------------
    @property
    def needs_refit(self) -> bool:
        return self.config.weights == "engine"

    def _record_provenance(self, gm: torch.fx.GraphModule, settings: Any) -> torch.fx.GraphModule:
        """Post-lowering pass: trace every graph constant back to a model parameter by value."""
        tensors = dict(gm.named_parameters(remove_duplicate=False))
        tensors.update(gm.named_buffers(remove_duplicate=False))
        originals = {n: t for n, t in tensors.items() if n.startswith(_STEP_PREFIX)}
        by_numel: dict[int, list[str]] = {}
        for n, t in originals.items():
            by_numel.setdefault(t.numel(), []).append(n)
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target not in tensors:
                continue
            name = node.target
            if name in originals:
                self.provenance[name] = (name[len(_STEP_PREFIX) :], "id")
                continue
            match = _match_constant(tensors[name], originals, by_numel.get(tensors[name].numel(), []))
            if match is not None:
                self.provenance[name] = (match[0][len(_STEP_PREFIX) :], match[1])
        return gm

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        if self.config.weights == "inputs":
            return {"refit_s": 0.0, "graphs_valid": True, "engines_refit": 0}
        self.load()
        t0 = time.perf_counter()
        changed = set(names)
        params = dict(self.model.named_parameters())
        plans = []
        covered: set[str] = set()
        for module in self.engines.values():
            updates = {}
            for ew, (key, wdtype) in module.weight_name_map.items():
                src = self.provenance.get(key)
                if src is None or src[0] not in changed:
                    continue
                fqn, transform = src
                w = params[fqn].detach()
                w = w.t() if transform == "t" else w
                updates[ew] = w.to("cuda", engine.torch_dtype_of(wdtype)).contiguous().reshape(-1)
                covered.add(fqn)
            if updates:
                plans.append((module, updates))
        untraced = sorted(changed - covered - self.program.refs("w:"))  # read live: nothing to refit
        if untraced:
            raise LoRAError(
                f"parameters {untraced[:3]} cannot be traced to engine weights, so they cannot be refit.",
                "compile with weights='inputs' (the default): engines then read the parameters directly.",
            )
        for module, updates in progress.items(plans, "refit engines"):
            try:
                engine.refit_weights(module, updates)
            except RuntimeError as e:  # a record read from disk that does not match the engines
                raise ArtifactError(
                    f"the engines' weights could not be refit ({one_line(e)}).",
                    "a module loaded from an artifact: load it with rebuild=True.",
                ) from e
        self.refits += 1
        return {
            "refit_s": time.perf_counter() - t0,
            "graphs_valid": False,
            "engine_weights": sum(len(u) for _, u in plans),
            "engines_refit": len(plans),
        }


def program_of(
    gm: torch.fx.GraphModule,
    engine_classes: tuple[type, ...],
    weight_names: list[str] | None,
    params: dict[str, torch.Tensor],
    inputs: tuple[str, ...],
) -> tuple[Program, dict[str, torch.nn.Module], dict[str, torch.Tensor]]:
    """(Program, engines by name, constants) of Torch-TensorRT's partitioned module.

    An engine module set as several partitions (``SharedEngines``) is one engine: it is kept under
    the first partition's name, and every step that calls it uses that name, so the Program, the
    saved state and the cache hold it once."""
    # gm._modules, not named_children(): that lists a module set under several names once
    children = {n: m for n, m in gm._modules.items() if isinstance(m, engine_classes)}
    first_name: dict[int, str] = {}
    canonical = {n: first_name.setdefault(id(m), n) for n, m in children.items()}
    program, constants = from_graph_module(
        gm, engines=set(children), weight_names=weight_names, params=params, inputs=inputs
    )
    program.steps = [
        dataclasses.replace(st, engine=canonical[st.engine]) if st.op == "engine" else st
        for st in program.steps
    ]
    return program, {n: children[n] for n in first_name.values()}, constants


@dataclasses.dataclass(frozen=True)
class _Pending:
    """An engine set read from an artifact, validated, not deserialised yet."""

    records: dict[str, dict[str, Any]]  # engine name -> engine_record
    blobs: dict[str, bytes]  # "<name>.engine", "<name>.rtcache"
    device: torch.device


def _cuda_device(name: str) -> torch.device:
    """``cuda`` with its index (Torch-TensorRT needs one)."""
    d = torch.device(name)
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


_PROVENANCE_ENTRY = schema.Tuple(schema.Str(299), schema.Str(2, choices=("id", "t")))


def _check_provenance(data: Any, dims: dict[str, int]) -> dict[str, tuple[str, str]]:
    """Engine constant name -> (the parameter it holds, "id" or "t" for transposed); ``dims``: the
    model's parameters (and buffers) by name -> their number of dimensions (only a matrix is
    transposed)."""
    schema.check(schema.Map(schema.Str(299), _PROVENANCE_ENTRY, max_len=100_000), data, "provenance")
    for k, (param, how) in data.items():
        if param not in dims:
            raise schema.SchemaError(f"provenance[{k[:80]!r}]", "a parameter of this model", param)
        if how == "t" and dims[param] != 2:
            raise schema.SchemaError(f"provenance[{k[:80]!r}]", "a matrix, to be transposed", param)
    return {k: (v[0], v[1]) for k, v in data.items()}


#: a saved backend state's record (the program and provenance are checked by their own readers)
_STATE = schema.Dict(
    {
        "kind": schema.Str(40),
        "weights": schema.Str(20),
        "program": schema.Later("Program.from_json"),
        "kernels": schema.Later("KernelChoice.from_json"),
        "engines": schema.Map(
            schema.Str(100, pattern=_NAME.pattern, what="an engine name ([A-Za-z0-9_])"),
            engine.ENGINE_RECORD,
            max_len=10_000,
        ),
        "provenance": schema.Map(schema.Str(299), _PROVENANCE_ENTRY, max_len=100_000),
    }
)


def _match_constant(
    value: torch.Tensor, originals: dict[str, torch.Tensor], candidates: list[str]
) -> tuple[str, str] | None:
    """(parameter, transform) whose value equals ``value`` exactly; None if none or ambiguous."""
    found = []
    for n in candidates:
        p = originals[n]
        if p.dtype != value.dtype or p.device != value.device:
            continue
        if p.shape == value.shape and torch.equal(p, value):
            found.append((n, "id"))
        elif p.dim() == 2 and value.shape == p.t().shape and torch.equal(p.t(), value):
            found.append((n, "t"))
    return found[0] if len(found) == 1 else None
