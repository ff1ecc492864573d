"""Backends compile and run one engine set: the lowered transformer step over one ``ShapeRange``.

The pipeline every backend follows::

    export_step (torch.export, once) -> lower (prx_compile.lowering.RULES) -> backend.compile

A backend takes the transformer, the plan and its shape range; ``build(example)`` runs that
pipeline; calling it runs one step and returns the model's prediction; ``report`` says what was
built; ``weights_changed`` brings the compiled form up to date after parameters changed in place
(LoRA); ``state()`` describes a built backend as JSON, bytes and tensors, and ``backend_from_state``
recreates it with the same abilities: a loaded backend is the same type as a built one.
"""

from __future__ import annotations

import torch

from ..plan import Plan
from ..shapes import ShapeRange
from .base import Backend, BackendState


def backend_class(plan: Plan) -> type[Backend]:
    """The backend class ``plan.config.backend`` names (the tensorrt one imports Torch-TensorRT lazily)."""
    if plan.config.backend == "tensorrt":
        from .tensorrt import TensorRTBackend

        return TensorRTBackend
    from .pytorch import TorchBackend

    return TorchBackend


def make_backend(model: torch.nn.Module, plan: Plan, shapes: ShapeRange) -> Backend:
    """A backend of ``plan.config.backend`` (raises BackendUnavailableError where it cannot run)."""
    return backend_class(plan)(model, plan, shapes)


__all__ = ["Backend", "BackendState", "backend_class", "make_backend"]
