"""PRX (``diffusers.PRXTransformer2DModel``): Photoroom's text-to-image DiT, the 1.17 B latent model and
the ~7B pixel-space PRXPixel (``in_channels=3``, a bottleneck ``img_in``, ``resolution_embeds``,
``patch_size=16``), one class and one spec.

A step: hidden_states (B, C, H, W) latents (PRXPixel: pixels), timestep (B,) in [0, 1],
encoder_hidden_states (B, T, context_in_dim), attention_mask (B, T) bool (the text padding) ->
(B, C, H, W). Its blocks are one list, ``blocks``; the attention core of each (QK RMSNorm, RoPE, the
joint text+image attention) can run as one ``prx_compile::prx_attention`` op
(``FusedPRXAttnProcessor``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError, ShapeOutOfRangeError
from .base import BlockList, ModelSpec, batch_vector, check_tensor, swapped_processors

logger = logging.getLogger(__name__)

INPUTS = ("hidden_states", "timestep", "encoder_hidden_states", "attention_mask")


#: PRX's aspect-ratio bins (PRXPipeline's ``ASPECT_RATIO_BINS``), by family: (height, width) pixels
def _pipeline_bins() -> dict[int, list[tuple[int, int]]]:
    from diffusers.pipelines.prx.pipeline_prx import ASPECT_RATIO_BINS

    return {family: [tuple(v) for v in bins.values()] for family, bins in ASPECT_RATIO_BINS.items()}


def _pixel_bins() -> dict[int, list[tuple[int, int]]]:
    from diffusers.pipelines.prx.pipeline_prx_pixel import ASPECT_RATIO_BINS

    return {family: [tuple(v) for v in bins.values()] for family, bins in ASPECT_RATIO_BINS.items()}


#: A PRX small enough for CPU tests (depth 2, hidden 64, 4 heads of 16).
TINY: dict[str, Any] = {
    "in_channels": 4,
    "patch_size": 2,
    "context_in_dim": 32,
    "hidden_size": 64,
    "mlp_ratio": 2.0,
    "num_heads": 4,
    "depth": 2,
    "axes_dim": [8, 8],
}

#: PRXPixel's shape (7B-sized: hidden 3072, 24 heads of 128, depth 32, patch 16 on RGB pixels, a
#: 256-wide bottleneck ``img_in``, resolution embeddings). The released configuration was not at hand
#: when this was written; these are the values diffusers' docs and the pipeline name. 6.85 B parameters.
PIXEL: dict[str, Any] = {
    "in_channels": 3,
    "patch_size": 16,
    "context_in_dim": 2048,
    "hidden_size": 3072,
    "mlp_ratio": 3.5,
    "num_heads": 24,
    "depth": 32,
    "axes_dim": [64, 64],
    "bottleneck_size": 256,
    "resolution_embeds": True,
}

#: A tiny PRXPixel for CPU tests: pixels in, a large patch, the bottleneck and resolution embeddings.
TINY_PIXEL: dict[str, Any] = {
    "in_channels": 3,
    "patch_size": 8,
    "context_in_dim": 32,
    "hidden_size": 64,
    "mlp_ratio": 2.0,
    "num_heads": 4,
    "depth": 2,
    "axes_dim": [8, 8],
    "bottleneck_size": 16,
    "resolution_embeds": True,
}


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
    """Within the block, diffusers' PRX uses ``image_ids`` instead of ``get_image_ids``, which fills a
    zeros tensor by index assignment (that breaks export over dynamic height and width)."""
    from diffusers.models.transformers import transformer_prx

    original = transformer_prx.get_image_ids
    transformer_prx.get_image_ids = image_ids
    try:
        yield
    finally:
        transformer_prx.get_image_ids = original


class FusedPRXAttnProcessor:
    """Same inputs and result as diffusers' ``PRXAttnProcessor2_0``; the core is one op.

    ``PRXAttnProcessor2_0`` runs, per block: QKV projection, a reshape/permute, RMSNorm on queries and
    keys, RoPE, a concatenation of text and image keys, attention, the output projection. Compiled by
    TensorRT-RTX, everything between the projections becomes several fused elementwise kernels that
    run far below memory bandwidth. This processor keeps the projections (GEMMs reading the live
    weights) and hands the rest to ``prx_attention``: one Triton pass per operand, then one attention.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, L, C) image tokens; encoder_hidden_states (B, T, C) text tokens;
        attention_mask (B, T) bool or None; image_rotary_emb (B, 1, L, D/2, 2, 2) or None -> (B, L, C)."""
        if encoder_hidden_states is None:
            raise ValueError("FusedPRXAttnProcessor requires 'encoder_hidden_states' containing text tokens.")
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[-1] != encoder_hidden_states.shape[1]
        ):
            raise ValueError(f"Unsupported attention_mask shape: {tuple(attention_mask.shape)}")
        out = torch.ops.prx_compile.prx_attention(
            attn.img_qkv_proj(hidden_states),
            attn.txt_kv_proj(encoder_hidden_states),
            None if attention_mask is None else attention_mask.bool(),
            image_rotary_emb,
            attn.norm_q.weight,
            attn.norm_k.weight,
            attn.norm_added_k.weight,
            attn.heads,
            float(attn.norm_q.eps),
            1.0 / math.sqrt(attn.head_dim),
        )
        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:
            out = attn.to_out[1](out)
        return out


def _fusable(attn: torch.nn.Module) -> str | None:
    """Why this attention module cannot take the fused processor (None when it can)."""
    proc = getattr(attn, "processor", None)
    if type(proc).__name__ != "PRXAttnProcessor2_0":
        return f"its processor is {type(proc).__name__}, not diffusers' PRXAttnProcessor2_0"
    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_k")]
    if any(getattr(n, "weight", None) is None or getattr(n, "bias", None) is not None for n in norms):
        return "its QK norms are not RMSNorm with a weight and no bias"
    if len({float(n.eps) for n in norms}) != 1:
        return "its QK norms use different eps"
    return None


def fused_attention_processors(
    model: torch.nn.Module, enabled: bool = True
) -> contextlib.AbstractContextManager[int]:
    """Within the block, every fusable PRX attention of ``model`` runs ``FusedPRXAttnProcessor``
    (none with ``enabled`` false).

    Yields how many modules were swapped; modules that do not fit (a custom processor, norms with a
    bias) keep theirs, logged at debug level. The original processors are restored on exit.
    """
    if not enabled:
        return contextlib.nullcontext(0)
    return swapped_processors(model, "PRXAttention", FusedPRXAttnProcessor(), _fusable)


class PRXSpec(ModelSpec):
    name = "prx"
    class_name = "PRXTransformer2DModel"
    blocks = (BlockList("blocks", ("hidden_states",)),)
    block_linears = re.compile(
        r"^blocks\.\d+\.(attention\.img_qkv_proj|attention\.txt_kv_proj|attention\.to_out\.0|"
        r"gate_proj|up_proj|down_proj)$"
    )
    defaults = {"batch": [1, 2], "text_len": [1, 256], "resolution": 1024, "vae_scale_factor": 8}
    size_keys = {"depth": 256}
    tiny = TINY

    @property
    def bins(self) -> dict[int, list[tuple[int, int]]]:  # read from diffusers when first asked
        return _pipeline_bins()

    def defaults_for(self, model_config: Any) -> dict[str, Any]:
        """PRXPixel (``in_channels=3``: pixel space) has no VAE and its own 1024 bins."""
        if _is_pixel(model_config):
            return {**self.defaults, "vae_scale_factor": 1, "aspect_bins": [1024]}
        return {**self.defaults, "aspect_bins": [1024]}

    def aspect_sizes(self, family: int, model_config: Any = None) -> list[tuple[int, int]]:
        bins = _pixel_bins() if model_config is not None and _is_pixel(model_config) else self.bins
        if family not in bins:
            raise ConfigError(
                f"aspect_bins: {family} is not a PRX bin family.",
                f"use one of {sorted(bins)}, or [] for the square resolution only.",
            )
        return list(bins[family])

    def config_problem(self, model_config: Any) -> str | None:
        axes = model_config.axes_dim  # one RoPE axis per id column (row, column); None: [32, 32]
        if axes is not None and not (
            isinstance(axes, (list, tuple))
            and len(axes) == 2
            and all(type(a) is int and a > 0 and a % 2 == 0 for a in axes)
        ):
            return f"axes_dim={axes!r:.60} must be 2 positive even sizes"
        return None

    def multiple(self, model_config: Any) -> int:
        return int(model_config.patch_size)

    def point_of_pixels(self, height, width, vae_scale_factor, model_config):
        return height // vae_scale_factor, width // vae_scale_factor

    def inputs(self, model):
        return INPUTS

    def arguments(self, model, bound):
        if bound.get("attention_kwargs"):
            raise ConfigError(
                f"attention_kwargs {sorted(bound['attention_kwargs'])} are not supported by a compiled "
                "transformer.",
                "pass attention_kwargs=None; a LoRA's scale is set with set_lora(pipe, name, scale).",
            )
        cfg = model.config
        hs = check_tensor("hidden_states", bound.get("hidden_states"))
        ehs = check_tensor("encoder_hidden_states", bound.get("encoder_hidden_states"))
        mask = bound.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ShapeOutOfRangeError(f"attention_mask must be a tensor or None, got {type(mask).__name__}.")
        problems = []
        if hs.dim() != 4 or hs.shape[1] != cfg.in_channels:
            problems.append(
                f"hidden_states has shape {tuple(hs.shape)}, expected (B, {cfg.in_channels}, H, W)"
            )
        if ehs.dim() != 3 or ehs.shape[2] != cfg.context_in_dim:
            problems.append(
                f"encoder_hidden_states has shape {tuple(ehs.shape)}, expected (B, T, {cfg.context_in_dim})"
            )
        if not problems and min(*hs.shape, *ehs.shape) < 1:
            problems.append(
                f"empty input: hidden_states {tuple(hs.shape)}, encoder_hidden_states {tuple(ehs.shape)}"
            )
        if not problems and ehs.shape[0] != hs.shape[0]:
            problems.append(f"encoder_hidden_states has batch {ehs.shape[0]}, hidden_states {hs.shape[0]}")
        if not problems and mask is not None and tuple(mask.shape) != tuple(ehs.shape[:2]):
            problems.append(f"attention_mask has shape {tuple(mask.shape)}, expected {tuple(ehs.shape[:2])}")
        if problems:
            raise ShapeOutOfRangeError("; ".join(problems) + ".", "pass the inputs PRXPipeline passes.")
        b = hs.shape[0]
        timestep = batch_vector("timestep", bound.get("timestep"), b, hs.device)
        if mask is None:  # all-True mask == no mask, exactly; keeps one build for both
            mask = torch.ones(ehs.shape[:2], dtype=torch.bool, device=ehs.device)
        return {
            "hidden_states": hs,
            "timestep": timestep,
            "encoder_hidden_states": ehs,
            "attention_mask": mask.bool(),
        }

    def point(self, inputs):
        b, _, h, w = inputs["hidden_states"].shape
        return b, h, w, inputs["encoder_hidden_states"].shape[1]

    def example_inputs(
        self, model, batch, height, width, text, *, dtype=torch.float32, device="cpu", masked_tokens=0, seed=0
    ):
        """hidden_states (B, C, H, W); timestep (B,) in [0, 1]; encoder_hidden_states (B, T, context_in_dim);
        attention_mask (B, T) bool with the last ``masked_tokens`` of every other row padded out (row 0
        keeps all tokens when B > 1, so one row is unmasked and one masked)."""
        config = model.config
        g = torch.Generator().manual_seed(seed)
        kw = {
            "hidden_states": torch.randn(batch, config.in_channels, height, width, generator=g),
            "timestep": torch.rand(batch, generator=g),
            "encoder_hidden_states": torch.randn(batch, text, config.context_in_dim, generator=g),
        }
        mask = torch.ones(batch, text, dtype=torch.bool)
        if masked_tokens:
            start = 1 if batch > 1 else 0
            mask[start::2, text - masked_tokens :] = False
        kw["attention_mask"] = mask
        return {
            k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
            for k, v in kw.items()
        }

    def axes(self, model):
        return {
            "hidden_states": {0: "batch", 2: "height", 3: "width"},
            "timestep": {0: "batch"},
            "encoder_hidden_states": {0: "batch", 1: "text"},
            "attention_mask": {0: "batch", 1: "text"},
        }

    def export_context(self, model):
        return shape_generic_position_ids()

    def fused_attention(self, model):
        return fused_attention_processors(model)

    def step_tokens(self, model, inputs):
        b, _, h, w = inputs["hidden_states"].shape
        p = model.config.patch_size
        return b, (h // p) * (w // p), inputs["encoder_hidden_states"].shape[1]

    def attention_dims(self, model):
        heads = model.config.num_heads
        return heads, model.config.hidden_size // heads

    def width(self, model):
        return int(model.config.hidden_size)

    def gate_width(self, model):
        return int(model.blocks[0].gate_proj.weight.shape[0]) if len(model.blocks) else None

    def nondegenerate_(self, model, std=0.02, seed=0):
        """Re-initialise every ``Modulation.lin`` (weight and bias ~ N(0, std)): a freshly built PRX
        is the identity (its modulation gates are 0)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "Modulation":
                    for p in (module.lin.weight, module.lin.bias):
                        p.copy_(torch.randn(p.shape, generator=g) * std)
        return model


def _is_pixel(model_config: Any) -> bool:
    return getattr(model_config, "in_channels", None) == 3 or (
        isinstance(model_config, dict) and model_config.get("in_channels") == 3
    )
