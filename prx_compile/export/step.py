"""Export one PRX transformer step with ``torch.export``: dynamic batch, latent size and text length,
and (with ``weights="inputs"``) the transformer's parameters as graph inputs.

The hooks a PRX export needs are active only inside ``export_prx``:

* diffusers' ``get_image_ids`` fills a zeros tensor by index assignment, which breaks export with
  dynamic height/width; ``shape_generic_position_ids`` swaps in an ``arange``/``expand``/``stack``
  formulation with the same values;
* with ``fuse_attention``, every PRX attention module runs ``FusedPRXAttnProcessor``
  (``prx_compile.fusion``) for the duration of the export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.export import Dim

from . import schema

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


@dataclass(frozen=True)
class ShapeRange:
    """Inclusive ranges one engine set accepts.

    batch: transformer batch (classifier-free guidance doubles the prompt batch).
    height, width: latent size, multiples of ``multiple`` (the patch size).
    text: text tokens.
    opt_*: the point TensorRT tunes for (default: the maxima).
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

    @classmethod
    def static(cls, batch: int, height: int, width: int, text: int, multiple: int = 2) -> ShapeRange:
        """The range holding one shape (latent height and width)."""
        return cls((batch, batch), (height, height), (width, width), (text, text), multiple)

    def problems(self, batch: int, height: int, width: int, text: int) -> list[str]:
        """Why this shape falls outside the range (empty list when it fits)."""
        out = []
        for name, v, (lo, hi) in (
            ("batch", batch, self.batch),
            ("latent height", height, self.height),
            ("latent width", width, self.width),
            ("text length", text, self.text),
        ):
            if not lo <= v <= hi:
                out.append(f"{name} {v} not in [{lo}, {hi}]")
        for name, v in (("latent height", height), ("latent width", width)):
            if v % self.multiple:
                out.append(f"{name} {v} is not a multiple of the patch size {self.multiple}")
        return out

    def fits(self, batch: int, height: int, width: int, text: int) -> bool:
        return not self.problems(batch, height, width, text)

    def volume(self) -> int:
        """How many (batch, height, width, text) points the range holds: smaller is more specific."""
        n = 1
        for lo, hi in (self.batch, self.height, self.width, self.text):
            n *= hi - lo + 1
        return n

    def is_static(self) -> bool:
        return self.volume() == 1

    def describe(self) -> str:
        if self.is_static():
            return (
                f"batch {self.batch[0]}, latent {self.height[0]}x{self.width[0]}, text {self.text[0]} tokens"
            )
        return (
            f"batch {self.batch[0]}..{self.batch[1]}, latent {self.height[0]}..{self.height[1]} x "
            f"{self.width[0]}..{self.width[1]} (multiples of {self.multiple}), "
            f"text {self.text[0]}..{self.text[1]} tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Any) -> ShapeRange:
        """Validated inverse of ``to_dict``; ValueError naming the field on bad data."""
        from .errors import excerpt

        schema.check(_SHAPES, data, "shapes")  # types and bounds; the relations between fields below
        out: dict[str, Any] = {"multiple": data["multiple"]}
        m = out["multiple"]
        for key in ("batch", "height", "width", "text"):
            v = data[key]
            if v[0] > v[1]:
                raise ValueError(f"shapes.{key}={excerpt(v)} must be [min, max] with min <= max")
            if key in ("height", "width") and (v[0] % m or v[1] % m):
                raise ValueError(f"shapes.{key}={excerpt(v)} must be multiples of {m}")
            out[key] = tuple(v)
        for key in ("opt_batch", "opt_height", "opt_width", "opt_text"):
            v = data[key]
            lo, hi = out[key[4:]]
            if v is not None and not lo <= v <= hi:
                raise ValueError(f"shapes.{key}={excerpt(v)} must be null or an integer from {lo} to {hi}")
            if v is not None and key in ("opt_height", "opt_width") and v % m:
                raise ValueError(f"shapes.{key}={v} must be a multiple of {m}")
            out[key] = v
        shapes = cls(**out)
        if shapes.max_tokens() > MAX_TOKENS:
            raise ValueError(
                f"shapes: {shapes.describe()} is {shapes.max_tokens()} tokens a step, more than {MAX_TOKENS}"
            )
        return shapes

    def max_tokens(self) -> int:
        """Tokens of the largest step in the range: batch x (image patches + text)."""
        return self.batch[1] * (self.height[1] * self.width[1] // self.multiple**2 + self.text[1])

    def dynamic_shapes(self) -> dict[str, Any]:
        """torch.export ``dynamic_shapes`` for the activations (static dims left out)."""
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


#: the largest shapes an engine set read from disk may declare (latent pixels for height and width):
#: far beyond PRX's serving sizes, small enough that example inputs cannot take the machine's memory
_LIMITS = {"batch": 256, "height": 2048, "width": 2048, "text": 4096}
#: the most tokens one step of a set read from disk may have (PRX's default at 1024², batch 2: 8704)
MAX_TOKENS = 2**20


def _shapes_schema() -> schema.Spec:
    def pair(top: int):
        return schema.Tuple(schema.Int(1, top), schema.Int(1, top))

    def opt(top: int):
        return schema.OneOf(schema.Null(), schema.Int(1, top))

    return schema.Dict(
        {
            "multiple": schema.Int(1, 64),
            **{k: pair(top) for k, top in _LIMITS.items()},
            **{f"opt_{k}": opt(top) for k, top in _LIMITS.items()},
        }
    )


#: a saved ShapeRange: each size an integer from 1 to its limit (``from_dict`` checks the rest)
_SHAPES = _shapes_schema()


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
) -> tuple[torch.export.ExportedProgram, list[str] | None]:
    """``torch.export`` one PRX step (non-strict) over ``shapes``.

    Args:
        model: a PRXTransformer2DModel in eval mode.
        example: PRX forward kwargs (``ACTIVATIONS``), the shapes' tuning point.
        shapes: dynamic ranges (None or a static range: static shapes).
        weights: "inputs" (parameters and buffers are the graph's ``weights_*`` inputs) or "engine"
            (they are lifted as the program's parameters).
        fuse_attention: export with ``FusedPRXAttnProcessor`` (one ``prx_attention`` op per block).

    Returns:
        (ExportedProgram, the parameter names in ``weights_*`` order, or None for "engine").
    """
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
