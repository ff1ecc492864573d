"""Models: one spec per diffusers transformer family, everything the backend knows about it.

    spec = spec_for(transformer)      # the spec of a model (or a ConfigError naming the supported classes)

``prx`` (``PRXTransformer2DModel``, PRXPixel included) and ``flux`` (``FluxTransformer2DModel``). The
stages take a spec as an argument; no module outside this folder names a model class or its layers.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import BlockList, ModelSpec
from .flux import FluxSpec
from .prx import PRXSpec

#: every supported family, by short name
SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (PRXSpec(), FluxSpec())}


def supported() -> list[str]:
    """The supported diffusers classes, by name."""
    return [spec.class_name for spec in SPECS.values()]


def spec_for(model: Any) -> ModelSpec:
    """The spec of ``model`` (a diffusers transformer); a ConfigError naming the supported classes."""
    for spec in SPECS.values():
        if spec.matches(model):
            return spec
    raise ConfigError(
        f"{type(model).__name__} is not a transformer prx_compile can compile.",
        f"supported: {', '.join(supported())}.",
    )


def spec_named(name: Any) -> ModelSpec:
    """The spec called ``name`` ("prx", "flux"); a ConfigError listing the names."""
    if not isinstance(name, str) or name not in SPECS:
        raise ConfigError(
            f"model={str(name)[:40]!r} is not a supported model.", f"use one of {sorted(SPECS)}."
        )
    return SPECS[name]


def spec_of_class(class_name: Any) -> ModelSpec:
    """The spec of the diffusers class ``class_name`` (as an artifact records it)."""
    for spec in SPECS.values():
        if spec.class_name == class_name:
            return spec
    raise ConfigError(
        f"{str(class_name)[:60]!r} is not a supported model class.", f"supported: {supported()}."
    )


__all__ = ["BlockList", "ModelSpec", "SPECS", "spec_for", "spec_named", "spec_of_class", "supported"]
