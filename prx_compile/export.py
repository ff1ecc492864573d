"""Export a PRX transformer with dynamic batch, latent size and text length.

diffusers' ``get_image_ids`` fills a zeros tensor by index assignment, which breaks export with
dynamic height/width on some torch versions. ``shape_generic_position_ids`` swaps in a formulation
built from ``arange``/``expand``/``stack`` that gives the same values for every shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim


def image_ids(
    batch_size: int, height: int, width: int, patch_size: int, device: torch.device
) -> torch.Tensor:
    """(batch, (H/p)*(W/p), 2) float32 (row, col) patch coordinates — same values as diffusers'."""
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


@dataclass(frozen=True)
class ShapeRange:
    """Inclusive ranges the compiled module accepts.

    batch: transformer batch (classifier-free guidance doubles the prompt batch).
    height, width: latent size, multiples of ``multiple`` (the patch size).
    text: text tokens.
    opt_*: the point TensorRT tunes for.
    """

    batch: tuple[int, int]
    height: tuple[int, int]
    width: tuple[int, int]
    text: tuple[int, int]
    multiple: int = 2
    opt_batch: int | None = None
    opt_height: int | None = None
    opt_width: int | None = None
    opt_text: int | None = None

    def problems(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> list[str]:
        """Why these inputs fall outside the range (empty list when they fit)."""
        b, _, h, w = hidden_states.shape
        t = encoder_hidden_states.shape[1]
        out = []
        for name, v, (lo, hi) in (
            ("batch", b, self.batch),
            ("latent height", h, self.height),
            ("latent width", w, self.width),
            ("text length", t, self.text),
        ):
            if not lo <= v <= hi:
                out.append(f"{name} {v} not in [{lo}, {hi}]")
        for name, v in (("latent height", h), ("latent width", w)):
            if v % self.multiple:
                out.append(f"{name} {v} is not a multiple of the patch size {self.multiple}")
        return out

    def is_static(self) -> bool:
        return all(lo == hi for lo, hi in (self.batch, self.height, self.width, self.text))

    def describe(self) -> str:
        return (
            f"batch {self.batch[0]}..{self.batch[1]}, latent {self.height[0]}..{self.height[1]} x "
            f"{self.width[0]}..{self.width[1]} (multiples of {self.multiple}), "
            f"text {self.text[0]}..{self.text[1]} tokens"
        )

    def dynamic_shapes(self) -> dict[str, Any]:
        """torch.export ``dynamic_shapes`` for PRX's forward kwargs (static dims left out)."""
        m = self.multiple

        def dim(name: str, lo: int, hi: int, mult: int = 1):
            if lo == hi:
                return None
            if mult == 1:
                return Dim(name, min=lo, max=hi)
            return mult * Dim(name, min=lo // mult, max=hi // mult)

        b = dim("batch", *self.batch)
        h = dim("latent_h", *self.height, m)
        w = dim("latent_w", *self.width, m)
        t = dim("text_len", *self.text)

        def axes(*pairs):
            return {i: d for i, d in pairs if d is not None}

        return {
            "hidden_states": axes((0, b), (2, h), (3, w)),
            "timestep": axes((0, b)),
            "encoder_hidden_states": axes((0, b), (1, t)),
            "attention_mask": axes((0, b), (1, t)),
        }

    def opt_point(self) -> tuple[int, int, int, int]:
        """(batch, height, width, text) TensorRT optimises for."""
        return (
            self.opt_batch or self.batch[1],
            self.opt_height or self.height[1],
            self.opt_width or self.width[1],
            self.opt_text or self.text[1],
        )


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


def export_prx(model: torch.nn.Module, kwargs: dict[str, torch.Tensor], shapes: ShapeRange | None = None):
    """``torch.export`` PRX (non-strict) with shape-generic position ids and ``return_dict=False``."""
    dyn = None
    if shapes is not None and not shapes.is_static():
        dyn = {**shapes.dynamic_shapes(), "return_dict": None}
        dyn = {k: v for k, v in dyn.items() if k in kwargs or k == "return_dict"}
    with shape_generic_position_ids(), torch.no_grad():
        return torch.export.export(
            model, (), {**kwargs, "return_dict": False}, dynamic_shapes=dyn, strict=False
        )
