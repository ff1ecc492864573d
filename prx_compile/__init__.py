"""prx_compile: a Torch-TensorRT compilation backend for diffusers' PRX transformer.

pipe.transformer = compile_prx(pipe.transformer)
"""

from . import ops  # noqa: F401  (registers torch.ops.prx_compile.*)
from .config import CompileConfig
from .errors import (
    ArtifactError,
    BackendUnavailableError,
    ConfigError,
    LoRAError,
    PRXCompileError,
    ShapeOutOfRangeError,
)
from .module import CompiledTransformer, compile_prx
from .serialization import load_compiled, save_compiled

__version__ = "0.1.0"

__all__ = [
    "compile_prx",
    "CompiledTransformer",
    "CompileConfig",
    "save_compiled",
    "load_compiled",
    "PRXCompileError",
    "ConfigError",
    "BackendUnavailableError",
    "ShapeOutOfRangeError",
    "LoRAError",
    "ArtifactError",
]
