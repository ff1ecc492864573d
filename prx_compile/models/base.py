"""``ModelSpec``: everything the backend knows about one diffusers transformer class.

The stages take a spec as an argument and know no model: export asks it for the step's inputs, their
dynamic axes and example values, the repeated block lists and the attention fusion; the runtime for
the forward's arguments and their checks; quantisation for the FP8 targets; LoRA for the layers a file
may name; save and load for the class and its constructor. A spec knows no stage internals either: it
speaks in tensors, module names, ``ShapeRange``s and context managers.

Shapes. A step's shape is a point ``(batch, height, width, text)`` of a ``ShapeRange``. For a model
that takes a latent grid (PRX: ``hidden_states`` (B, C, H, W)) height and width are latent pixels,
multiples of ``multiple``; for one that takes packed image tokens (FLUX: (B, L, C)) the range counts
tokens (``ShapeRange.tokens``): height is the number of image tokens and width is 1.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, ShapeOutOfRangeError
from ..shapes import ShapeRange

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockList:
    """One list of repeated blocks (``model.<attr>``, an ``nn.ModuleList`` of one block class).

    carried: the block's keyword arguments that flow from one block to the next, in the order the
        block returns them (PRX: ``("hidden_states",)``, one tensor; FLUX: ``("encoder_hidden_states",
        "hidden_states")``, a tuple)."""

    attr: str
    carried: tuple[str, ...]


class ModelSpec(abc.ABC):
    """What the backend knows about one diffusers transformer class (see the module docstring).

    Attributes:
        name: the short name (``CompileConfig.model``, ``prx-compile --model``).
        class_name: the diffusers class (``diffusers.<class_name>``).
        blocks: the repeated block lists, in call order.
        block_linears: module names (regex) of the blocks' linears: those that run FP8 GEMMs with
            ``precision: fp8``, and those a random LoRA covers (demos, tests, benchmarks).
        tokens: the step's image axis counts packed tokens (``ShapeRange.tokens``), not a grid.
        defaults: ``CompileConfig`` values this model gets where the config leaves them unset.
        bins: aspect-ratio bin families, as ``{family: [(height, width) in pixels, ...]}``.
        size_keys: constructor keys that set a depth, with their largest value an artifact may ask for.
    """

    name: str = ""
    class_name: str = ""
    blocks: tuple[BlockList, ...] = ()
    block_linears: re.Pattern = re.compile(r"(?!)")
    tokens: bool = False
    defaults: dict[str, Any] = {}
    bins: dict[int, list[tuple[int, int]]] = {}
    size_keys: dict[str, int] = {}

    # -- the class -------------------------------------------------------------------------------
    def model_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.class_name)

    def matches(self, model: Any) -> bool:
        """Whether ``model`` is an instance of this spec's diffusers class (or a subclass of it)."""
        return isinstance(model, self.model_class())

    def construct(self, config: dict[str, Any]) -> torch.nn.Module:
        """The model of ``config`` (constructor keyword arguments), on the meta device: no memory."""
        cls = self.model_class()  # imported outside: a module's own tensors stay off the meta device
        with torch.device("meta"):
            return cls(**config)

    def config_problem(self, model_config: Any) -> str | None:
        """Why a model of ``model_config`` cannot run here though its class accepted it (None when it
        can): what diffusers only finds at the first call."""
        return None

    def constructor_defaults(self) -> dict[str, Any]:
        """The constructor's keyword arguments and their defaults (what an artifact's model config
        may set)."""
        params = inspect.signature(self.model_class().__init__).parameters
        return {k: p.default for k, p in params.items() if k != "self"}

    # -- shapes ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def multiple(self, model_config: Any) -> int:
        """What latent height and width must be multiples of (1 for a token range)."""

    @abc.abstractmethod
    def point_of_pixels(
        self, height: int, width: int, vae_scale_factor: int, model_config: Any
    ) -> tuple[int, int]:
        """An image of ``height`` x ``width`` pixels as the step's (height, width) point."""

    def defaults_for(self, model_config: Any) -> dict[str, Any]:
        """``defaults`` for this model's configuration (a variant may differ: PRXPixel has no VAE)."""
        return dict(self.defaults)

    def aspect_sizes(self, family: int, model_config: Any = None) -> list[tuple[int, int]]:
        """The (height, width) pixel sizes of aspect-bin family ``family``; ConfigError if it has none."""
        if family not in self.bins:
            raise ConfigError(
                f"aspect_bins: {family} is not a bin family of {self.class_name}.",
                f"use one of {sorted(self.bins)}, or [] for the square resolution only.",
            )
        return list(self.bins[family])

    # -- one step's inputs -----------------------------------------------------------------------
    @abc.abstractmethod
    def inputs(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The step's tensor inputs, in order: what the exported graph takes (besides the weights)."""

    #: the inputs that must be in the model's dtype (the others: float32 or bool, made so by ``arguments``)
    dtype_inputs: tuple[str, ...] = ("hidden_states", "encoder_hidden_states")

    def batched(self, name: str) -> bool:
        """Whether input ``name`` has the batch as its first axis (batch chunks slice it)."""
        return True

    @abc.abstractmethod
    def arguments(self, model: torch.nn.Module, bound: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The step's inputs of one forward call (``bound``: the forward's arguments by name, defaults
        filled in), checked: shapes against the model's config and each other, dtypes, one line per
        problem (ShapeOutOfRangeError, or ConfigError for what a compiled module cannot do)."""

    @abc.abstractmethod
    def point(self, inputs: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
        """(batch, height, width, text) of a step on ``inputs`` (``arguments``' result)."""

    @abc.abstractmethod
    def example_inputs(
        self,
        model: torch.nn.Module,
        batch: int,
        height: int,
        width: int,
        text: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        masked_tokens: int = 0,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Random inputs of one step at the point (batch, height, width, text), as the model's pipeline
        passes them (the step's ``inputs``, in order)."""

    @abc.abstractmethod
    def axes(self, model: torch.nn.Module) -> dict[str, dict[int, str]]:
        """Which axis of which input is the step's "batch", "height", "width" or "text" (the dynamic
        axes; an input or axis not named is static)."""

    def dynamic_shapes(self, model: torch.nn.Module, shapes: ShapeRange) -> dict[str, Any]:
        """``torch.export`` dynamic shapes of the inputs over ``shapes`` (static axes left out)."""
        from torch.export import Dim

        m = shapes.multiple

        def dim(name: str, lo: int, hi: int, mult: int = 1):
            if lo == hi:
                return None
            if mult == 1:
                return Dim(name, min=lo, max=hi)
            return mult * Dim(name, min=lo // mult, max=hi // mult)

        dims = {
            "batch": dim("batch", *shapes.batch),
            "height": dim("img_tokens" if shapes.tokens else "latent_h", *shapes.height, m),
            "width": dim("latent_w", *shapes.width, m),
            "text": dim("text_len", *shapes.text),
        }
        return {
            name: {i: dims[a] for i, a in ax.items() if dims[a] is not None}
            for name, ax in self.axes(model).items()
        }

    def forward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every exported call adds (``return_dict=False``)."""
        return {"return_dict": False}

    # -- export ----------------------------------------------------------------------------------
    def export_context(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """What the model needs changed while it is exported (restored on exit)."""
        return contextlib.nullcontext()

    def fused_attention(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[int]:
        """Within the block, the model's attention cores run as ``prx_compile`` ops (yields how many
        modules were swapped; restored on exit)."""
        return _none()

    # -- numbers the warm-up and the memory check need -------------------------------------------
    #: how the fused attention attends: "joint" (image queries over masked text keys and image keys,
    #: one ``prx_attention`` op) or "dense" (every token over every token, one ``attention`` op)
    attention: str = "joint"

    @abc.abstractmethod
    def step_tokens(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """(batch, image tokens, text tokens) of a step on ``inputs``."""

    @abc.abstractmethod
    def attention_dims(self, model: torch.nn.Module) -> tuple[int, int]:
        """(heads, head_dim) of the model's attention."""

    @abc.abstractmethod
    def width(self, model: torch.nn.Module) -> int:
        """The width of the residual stream (channels per token)."""

    def gate_width(self, model: torch.nn.Module) -> int | None:
        """The MLP gate's output width where the model has a gated MLP (``gelu_gate``), else None."""
        return None

    # -- test and demo models --------------------------------------------------------------------
    tiny: dict[str, Any] = {}

    def nondegenerate_(self, model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> torch.nn.Module:
        """Re-initialise what a fresh model leaves at zero so that it is not the identity (in place)."""
        return model

    def convert_lora(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A LoRA file in another layout of this family (e.g. kohya's original names) in diffusers'
        layout; the identity where the model has none."""
        return state_dict


@contextlib.contextmanager
def _none() -> Iterator[int]:
    yield 0


def check_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` if it is a tensor, else a ShapeOutOfRangeError naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise ShapeOutOfRangeError(f"{name} must be a tensor, got {type(value).__name__}.")
    return value


def batch_vector(name: str, value: Any, batch: int, device: torch.device) -> torch.Tensor:
    """A timestep-like argument as (batch,) float32: a number, a (1,) or a (batch,) tensor. Anything
    else (another length, more than one axis) is a ShapeOutOfRangeError that says what it got."""
    t = torch.as_tensor(value, device=device)
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] not in (1, batch)):
        raise ShapeOutOfRangeError(
            f"{name} has shape {tuple(t.shape)}, expected ({batch},), (1,) or a number."
        )
    t = t.float().reshape(-1)
    return t.expand(batch).contiguous() if t.numel() == 1 and batch != 1 else t


def grid_of(tokens: int) -> tuple[int, int]:
    """(rows, cols) of a grid of ``tokens`` cells, as square as divides it (for example ids)."""
    rows = max(r for r in range(1, math.isqrt(tokens) + 1) if tokens % r == 0)
    return rows, tokens // rows


@contextlib.contextmanager
def swapped_processors(
    model: torch.nn.Module, module_class: str, processor: object, why_not: Any
) -> Iterator[int]:
    """Within the block, every module of ``model`` whose class is named ``module_class`` runs
    ``processor``, except those for which ``why_not(module)`` gives a reason (logged at debug level);
    yields how many were swapped. The original processors are restored on exit."""
    swapped: list[tuple[torch.nn.Module, object]] = []
    for name, mod in model.named_modules():
        if type(mod).__name__ != module_class:
            continue
        why = why_not(mod)
        if why is not None:
            logger.debug("fused_attention: leaving %s as is: %s", name, why)
            continue
        swapped.append((mod, mod.processor))
        mod.processor = processor
    logger.debug("fused_attention: %d %s modules swapped", len(swapped), module_class)
    try:
        yield len(swapped)
    finally:
        for mod, proc in swapped:
            mod.processor = proc
