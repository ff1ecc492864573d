"""FLUX.1 (``diffusers.FluxTransformer2DModel``): 19 double-stream and 38 single-stream blocks (12 B
parameters as FLUX.1-dev, ``guidance_embeds=True``; FLUX.1-schnell has no guidance embedding).

A step: hidden_states (B, L, C) packed latents (L = (H/16)(W/16) image tokens for an H x W image),
encoder_hidden_states (B, T, joint_attention_dim), pooled_projections (B, pooled_projection_dim),
timestep (B,) (FluxPipeline passes t / 1000), img_ids (L, 3), txt_ids (T, 3) position ids, guidance (B,)
(with ``guidance_embeds``) -> (B, L, C). The step's shape range counts image tokens
(``ShapeRange.tokens``): the engines depend on L, not on the grid the ids describe.

Its attention (``FluxAttnProcessor``: projections, RMSNorm of queries and keys, RoPE, SDPA) keeps
everything but the attention itself in the graph (TensorRT runs the norms and RoPE between the GEMMs);
the attention runs as one ``prx_compile::attention`` op in (B, L, H, D) layout
(``FusedFluxAttnProcessor``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from typing import Any

import torch

from ..errors import ConfigError, ShapeOutOfRangeError
from .base import BlockList, ModelSpec, batch_vector, check_tensor, grid_of, swapped_processors

logger = logging.getLogger(__name__)

#: A FLUX small enough for CPU tests: 2 double and 2 single blocks, 2 heads of 16, guidance embedding.
TINY: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 24,
    "guidance_embeds": True,
    "axes_dims_rope": [4, 6, 6],
}

#: FLUX.1-dev: diffusers' defaults with the guidance embedding.
DEV: dict[str, Any] = {"guidance_embeds": True}

#: Common FLUX sizes (multiples of 16 px, about one megapixel), by family.
BINS: dict[int, list[tuple[int, int]]] = {
    1024: [
        (1024, 1024),
        (1152, 896),
        (896, 1152),
        (1216, 832),
        (832, 1216),
        (1344, 768),
        (768, 1344),
        (1536, 640),
        (640, 1536),
    ],
}

_BLOCK_LINEARS = (
    r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)|"
    r"ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
)
_SINGLE_LINEARS = r"single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)"


class FusedFluxAttnProcessor:
    """diffusers' ``FluxAttnProcessor`` with everything between the projections and ``to_out`` as
    one ``prx_compile::flux_attention`` op: the q/k norms, the text-first concatenation, RoPE and the
    attention (the projections stay linears, reading the live weights). ``kernel``: the attention
    kernel it names ("sdpa"; the lowering rule ``dense_attention`` sets the engine set's choice)."""

    def __init__(self, kernel: str = "sdpa") -> None:
        self.kernel = kernel

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """hidden_states (B, L, C); encoder_hidden_states (B, T, C) or None (single blocks);
        image_rotary_emb (cos, sin), each (T + L, D) -> (B, L, C), and (B, T, C) with text."""
        if attention_mask is not None:
            raise ValueError("FusedFluxAttnProcessor takes no attention mask (FLUX passes none).")
        text = attn.added_kv_proj_dim is not None
        if text and encoder_hidden_states is None:
            raise ValueError("this FLUX attention needs encoder_hidden_states (its text tokens).")
        e = encoder_hidden_states
        cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
        out = torch.ops.prx_compile.flux_attention(
            attn.to_q(hidden_states),
            attn.to_k(hidden_states),
            attn.to_v(hidden_states),
            attn.add_q_proj(e) if text else None,
            attn.add_k_proj(e) if text else None,
            attn.add_v_proj(e) if text else None,
            attn.norm_q.weight,
            attn.norm_k.weight,
            attn.norm_added_q.weight if text else None,
            attn.norm_added_k.weight if text else None,
            cos,
            sin,
            attn.heads,
            float(attn.norm_q.eps),
            1.0 / math.sqrt(attn.head_dim),
            self.kernel,
        )
        if e is None:  # as diffusers: single blocks return the whole sequence
            return out
        t = e.shape[1]
        context, out = out[:, :t], out[:, t:]  # slices, not split: TensorRT splits no dynamic axis
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(context.contiguous())


def _fusable(attn: torch.nn.Module) -> str | None:
    proc = getattr(attn, "processor", None)
    if type(proc).__name__ != "FluxAttnProcessor":
        return f"its processor is {type(proc).__name__}, not diffusers' FluxAttnProcessor"
    if getattr(attn, "fused_projections", False):
        return "its projections are fused (fuse_qkv_projections)"
    names = ["norm_q", "norm_k"]
    if attn.added_kv_proj_dim is not None:
        names += ["norm_added_q", "norm_added_k"]
    norms = [getattr(attn, n, None) for n in names]
    if not all(isinstance(n, torch.nn.RMSNorm) and n.weight is not None and n.eps is not None for n in norms):
        return "its q/k norms are not torch.nn.RMSNorm with a weight and an epsilon"
    if len({n.eps for n in norms}) != 1:
        return "its q/k norms have different epsilons"
    return None


def fused_attention_processors(model: torch.nn.Module) -> contextlib.AbstractContextManager[int]:
    """Within the block, every FLUX attention that runs diffusers' processor runs
    ``FusedFluxAttnProcessor``; yields how many; restored on exit."""
    return swapped_processors(model, "FluxAttention", FusedFluxAttnProcessor(), _fusable)


class FluxSpec(ModelSpec):
    name = "flux"
    class_name = "FluxTransformer2DModel"
    blocks = (
        BlockList("transformer_blocks", ("encoder_hidden_states", "hidden_states")),
        BlockList("single_transformer_blocks", ("encoder_hidden_states", "hidden_states")),
    )
    block_linears = re.compile(rf"^({_BLOCK_LINEARS}|{_SINGLE_LINEARS})$")
    tokens = True
    dtype_inputs = ("hidden_states", "encoder_hidden_states", "pooled_projections")
    defaults = {"batch": [1, 1], "text_len": [512, 512], "resolution": 1024, "vae_scale_factor": 8}
    bins = BINS
    size_keys = {"num_layers": 256, "num_single_layers": 256}
    tiny = TINY

    def defaults_for(self, model_config: Any) -> dict[str, Any]:
        return {**self.defaults, "aspect_bins": []}

    def multiple(self, model_config: Any) -> int:
        return 1

    def config_problem(self, model_config: Any) -> str | None:
        axes = model_config.axes_dims_rope  # one RoPE axis per id column (text/index, row, column)
        head = model_config.attention_head_dim
        if not (
            isinstance(axes, (list, tuple))
            and len(axes) == 3
            and all(type(a) is int and a > 0 and a % 2 == 0 for a in axes)
            and sum(axes) == head
        ):
            return f"axes_dims_rope={axes!r:.60} must be 3 positive even sizes summing to {head}"
        return None

    def point_of_pixels(self, height, width, vae_scale_factor, model_config):
        px = 2 * vae_scale_factor  # latents are packed 2x2
        if height % px or width % px:
            raise ConfigError(
                f"{height}x{width} px: FLUX sizes must be multiples of {px} px (vae_scale_factor "
                f"{vae_scale_factor}, latents packed 2x2)."
            )
        return (height // px) * (width // px), 1

    def inputs(self, model):
        names = (
            "hidden_states",
            "encoder_hidden_states",
            "pooled_projections",
            "timestep",
            "img_ids",
            "txt_ids",
        )
        return names + (("guidance",) if model.config.guidance_embeds else ())

    def batched(self, name):
        return name not in ("img_ids", "txt_ids")

    def arguments(self, model, bound):
        unsupported = [
            k
            for k in ("controlnet_block_samples", "controlnet_single_block_samples")
            if bound.get(k) is not None
        ]
        if bound.get("controlnet_blocks_repeat"):
            unsupported.append("controlnet_blocks_repeat")
        if unsupported:
            raise ConfigError(
                f"{', '.join(unsupported)}: ControlNet residuals are not supported by a compiled "
                "transformer.",
                "run the ControlNet pipeline with the eager transformer.",
            )
        if bound.get("joint_attention_kwargs"):
            raise ConfigError(
                f"joint_attention_kwargs {sorted(bound['joint_attention_kwargs'])} are not supported by a "
                "compiled transformer.",
                "pass none; a LoRA's scale is set with pipe.set_adapters(name, adapter_weights=scale), which "
                "merges it once rather than at every call.",
            )
        cfg = model.config
        hs = check_tensor("hidden_states", bound.get("hidden_states"))
        ehs = check_tensor("encoder_hidden_states", bound.get("encoder_hidden_states"))
        pooled = check_tensor("pooled_projections", bound.get("pooled_projections"))
        problems = []
        if hs.dim() != 3 or hs.shape[2] != cfg.in_channels:
            problems.append(f"hidden_states has shape {tuple(hs.shape)}, expected (B, L, {cfg.in_channels})")
        if ehs.dim() != 3 or ehs.shape[2] != cfg.joint_attention_dim:
            problems.append(
                f"encoder_hidden_states has shape {tuple(ehs.shape)}, expected "
                f"(B, T, {cfg.joint_attention_dim})"
            )
        if pooled.dim() != 2 or pooled.shape[1] != cfg.pooled_projection_dim:
            problems.append(
                f"pooled_projections has shape {tuple(pooled.shape)}, expected "
                f"(B, {cfg.pooled_projection_dim})"
            )
        if not problems and min(*hs.shape, *ehs.shape) < 1:
            problems.append(
                f"empty input: hidden_states {tuple(hs.shape)}, encoder_hidden_states {tuple(ehs.shape)}"
            )
        if not problems and not ehs.shape[0] == pooled.shape[0] == hs.shape[0]:
            problems.append(
                f"batch: hidden_states {hs.shape[0]}, encoder_hidden_states {ehs.shape[0]}, "
                f"pooled_projections {pooled.shape[0]}"
            )
        ids = {}
        for name, length in (("img_ids", hs.shape[1] if hs.dim() == 3 else -1), ("txt_ids", ehs.shape[1])):
            v = check_tensor(name, bound.get(name))
            if v.dim() == 3:  # diffusers' deprecated batched form: it takes the first row too
                v = v[0]
            if v.dim() != 2 or v.shape != (length, 3):
                problems.append(f"{name} has shape {tuple(bound[name].shape)}, expected ({length}, 3)")
            ids[name] = v
        if problems:
            raise ShapeOutOfRangeError("; ".join(problems) + ".", "pass the inputs FluxPipeline passes.")
        b = hs.shape[0]
        out = {
            "hidden_states": hs,
            "encoder_hidden_states": ehs,
            "pooled_projections": pooled,
            "timestep": batch_vector("timestep", bound.get("timestep"), b, hs.device),
            "img_ids": ids["img_ids"].float(),  # the model reads them as float32 (exact)
            "txt_ids": ids["txt_ids"].float(),
        }
        guidance = bound.get("guidance")
        if cfg.guidance_embeds:
            if guidance is None:
                raise ShapeOutOfRangeError(
                    "guidance is None, and this FLUX transformer has a guidance embedding (FLUX.1-dev).",
                    "pass guidance (FluxPipeline does: guidance_scale).",
                )
            out["guidance"] = batch_vector("guidance", guidance, b, hs.device)
        elif guidance is not None:
            raise ShapeOutOfRangeError(
                "guidance was given, and this FLUX transformer has no guidance embedding "
                "(guidance_embeds=False)."
            )
        return out

    def point(self, inputs):
        b, tokens, _ = inputs["hidden_states"].shape
        return b, tokens, 1, inputs["encoder_hidden_states"].shape[1]

    def example_inputs(
        self, model, batch, height, width, text, *, dtype=torch.float32, device="cpu", masked_tokens=0, seed=0
    ):
        """FluxPipeline's inputs for ``height`` image tokens (``width`` must be 1) and ``text`` text
        tokens: random latents and text, img_ids of a grid as square as ``height`` allows, zero
        txt_ids, timestep in [0, 1], guidance 3.5. ``masked_tokens`` does not apply (no text mask)."""
        if width != 1:
            raise ValueError(f"FLUX example inputs count image tokens: width must be 1, got {width}")
        cfg = model.config
        g = torch.Generator().manual_seed(seed)
        rows, cols = grid_of(height)
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1] = torch.arange(rows)[:, None]
        ids[..., 2] = torch.arange(cols)[None, :]
        kw = {
            "hidden_states": torch.randn(batch, height, cfg.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(batch, text, cfg.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(batch, cfg.pooled_projection_dim, generator=g),
            "timestep": torch.rand(batch, generator=g),
            "img_ids": ids.reshape(height, 3),
            "txt_ids": torch.zeros(text, 3),
        }
        if cfg.guidance_embeds:
            kw["guidance"] = torch.full((batch,), 3.5)
        floats = ("hidden_states", "encoder_hidden_states", "pooled_projections")
        return {k: v.to(device=device, dtype=dtype if k in floats else torch.float32) for k, v in kw.items()}

    def axes(self, model):
        out = {
            "hidden_states": {0: "batch", 1: "height"},
            "encoder_hidden_states": {0: "batch", 1: "text"},
            "pooled_projections": {0: "batch"},
            "timestep": {0: "batch"},
            "img_ids": {0: "height"},
            "txt_ids": {0: "text"},
        }
        if model.config.guidance_embeds:
            out["guidance"] = {0: "batch"}
        return out

    def fused_attention(self, model):
        return fused_attention_processors(model)

    attention = "dense"

    def step_tokens(self, model, inputs):
        b, tokens, _ = inputs["hidden_states"].shape
        return b, tokens, inputs["encoder_hidden_states"].shape[1]

    def attention_dims(self, model):
        return int(model.config.num_attention_heads), int(model.config.attention_head_dim)

    def width(self, model):
        return int(model.config.num_attention_heads * model.config.attention_head_dim)

    def convert_lora(self, state_dict):
        """kohya's FLUX files (sd-scripts) name the original model's layers, with q, k and v (and, in
        the single blocks, the MLP's input) fused in one matrix: ``lora_unet_double_blocks_0_img_attn_qkv``.
        Each becomes diffusers' layers: the shared down matrix, the up matrix's rows split by the
        layers' widths (read from the model's config), alpha kept. Other layouts pass as they are."""
        if not any(
            k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in state_dict
        ):
            return state_dict
        return _kohya_to_diffusers(state_dict)


#: kohya (BFL) layer name -> diffusers' module(s) it stands for, by block ("{i}")
_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "txt_mod_lin": ("norm1_context.linear",),
}
_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer_linear": "proj_out",
}
_KOHYA_KEY = re.compile(r"^lora_unet_(?P<layer>.+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha)$")
_BLOCK = re.compile(r"^(?P<kind>double|single)_blocks_(?P<i>\d+)_(?P<name>.+)$")


def _kohya_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """See ``FluxSpec.convert_lora``. Keys it does not know pass unchanged (``parse_lora`` reports
    them, or refuses them with ``strict``); a fused up matrix split into parts it does not divide
    evenly (q, k, v of one width, the MLP the rest) is a ValueError."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        m = _KOHYA_KEY.match(key)
        block = _BLOCK.match(m["layer"]) if m else None
        if block is not None:
            double = block["kind"] == "double"
            blocks = "transformer_blocks" if double else "single_transformer_blocks"
            names = (_DOUBLE if double else _SINGLE).get(block["name"], ())
            targets = [f"{blocks}.{block['i']}.{name}" for name in names]
        elif m is not None and m["layer"] in _TOP:
            targets = [_TOP[m["layer"]]]
        else:
            targets = []
        if not targets:
            out[key] = t
            continue
        part = m["part"]
        if part == "lora_up.weight" and len(targets) > 1:
            down = state_dict.get(key.replace("lora_up.weight", "lora_down.weight"))
            if t.dim() != 2 or not isinstance(down, torch.Tensor) or down.dim() != 2:
                raise ValueError(f"{key} and its lora_down must be matrices")
            rows, width = t.shape[0], down.shape[1]  # q, k and v are as wide as the layer's input
            sizes = [width] * 3 + ([rows - 3 * width] if len(targets) == 4 else [])
            if sum(sizes) != rows or min(sizes) < 1:
                raise ValueError(f"{key}: {rows} rows do not split into {targets} ({sizes})")
            for target, piece in zip(targets, t.split(sizes), strict=True):
                out[f"transformer.{target}.lora_B.weight"] = piece.contiguous()
            continue
        name = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight", "alpha": "alpha"}[
            part
        ]
        for target in targets:
            out[f"transformer.{target}.{name}"] = t
    return out
