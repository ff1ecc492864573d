"""PyTorch backends: the same lowered graph, run as is ("eager") or through ``torch.compile``
("inductor"). They need no GPU and no TensorRT: CPU machines, CI and comparisons use them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .. import progress
from ..export import export_prx
from ..fusion import fused_attention_processors
from ..lowering import lower
from . import Backend

logger = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Runs ``lower(export(model))`` with PyTorch. Parameters are shared with the model, so
    in-place weight changes (LoRA fuse/unfuse) take effect without any refit."""

    def build(self, example: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        fused = fused_attention_processors(self.model, self.config.fuses_attention())
        with progress.stage("export (torch.export, dynamic shapes)"), fused:
            ep = export_prx(self.model, example, self.shapes)
        with progress.stage("lower (prx_compile rules)"):
            gm = lower(ep.module(), self.config.lowering())
        self.graph_module = gm
        self.fn = (
            torch.compile(gm, dynamic=not self.shapes.is_static())
            if self.config.backend == "inductor"
            else gm
        )
        with progress.stage(f"build ({self.config.backend})"):
            self.fn(**example, return_dict=False)  # inductor compiles here
        self.build_s = time.perf_counter() - t0

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(**inputs, return_dict=False)[0]

    def report(self) -> dict[str, Any]:
        ops: dict[str, int] = {}
        for node in self.graph_module.graph.nodes:
            if node.op == "call_function" and "prx_compile" in str(node.target):
                ops[str(node.target)] = ops.get(str(node.target), 0) + 1
        return {"engines": 0, "torch_segments": 1, "torch_ops": ops}

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}
