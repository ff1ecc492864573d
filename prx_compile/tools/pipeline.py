"""``load_pipeline``: a PRXPipeline from a local diffusers folder, on every dependency version we support.

With diffusers 0.42 and transformers 5.x, ``PRXPipeline.from_pretrained`` fails on any PRX folder:
its ``model_index.json`` names the text encoder ``transformers.T5GemmaEncoder``, which transformers no
longer exports at the top level (``transformers.models.t5gemma.modeling_t5gemma.T5GemmaEncoder``), and
diffusers checks that name even for a component passed in. ``load_pipeline`` loads each component with
its own class from an explicit table (safetensors only, local files only) and builds the pipeline.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, excerpt

#: the largest model_index.json read
MAX_INDEX_BYTES = 1 << 16
#: component -> {class name in model_index.json: how to import it}; nothing else is resolved.
COMPONENTS: dict[str, dict[str, tuple[str, str]]] = {
    "transformer": {"PRXTransformer2DModel": ("diffusers", "PRXTransformer2DModel")},
    "scheduler": {"FlowMatchEulerDiscreteScheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")},
    "text_encoder": {"T5GemmaEncoder": ("transformers.models.t5gemma.modeling_t5gemma", "T5GemmaEncoder")},
    "vae": {
        "AutoencoderKL": ("diffusers", "AutoencoderKL"),
        "AutoencoderDC": ("diffusers", "AutoencoderDC"),
    },
}


def load_pipeline(path: str | Path, torch_dtype: torch.dtype | None = None):
    """A PRXPipeline from the diffusers folder ``path`` (model_index.json, transformer/, ...).

    Raises ConfigError naming the missing file or the unexpected component."""
    import importlib

    from diffusers import PRXPipeline
    from transformers import AutoTokenizer

    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(
            f"{root} is not a diffusers PRX folder: model_index.json is missing.",
            "pass the folder that holds model_index.json, transformer/, text_encoder/, ...",
        )
    try:
        with open(index_file, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{index_file} cannot be read ({type(e).__name__}).") from e
    if len(raw) > MAX_INDEX_BYTES:  # a model_index.json is a few hundred bytes
        raise ConfigError(f"{index_file} is more than {MAX_INDEX_BYTES} bytes: not a model index.")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{index_file} is not valid JSON ({type(e).__name__}).") from e
    if not isinstance(index, dict) or index.get("_class_name") != "PRXPipeline":
        raise ConfigError(f"{index_file} does not describe a PRXPipeline.")
    extra = {}
    if "default_sample_size" in index:
        size = index["default_sample_size"]  # diffusers writes null where it was not set
        ok = size is None or (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 4096)
        if not ok:
            raise ConfigError(
                f"{index_file}: default_sample_size {excerpt(size)} is not null or an integer in [1, 4096]."
            )
        extra["default_sample_size"] = size
    parts: dict[str, Any] = {}
    for name in ("transformer", "scheduler", "text_encoder", "tokenizer", "vae"):
        spec = index.get(name)
        if spec is None or spec == [None, None]:
            if name != "vae":
                raise ConfigError(f"{index_file} names no {name}.")
            parts[name] = None
            continue
        if not (isinstance(spec, list) and len(spec) == 2 and all(isinstance(s, str) for s in spec)):
            raise ConfigError(f"{index_file}: {name} must be [library, class].")
        sub = root / name
        if not sub.is_dir():
            raise ConfigError(f"{sub} is missing.", "the folder is incomplete: download it again.")
        cls_name = spec[1]
        if name == "tokenizer":  # AutoTokenizer reads the class from the folder (no remote code)
            parts[name] = AutoTokenizer.from_pretrained(str(sub), local_files_only=True)
            continue
        if cls_name not in COMPONENTS[name]:
            raise ConfigError(
                f"{index_file}: {name} class {cls_name!r} is not one PRX uses.",
                f"expected one of {sorted(COMPONENTS[name])}.",
            )
        module, attr = COMPONENTS[name][cls_name]
        cls = getattr(importlib.import_module(module), attr)
        if name == "scheduler":
            parts[name] = cls.from_pretrained(str(sub), local_files_only=True)
        else:  # weights from safetensors only
            kw = {"torch_dtype": torch_dtype, "local_files_only": True, "use_safetensors": True}
            parts[name] = cls.from_pretrained(str(sub), **kw)
    with quiet_lora_mixin():
        return PRXPipeline(**parts, **extra)


@contextlib.contextmanager
def quiet_lora_mixin():
    """Within the block, diffusers' FutureWarning that ``LoraLoaderMixin`` (which PRXPipeline's
    constructor goes through) is deprecated is not shown: it is about diffusers' own code and asks
    nothing of the user. Every other warning is."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*LoraLoaderMixin.* is deprecated", category=FutureWarning
        )
        yield
