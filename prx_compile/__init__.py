"""prx_compile: a Torch-TensorRT compilation backend for diffusers' DiT transformers (PRX, FLUX.1).

    pipe.transformer = compile_transformer(pipe.transformer)   # compile_prx for a PRX transformer

The public API is this module's ``__all__``. The applications built on it (the ``prx-compile``
command, ``prx_compile.tools.generate.generate_images``, the benchmark harness, the pipeline loader and
the test fixtures) live in ``prx_compile.tools``, which the library never imports.
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
from .io.saving import artifact_digest, inspect_artifact, load_compiled, save_compiled
from .lora import load_lora, set_lora, unload_lora
from .runtime.module import CompiledTransformer, compile_prx, compile_transformer

__all__ = [
    "__version__",
    "compile_transformer",
    "compile_prx",
    "CompiledTransformer",
    "CompileConfig",
    "save_compiled",
    "artifact_digest",
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
