"""Backends run the lowered PRX graph: Torch-TensorRT (MTTM) or PyTorch (eager / inductor).

Every backend takes the transformer, the config and the shape range; ``build`` compiles for example
inputs; calling it runs one step and returns the (B, C, H, W) prediction; ``report`` says what was
built (engines, PyTorch segments, ops kept in PyTorch); ``weights_changed`` brings the compiled form
up to date after parameters were modified in place (LoRA).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from ..config import CompileConfig
from ..export import ShapeRange


class Backend(abc.ABC):
    name: str = ""

    def __init__(self, model: torch.nn.Module, config: CompileConfig, shapes: ShapeRange):
        self.model = model
        self.config = config
        self.shapes = shapes
        self.build_s: float | None = None

    @abc.abstractmethod
    def build(self, example: dict[str, torch.Tensor]) -> None:
        """Export, lower and compile for ``example`` (PRX forward kwargs) over ``self.shapes``."""

    @abc.abstractmethod
    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """One transformer step: PRX forward kwargs -> (B, C, H, W)."""

    def report(self) -> dict[str, Any]:
        """{"engines", "torch_segments", "torch_ops": {op: count}} of what was built."""
        return {"engines": 0, "torch_segments": 0, "torch_ops": {}}

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        """Propagate in-place changes of these parameters (FQNs of ``self.model``); returns timings."""
        return {"refit_s": 0.0, "rebuilt": False}

    def versions(self) -> dict[str, str]:
        return {}


def make_backend(model: torch.nn.Module, config: CompileConfig, shapes: ShapeRange) -> Backend:
    """The backend named by ``config.backend`` (raises BackendUnavailableError where it cannot run)."""
    if config.backend == "tensorrt":
        from .tensorrt import TensorRTBackend

        return TensorRTBackend(model, config, shapes)
    from .torch import TorchBackend

    return TorchBackend(model, config, shapes)
