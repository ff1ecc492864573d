"""PyTorch backends: the same exported and lowered graph, run as is ("eager") or through
``torch.compile`` ("inductor"). They need no GPU and no TensorRT: CPU machines, CI and comparisons
use them. Their state holds no graph: a loaded one exports and lowers again at its first call.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import progress
from ..export import export_step, weight_tensors
from ..lowering import lower
from ..ops import choice
from .base import Backend, BackendState, SetReport, empty_report


class TorchBackend(Backend):
    """Runs ``lower(export(model))`` with PyTorch. With ``weights="inputs"`` the graph takes the
    transformer's parameters as inputs; with "engine" it holds them as attributes. Either way they
    are the model's own tensors, so in-place weight changes (LoRA) need no refit."""

    kind = "torch"

    def build(self, example: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        cfg = self.config
        times = self.timings
        with progress.stage(f"export ({self.shapes.describe()})", times, "export_s"):
            ep, self.weight_names = export_step(
                self.model, example, self.shapes, weights=cfg.weights, fuse_attention=cfg.attention == "fused"
            )
        with progress.stage("kernels measured at the set's shape", times, "kernels_s"):
            self.kernels = choice.choose(self.plan, self.model, self.shapes, example)
        progress.note(f"kernels for {self.shapes.describe()}: {self.kernels.describe()}")
        with progress.stage("lower (prx_compile rules)", times, "lower_s"):
            gm = lower(ep.module(), self.plan.lowering(None, self.kernels))
        self.graph_module = gm
        dynamic = not self.shapes.is_static()
        self.fn = torch.compile(gm, dynamic=dynamic) if cfg.backend == "inductor" else gm
        with progress.stage(f"build ({cfg.backend})", times, "compile_s"), torch.no_grad():
            self(**example)  # inductor compiles here
        self.build_s = time.perf_counter() - t0

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {k: inputs[k] for k in self.spec.inputs(self.model)}
        if self.weight_names is not None:
            params = weight_tensors(self.model)
            kwargs["weights"] = [params[n] for n in self.weight_names]
        return self.fn(**kwargs)

    def rebind(self) -> bool:
        return getattr(self, "weight_names", None) is not None  # weights: inputs reads them at each call

    def report(self) -> SetReport:
        ops: dict[str, int] = {}
        for node in self.graph_module.graph.nodes:
            if node.op == "call_function" and "prx_compile" in str(node.target):
                ops[str(node.target)] = ops.get(str(node.target), 0) + 1
        return empty_report(torch_segments=1, torch_ops=ops)

    def state(self) -> BackendState:
        return BackendState({"kind": self.kind})

    @classmethod
    def from_state(cls, model, plan, shapes, state: BackendState) -> TorchBackend:
        if state.meta != {"kind": cls.kind} or state.blobs or state.tensors:
            raise ValueError("a torch backend state is exactly {'kind': 'torch'}")
        return cls(model, plan, shapes)  # exports and lowers again at its first call
