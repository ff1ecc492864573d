"""``Backend``, the interface every backend implements, and ``BackendState``, what a built one is."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from ..ops.choice import KernelChoice
from ..plan import Plan
from ..shapes import ShapeRange


@dataclass
class BackendState:
    """What a built backend needs to come back: ``meta`` (JSON-able), ``blobs`` (named bytes, e.g.
    engines) and ``tensors`` (named tensors, e.g. constants). Names are ``[A-Za-z0-9_.-]``."""

    meta: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class SetReport(TypedDict):
    """What one built engine set is made of (``Backend.report()``; sizes in MiB)."""

    engines: int  # distinct engines (a block's engine is one engine, called once per block)
    engine_calls: int  # engine calls in one step
    torch_segments: int  # runs of PyTorch ops between engines
    torch_ops: dict[str, int]  # prx_compile ops kept in PyTorch, by name
    context_mb: float  # the execution contexts' activation memory, summed
    arena_mb: float  # the one block they run on (``share_context_memory``; 0: none)
    engine_mb: float  # serialized engines


class Backend(abc.ABC):
    kind: str = ""

    def __init__(self, model: torch.nn.Module, plan: Plan, shapes: ShapeRange):
        self.model = model
        self.plan = plan
        self.config = plan.config
        self.spec = plan.spec
        self.shapes = shapes
        self.build_s: float | None = None
        #: where this set's first call went, in seconds: ``export_s``, ``kernels_s`` (the kernels'
        #: measurement; TensorRT: the MLP gate's, before the export, and ``kernels_wait_s``, waiting
        #: for the attention's after the engines, beside which it ran; ``kernels_measure_s``, both
        #: parts' own time), ``lower_s``, (TensorRT) ``decompose_s`` (Torch-TensorRT's
        #: decompositions), ``compile_s`` (the backend's compiler),
        #: ``first_run_s`` (the first step, JIT kernels included) and, with CUDA graphs,
        #: ``graph_capture_s``; a loaded set has ``load_s`` instead of the build stages.
        self.timings: dict[str, float] = {}
        #: (TensorRT) each engine built, slowest first: partition -> [seconds, ops, the 6 commonest]
        #: (empty where nothing was built: a loaded set, a cache hit, the PyTorch backends)
        self.engine_build_s: dict[str, list] = {}
        #: the kernels this set runs, measured when it was built (``ops.choice``)
        self.kernels: KernelChoice | None = None

    @property
    def is_built(self) -> bool:
        return self.build_s is not None

    @abc.abstractmethod
    def build(self, example: dict[str, torch.Tensor]) -> None:
        """Export, lower and compile for ``example`` (the step's inputs) over ``self.shapes``."""

    @abc.abstractmethod
    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """One transformer step: the step's inputs (``ModelSpec.inputs``) -> the model's output."""

    @property
    def is_loaded(self) -> bool:
        """False while ``from_state`` has deferred work (see ``load``)."""
        return True

    def load(self) -> None:  # noqa: B027 (optional hook: most backends defer nothing)
        """Finish what ``from_state`` deferred (e.g. deserialising engines) before the first call."""

    def report(self) -> SetReport:
        """What was built (``SetReport``); a backend without engines reports none."""
        return empty_report()

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        """Propagate in-place changes of these parameters (FQNs of ``self.model``); returns timings.

        "graphs_valid": whether CUDA graphs captured before stay valid (no new engine memory)."""
        return {"refit_s": 0.0, "graphs_valid": True}

    def rebind(self) -> bool:
        """Read the weights from the model's current submodules after some were swapped for others of
        the same structure (names, shapes, dtypes, types). False when this set cannot (it holds the old
        modules' weights) and must be built again."""
        return False

    @property
    def needs_refit(self) -> bool:
        """True when weight changes must be pushed into compiled copies (and can fail)."""
        return False

    @abc.abstractmethod
    def state(self) -> BackendState:
        """This built backend as a ``BackendState``."""

    @classmethod
    @abc.abstractmethod
    def from_state(
        cls, model: torch.nn.Module, plan: Plan, shapes: ShapeRange, state: BackendState
    ) -> Backend:
        """The backend ``state`` describes, over ``model``'s live parameters. Raises ValueError
        naming the field when the state is malformed."""

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}


def empty_report(torch_segments: int = 0, torch_ops: dict[str, int] | None = None) -> SetReport:
    """The report of a set without engines."""
    return SetReport(
        engines=0,
        engine_calls=0,
        torch_segments=torch_segments,
        torch_ops=torch_ops or {},
        context_mb=0.0,
        arena_mb=0.0,
        engine_mb=0.0,
    )
