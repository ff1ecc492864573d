"""Export one PRX transformer step with ``torch.export``: dynamic batch, latent size and text length,
and (with ``weights="inputs"``) the transformer's parameters as graph inputs.

The hooks a PRX export needs are active only inside ``export_prx``:

* diffusers' ``get_image_ids`` fills a zeros tensor by index assignment, which breaks export with
  dynamic height/width; ``shape_generic_position_ids`` swaps in an ``arange``/``expand``/``stack``
  formulation with the same values;
* with ``trace_blocks_once`` (the default), the model is traced with its first block only and that
  block's nodes are copied for the others (``prx_compile.export.repeat``): the same graph;
* with ``fuse_attention``, every PRX attention module runs ``FusedPRXAttnProcessor``
  (``prx_compile.export.fusion``) for the duration of the export.

The shape ranges it exports over are ``prx_compile.shapes.ShapeRange``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..shapes import ShapeRange

logger = logging.getLogger(__name__)

ACTIVATIONS = ("hidden_states", "timestep", "encoder_hidden_states", "attention_mask")


def image_ids(
    batch_size: int, height: int, width: int, patch_size: int, device: torch.device
) -> torch.Tensor:
    """(batch, (H/p)*(W/p), 2) float32 (row, col) patch coordinates: the same values as diffusers'."""
    gh, gw = height // patch_size, width // patch_size
    rows = torch.arange(gh, device=device, dtype=torch.float32)[:, None].expand(gh, gw)
    cols = torch.arange(gw, device=device, dtype=torch.float32)[None, :].expand(gh, gw)
    ids = torch.stack([rows, cols], dim=-1).reshape(gh * gw, 2)
    return ids.unsqueeze(0).expand(batch_size, gh * gw, 2)


@contextlib.contextmanager
def shape_generic_position_ids() -> Iterator[None]:
    """Within the block, diffusers' PRX uses ``image_ids`` instead of ``get_image_ids``."""
    from diffusers.models.transformers import transformer_prx

    original = transformer_prx.get_image_ids
    transformer_prx.get_image_ids = image_ids
    try:
        yield
    finally:
        transformer_prx.get_image_ids = original


def example_inputs(
    config: Any,
    batch: int,
    height: int,
    width: int,
    text_len: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    masked_tokens: int = 0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """PRX forward kwargs as PRXPipeline passes them (``return_dict`` not included).

    hidden_states (B, C, H, W); timestep (B,) in [0, 1]; encoder_hidden_states (B, T, context_in_dim);
    attention_mask (B, T) bool with the last ``masked_tokens`` of every other row padded out
    (row 0 keeps all tokens when B > 1, so one row is unmasked and one masked).
    """
    g = torch.Generator().manual_seed(seed)
    kw = {
        "hidden_states": torch.randn(batch, config.in_channels, height, width, generator=g),
        "timestep": torch.rand(batch, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_len, config.context_in_dim, generator=g),
    }
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    if masked_tokens:
        start = 1 if batch > 1 else 0
        mask[start::2, text_len - masked_tokens :] = False
    kw["attention_mask"] = mask
    return {
        k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
        for k, v in kw.items()
    }


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a step reads besides its activations, by FQN: every parameter, then every buffer (the
    FP8 copies of ``precision: fp8``). With ``weights: inputs`` these are the graph's ``weights_*``."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class PRXStep(torch.nn.Module):
    """What ``export_prx`` exports: one transformer step, (B, C, H, W) out.

    With ``weight_names``, the transformer's parameters are the ``weights`` argument (in that order)
    and the transformer is not a submodule, so no weight is captured in the graph.
    """

    def __init__(self, model: torch.nn.Module, weight_names: list[str] | None = None):
        super().__init__()
        if weight_names is None:
            self.model = model  # parameters are lifted into the exported program (baked into engines)
        else:
            object.__setattr__(self, "model", model)
        self.weight_names = weight_names

    def forward(self, hidden_states, timestep, encoder_hidden_states, attention_mask, weights=()):
        args = (hidden_states, timestep, encoder_hidden_states, attention_mask)
        if self.weight_names is None:
            return self.model(*args, return_dict=False)[0]
        params = dict(zip(self.weight_names, weights, strict=True))
        return torch.func.functional_call(self.model, params, args, {"return_dict": False})[0]


def export_prx(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    shapes: ShapeRange | None = None,
    *,
    weights: str = "engine",
    fuse_attention: bool = False,
    trace_blocks_once: bool = True,
    prepare: Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram] | None = None,
) -> tuple[torch.export.ExportedProgram, list[str] | None]:
    """``torch.export`` one PRX step (non-strict) over ``shapes``.

    Args:
        model: a PRXTransformer2DModel in eval mode.
        example: PRX forward kwargs (``ACTIVATIONS``), the shapes' tuning point.
        shapes: dynamic ranges (None or a static range: static shapes).
        weights: "inputs" (parameters and buffers are the graph's ``weights_*`` inputs) or "engine"
            (they are lifted as the program's parameters).
        fuse_attention: export with ``FusedPRXAttnProcessor`` (one ``prx_attention`` op per block).
        trace_blocks_once: trace the first block and copy it for the others where
            ``repeat.why_not`` finds nothing against it (else, or where the copy is refused, every
            block is traced).
        prepare: applied to the exported program before its blocks are copied, so to one block
            only (or to the full export, where nothing is copied): graph rewrites and
            decompositions that treat each block alike (``lower``, ``run_decompositions``). It
            may rewrite the graph in place or return a new program; its weight inputs must keep
            their ``weights_*`` names.

    Returns:
        (ExportedProgram, the parameter names in ``weights_*`` order, or None for "engine").
    """
    from . import repeat

    if trace_blocks_once:
        reason = repeat.why_not(model, weights)
        if reason is None:
            small = repeat.first_block_only(model)
            ep, small_names = _export(small, example, shapes, weights, fuse_attention)
            if prepare is not None:
                ep = prepare(ep)
            full_names = list(weight_tensors(model))
            repeated = repeat.repeat_blocks(ep, small_names, full_names, len(model.blocks))
            if repeated is not None:
                return repeated, full_names
        else:
            logger.debug("export: tracing every block (%s)", reason)
    ep, names = _export(model, example, shapes, weights, fuse_attention)
    return (prepare(ep) if prepare is not None else ep), names


def _export(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    shapes: ShapeRange | None,
    weights: str,
    fuse_attention: bool,
) -> tuple[torch.export.ExportedProgram, list[str] | None]:
    from .fusion import fused_attention_processors

    tensors = weight_tensors(model)
    names = list(tensors) if weights == "inputs" else None
    kwargs = {k: example[k] for k in ACTIVATIONS}
    dyn = None
    if shapes is not None and not shapes.is_static():
        dyn = shapes.dynamic_shapes()
    if names is not None:
        kwargs["weights"] = [t.detach() for t in tensors.values()]
        if dyn is not None:
            dyn["weights"] = [None] * len(names)
    with (
        shape_generic_position_ids(),
        fused_attention_processors(model, fuse_attention),
        torch.no_grad(),
    ):
        ep = torch.export.export(PRXStep(model, names), (), kwargs, dynamic_shapes=dyn, strict=False)
    return ep, names
