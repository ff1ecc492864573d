"""Torch-TensorRT backend: the transformer inside a ``MutableTorchTensorRTModule`` (MTTM).

MTTM exports the model (non-strict, with the configured dynamic ranges) and compiles it; our rules
run inside that compile as a Torch-TensorRT pre-lowering pass, so masked attention is never turned
causal and fold/unfold never split the engine. Settings that make PRX correct are always set:
``attn_bias_is_causal=False``; with ``attention="flash"`` the flash op is in ``torch_executed_ops``.

Refit: after a LoRA changes parameters in place, only the engine weights derived from them are
refit (``trt.Refitter`` on the live engines), with no re-export and no rebuild. Which engine weight
comes from which parameter is recorded at build time by a post-lowering pass that matches every
graph constant to a parameter by value (Torch-TensorRT's constant folding turns ``W`` into ``W.T``).
If a changed parameter cannot be traced to engine weights, the backend falls back to Torch-
TensorRT's full refit (slow, still no rebuild) and says so in the returned timings.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from .. import progress
from ..export import shape_generic_position_ids
from ..fusion import fused_attention_processors
from ..lowering.torch_tensorrt import lowering_passes, torch_executed_ops
from . import Backend, trt_shim

logger = logging.getLogger(__name__)


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, model, config, shapes):
        super().__init__(model, config, shapes)
        self.ttrt = trt_shim.torch_tensorrt()  # BackendUnavailableError with an install hint
        self.mttm = None
        self.loaded_gm: torch.fx.GraphModule | None = None  # set when loaded from an artifact
        self.input_order: list[str] = []
        #: graph constant name -> (parameter FQN, "id" | "t"), filled during the build
        self.provenance: dict[str, tuple[str, str]] = {}
        self.refits = 0
        self.full_refits = 0

    # -- build ----------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Torch-TensorRT compile settings (filtered to what this version knows)."""
        wanted: dict[str, Any] = {
            "torch_executed_ops": torch_executed_ops(self.config.lowering()),
            "attn_bias_is_causal": False,  # Torch-TRT 2.11 would otherwise make masked attention causal
            "decompose_attention": False,
            "use_explicit_typing": True,  # the engine takes the model's dtype (bf16 weights -> bf16)
            "truncate_double": True,  # RoPE's float64 frequency table (TensorRT has no float64)
        }
        if self.config.optimization_level is not None:
            wanted["optimization_level"] = self.config.optimization_level
        return trt_shim.compile_kwargs(**wanted)

    def dynamic_shape_range(self) -> dict[str, Any]:
        return {**self.shapes.dynamic_shapes(), "return_dict": None}

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        """Our lowering (pre) and weight-provenance (post) passes, shape-generic position ids and,
        with ``fused_attention``, the fused PRX attention processors (MTTM exports inside)."""
        from torch_tensorrt.dynamo.lowering.passes._aten_lowering_pass import ATEN_POST_LOWERING_PASSES

        post = ATEN_POST_LOWERING_PASSES.passes
        post.append(self._record_provenance)
        try:
            fused = fused_attention_processors(self.model, self.config.fuses_attention())
            with lowering_passes(), shape_generic_position_ids(), fused:
                yield
        finally:
            post.remove(self._record_provenance)

    def build(self, example: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        mttm_cls = self.ttrt.MutableTorchTensorRTModule
        self.mttm = mttm_cls(
            self.model, strict=False, use_python_runtime=self.config.runtime == "python", **self.settings()
        )
        if not self.shapes.is_static():
            self.mttm.set_expected_dynamic_shape_range((), self.dynamic_shape_range())
        with progress.stage("export, lower and build TensorRT engines (MTTM)"), torch.no_grad():
            self(**example)
        torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0

    @classmethod
    def from_graph(
        cls,
        model,
        config,
        shapes,
        gm: torch.fx.GraphModule,
        input_order: list[str],
        provenance: dict[str, tuple[str, str]],
    ) -> TensorRTBackend:
        """A backend around an already compiled graph (``load_compiled``): no MTTM, no build."""
        backend = cls(model, config, shapes)
        backend.loaded_gm, backend.input_order = gm, input_order
        backend.provenance = {k: tuple(v) for k, v in provenance.items()}
        backend.build_s = 0.0
        return backend

    @property
    def gm(self) -> torch.fx.GraphModule:
        """The compiled GraphModule: TensorRT engines and PyTorch segments."""
        return self.loaded_gm if self.loaded_gm is not None else self.mttm.gm

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        if self.loaded_gm is not None:
            args = [False if name == "return_dict" else inputs[name] for name in self.input_order]
            out = self.loaded_gm(*args)
            return out[0] if isinstance(out, (tuple, list)) else out
        with self._compiling():
            return self.mttm(**inputs, return_dict=False)[0]

    # -- reports --------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        gm = self.gm
        segments = trt_shim.torch_segments(gm)
        ops: Counter = Counter()
        for _, seg in segments:
            for node in seg.graph.nodes:
                if node.op == "call_function":
                    ops[str(node.target)] += 1
        return {
            "engines": len(trt_shim.engine_modules(gm)),
            "torch_segments": len(segments),
            "torch_ops": dict(ops),
        }

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, **trt_shim.versions()}

    # -- refit ----------------------------------------------------------------------------------
    def _record_provenance(self, gm: torch.fx.GraphModule, settings: Any) -> torch.fx.GraphModule:
        """Post-lowering pass: trace every graph constant back to a model parameter by value."""
        tensors = dict(gm.named_parameters(remove_duplicate=False))
        tensors.update(gm.named_buffers(remove_duplicate=False))
        originals = {n: t for n, t in tensors.items() if not n.startswith("_frozen_param")}
        by_numel: dict[int, list[str]] = {}
        for n, t in originals.items():
            by_numel.setdefault(t.numel(), []).append(n)
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target not in tensors:
                continue
            name = node.target
            if name in originals:
                self.provenance[name] = (name, "id")
                continue
            match = _match_constant(tensors[name], originals, by_numel.get(tensors[name].numel(), []))
            if match is not None:
                self.provenance[name] = match
        return gm

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        changed = set(names)
        params = dict(self.model.named_parameters())
        plans = []
        covered: set[str] = set()
        for _, module in trt_shim.engine_modules(self.gm):
            updates = {}
            for ew, (key, wdtype) in trt_shim.weight_name_map(module).items():
                src = self.provenance.get(key)
                if src is None or src[0] not in changed:
                    continue
                fqn, transform = src
                w = params[fqn].detach()
                w = w.t() if transform == "t" else w
                updates[ew] = w.to("cuda", trt_shim.torch_dtype_of(wdtype)).contiguous().reshape(-1)
                covered.add(fqn)
            if updates:
                plans.append((module, updates))
        untraced = sorted(changed - covered)  # unknown names, or values TensorRT holds in another form
        if untraced:
            if self.mttm is None:
                from ..errors import LoRAError

                raise LoRAError(
                    f"parameters {untraced[:3]} cannot be traced to engine weights of this loaded artifact.",
                    "load it with rebuild=True, or compile again, to refit them.",
                )
            logger.warning(
                "refit: %d changed parameter(s) not traced to engine weights (e.g. %s): "
                "using Torch-TensorRT's full refit",
                len(untraced),
                untraced[:3],
            )
            device = next(self.model.parameters()).device
            with self._compiling():
                trt_shim.full_refit(self.mttm)
            self.model.to(device)  # MTTM's refit moves the PyTorch model to the CPU afterwards
            self.full_refits += 1
            return {"refit_s": time.perf_counter() - t0, "rebuilt": False, "full_refit": True}
        for module, updates in progress.items(plans, "refit engines"):
            trt_shim.refit_weights(module, updates)
        self.refits += 1
        return {
            "refit_s": time.perf_counter() - t0,
            "rebuilt": False,
            "full_refit": False,
            "engine_weights": sum(len(u) for _, u in plans),
            "engines_refit": len(plans),
        }


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
