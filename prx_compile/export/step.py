"""Export one transformer step with ``torch.export``: dynamic batch, image size and text length, and
(with ``weights="inputs"``) the transformer's parameters as graph inputs.

What the step takes and which axes are dynamic come from the model's spec (``prx_compile.models``);
the hooks an export needs are active only inside ``export_step``:

* the spec's ``export_context`` (PRX: a shape-generic ``get_image_ids``);
* with ``trace_blocks_once`` (the default), the model is traced with the first block of each block list
  only and that block's nodes are copied for the others (``prx_compile.export.repeat``): the same graph;
* with ``fuse_attention``, the spec's attention fusion (PRX: one ``prx_attention`` op per block).

The shape ranges it exports over are ``prx_compile.shapes.ShapeRange``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..models import ModelSpec, spec_for
from ..shapes import ShapeRange

logger = logging.getLogger(__name__)


def example_inputs(
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
    """The inputs of one step of ``model`` at (batch, height, width, text), as its pipeline passes them
    (``ModelSpec.example_inputs``; ``return_dict`` not included)."""
    return spec_for(model).example_inputs(
        model, batch, height, width, text, dtype=dtype, device=device, masked_tokens=masked_tokens, seed=seed
    )


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a step reads besides its activations, by FQN: every parameter, then every buffer (the
    FP8 copies of ``precision: fp8``). With ``weights: inputs`` these are the graph's ``weights_*``."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class Step(torch.nn.Module):
    """What ``export_step`` exports: one transformer step, the model's output tensor.

    Called with the spec's inputs by name (its signature names them, so the exported graph's inputs
    carry those names) and, with ``weight_names``, the transformer's parameters as the ``weights``
    argument (in that order); the transformer is then not a submodule, so no weight is captured.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        names: tuple[str, ...],
        weight_names: list[str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__()
        if weight_names is None:
            self.model = model  # parameters are lifted into the exported program (baked into engines)
        else:
            object.__setattr__(self, "model", model)
        self.names = names
        self.weight_names = weight_names
        self.extra = dict(extra or {})

    def forward(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        inputs = dict(bound.arguments)
        weights = inputs.pop("weights", ())
        kwargs = {**inputs, **self.extra}
        if self.weight_names is None:
            return self.model(**kwargs)[0]
        params = dict(zip(self.weight_names, weights, strict=True))
        return torch.func.functional_call(self.model, params, (), kwargs)[0]


def step_module(model: torch.nn.Module, spec: ModelSpec, weight_names: list[str] | None = None) -> Step:
    """A ``Step`` whose ``forward`` signature is (<the spec's inputs>, weights=())."""
    names = spec.inputs(model)
    p = inspect.Parameter
    params = [p(n, p.POSITIONAL_OR_KEYWORD) for n in names] + [
        p("weights", p.POSITIONAL_OR_KEYWORD, default=())
    ]
    signature = inspect.Signature(params)

    def forward(self, *args, **kwargs):
        return Step.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature([p("self", p.POSITIONAL_OR_KEYWORD), *params])
    cls = type(f"Step_{spec.name}", (Step,), {"forward": forward, "signature": signature})
    return cls(model, names, weight_names, spec.forward_kwargs())


def export_step(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    shapes: ShapeRange | None = None,
    *,
    weights: str = "engine",
    fuse_attention: bool = False,
    trace_blocks_once: bool = True,
    prepare: Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram] | None = None,
) -> tuple[torch.export.ExportedProgram, list[str] | None]:
    """``torch.export`` one step of ``model`` (non-strict) over ``shapes``.

    Args:
        model: a supported diffusers transformer (``prx_compile.models``) in eval mode.
        example: the step's inputs (``ModelSpec.inputs``), the shapes' tuning point.
        shapes: dynamic ranges (None or a static range: static shapes).
        weights: "inputs" (parameters and buffers are the graph's ``weights_*`` inputs) or "engine"
            (they are lifted as the program's parameters).
        fuse_attention: export with the spec's attention fusion (its attention cores as ops).
        trace_blocks_once: trace the first block of each block list and copy it for the others where
            ``repeat.why_not`` finds nothing against it (else, or where the copy is refused, every
            block is traced).
        prepare: applied to the exported program before its blocks are copied, so to one block of
            each list only (or to the full export, where nothing is copied): graph rewrites and
            decompositions that treat each block alike (``lower``, ``run_decompositions``). It may
            rewrite the graph in place or return a new program; its weight inputs must keep their
            ``weights_*`` names.

    Returns:
        (ExportedProgram, the parameter names in ``weights_*`` order, or None for "engine").
    """
    from . import repeat

    spec = spec_for(model)
    if trace_blocks_once:
        reason = repeat.why_not(model, spec, weights)
        if reason is None:
            small = repeat.first_blocks_only(model, spec)
            ep, small_names = _export(small, spec, model, example, shapes, weights, fuse_attention)
            if prepare is not None:
                ep = prepare(ep)
            full_names = list(weight_tensors(model))
            repeated = repeat.repeat_blocks(ep, small_names, full_names, spec, model)
            if repeated is not None:
                if prepare is not None:  # as prepare drops dead code: the last copy's unread outputs
                    repeated.graph.eliminate_dead_code()
                    repeated.graph_module.recompile()
                return repeated, full_names
        else:
            logger.debug("export: tracing every block (%s)", reason)
    ep, names = _export(model, spec, model, example, shapes, weights, fuse_attention)
    return (prepare(ep) if prepare is not None else ep), names


def _export(
    model: torch.nn.Module,
    spec: ModelSpec,
    full: torch.nn.Module,
    example: dict[str, torch.Tensor],
    shapes: ShapeRange | None,
    weights: str,
    fuse_attention: bool,
) -> tuple[torch.export.ExportedProgram, list[str] | None]:
    tensors = weight_tensors(model)
    names = list(tensors) if weights == "inputs" else None
    kwargs = {k: example[k] for k in spec.inputs(full)}
    dyn = None
    if shapes is not None and not shapes.is_static():
        dyn = spec.dynamic_shapes(full, shapes)
    if names is not None:
        kwargs["weights"] = [t.detach() for t in tensors.values()]
        if dyn is not None:
            dyn["weights"] = [None] * len(names)
    fusion = spec.fused_attention(model) if fuse_attention else contextlib.nullcontext(0)
    with spec.export_context(model), fusion, torch.no_grad():
        step = step_module(model, spec, names)
        ep = torch.export.export(step, (), kwargs, dynamic_shapes=dyn, strict=False)
    return ep, names
