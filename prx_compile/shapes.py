"""``ShapeRange``: the inclusive shape ranges an engine set accepts (batch, latent height and width or
image tokens, text length) and its JSON form.

The plan, export, the backends, the runtime and the artifacts all speak in ShapeRanges; a model's spec
says which tensor axes they stand for (``ModelSpec.dynamic_shapes``). This module depends on nothing of
theirs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from . import schema
from .errors import excerpt


@dataclass(frozen=True)
class ShapeRange:
    """Inclusive ranges one engine set accepts.

    batch: transformer batch (classifier-free guidance doubles the prompt batch).
    height, width: latent size, multiples of ``multiple`` (the patch size).
    text: text tokens.
    opt_*: the point TensorRT tunes for (default: the maxima).
    tokens: the image axis counts packed image tokens (FLUX): ``height`` is their number, ``width``
        is 1 and ``multiple`` 1.
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
    tokens: bool = False

    @classmethod
    def static(
        cls, batch: int, height: int, width: int, text: int, multiple: int = 2, tokens: bool = False
    ) -> ShapeRange:
        """The range holding one shape (latent height and width, or image tokens and 1)."""
        return cls((batch, batch), (height, height), (width, width), (text, text), multiple, tokens=tokens)

    def problems(self, batch: int, height: int, width: int, text: int) -> list[str]:
        """Why this shape falls outside the range (empty list when it fits)."""
        out = []
        image = (
            (("image tokens", height, self.height),)
            if self.tokens
            else (
                ("latent height", height, self.height),
                ("latent width", width, self.width),
            )
        )
        for name, v, (lo, hi) in (("batch", batch, self.batch), *image, ("text length", text, self.text)):
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
        if self.tokens:
            b, img, t = (
                f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in (self.batch, self.height, self.text)
            )
            return f"batch {b}, {img} image tokens, text {t} tokens"
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
        if isinstance(data, dict) and "tokens" not in data:  # written before FLUX: a latent grid
            data = {**data, "tokens": False}
        schema.check(_SHAPES, data, "shapes")  # types and bounds; the relations between fields below
        out: dict[str, Any] = {"multiple": data["multiple"], "tokens": data["tokens"]}
        m = out["multiple"]
        for key in ("batch", "height", "width", "text"):
            v = data[key]
            if v[0] > v[1]:
                raise ValueError(f"shapes.{key}={excerpt(v)} must be [min, max] with min <= max")
            if key in ("height", "width") and (v[0] % m or v[1] % m):
                raise ValueError(f"shapes.{key}={excerpt(v)} must be multiples of {m}")
            out[key] = tuple(v)
        if out["tokens"] and (m != 1 or out["width"] != (1, 1) or out["height"][1] > _LIMITS["tokens"]):
            raise ValueError(
                "shapes: a token range has multiple 1, width [1, 1] and at most "
                f"{_LIMITS['tokens']} image tokens"
            )
        if not out["tokens"] and max(out["height"][1], out["width"][1]) > _LIMITS["height"]:
            raise ValueError(f"shapes: latent sizes are at most {_LIMITS['height']}")
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
        """Tokens of the largest step in the range: batch x (image patches or tokens + text)."""
        return self.batch[1] * (self.height[1] * self.width[1] // self.multiple**2 + self.text[1])

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
_LIMITS = {"batch": 256, "height": 2048, "width": 2048, "text": 4096, "tokens": 2**18}
#: the most tokens one step of a set read from disk may have (PRX's default at 1024², batch 2: 8704)
MAX_TOKENS = 2**20


def _shapes_schema() -> schema.Spec:
    def pair(top: int):
        return schema.Tuple(schema.Int(1, top), schema.Int(1, top))

    def opt(top: int):
        return schema.OneOf(schema.Null(), schema.Int(1, top))

    # height holds image tokens in a token range: its bound here is the larger one, checked per kind
    tops = {"batch": 256, "height": _LIMITS["tokens"], "width": 2048, "text": 4096}
    return schema.Dict(
        {
            "multiple": schema.Int(1, 64),
            "tokens": schema.Bool(),
            **{k: pair(top) for k, top in tops.items()},
            **{f"opt_{k}": opt(top) for k, top in tops.items()},
        }
    )


#: a saved ShapeRange: each size an integer from 1 to its limit (``from_dict`` checks the rest)
_SHAPES = _shapes_schema()
