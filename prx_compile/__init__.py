"""prx_compile: a Torch-TensorRT compilation backend for diffusers' PRX transformer.

    pipe.transformer = compile_prx(pipe.transformer)

``generate_images`` makes PNGs from prompts in one process or many (accelerate). The public API is
this module's ``__all__``.
"""

from . import ops  # noqa: F401  (registers torch.ops.prx_compile.*)
from ._version import __version__
from .config import CompileConfig
from .errors import (
    ArtifactError,
    BackendUnavailableError,
    ConfigError,
    LoRAError,
    PRXCompileError,
    ShapeOutOfRangeError,
)
from .generate import generate_images
from .lora import load_lora, set_lora, unload_lora
from .module import CompiledTransformer, compile_prx
from .saving import artifact_digest, inspect_artifact, load_compiled, save_compiled

__all__ = [
    "__version__",
    "compile_prx",
    "CompiledTransformer",
    "CompileConfig",
    "save_compiled",
    "artifact_digest",
    "load_compiled",
    "inspect_artifact",
    "generate_images",
    "load_lora",
    "set_lora",
    "unload_lora",
    "PRXCompileError",
    "ConfigError",
    "BackendUnavailableError",
    "ShapeOutOfRangeError",
    "LoRAError",
    "ArtifactError",
]
