"""prx_compile: a Torch-TensorRT compilation backend for diffusers' PRX transformer.

    pipe.transformer = compile_prx(pipe.transformer)

The public API is this module's ``__all__``.
"""

__version__ = "0.2.0"

from . import ops  # noqa: F401, E402  (registers torch.ops.prx_compile.*)
from .config import CompileConfig  # noqa: E402
from .errors import (  # noqa: E402
    ArtifactError,
    BackendUnavailableError,
    ConfigError,
    LoRAError,
    PRXCompileError,
    ShapeOutOfRangeError,
)
from .lora import load_lora, set_lora, unload_lora  # noqa: E402
from .module import CompiledTransformer, compile_prx  # noqa: E402
from .saving import inspect_artifact, load_compiled, save_compiled  # noqa: E402

__all__ = [
    "compile_prx",
    "CompiledTransformer",
    "CompileConfig",
    "save_compiled",
    "load_compiled",
    "inspect_artifact",
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
