"""Exceptions raised by prx_compile. Each message says what is wrong and what to do next."""

from __future__ import annotations


class PRXCompileError(Exception):
    """Base class of every error prx_compile raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message if not hint else f"{message} Hint: {hint}")
        self.hint = hint


class ConfigError(PRXCompileError, ValueError):
    """A configuration key or value is invalid (the message names the key and the allowed values)."""


class BackendUnavailableError(PRXCompileError, RuntimeError):
    """The requested backend cannot run here (no GPU, or Torch-TensorRT is not installed)."""


class ShapeOutOfRangeError(PRXCompileError, ValueError):
    """An input shape lies outside the range the compiled module was built for."""


class LoRAError(PRXCompileError, ValueError):
    """A LoRA file or state dict cannot be applied; the model is left exactly as it was."""


class ArtifactError(PRXCompileError, RuntimeError):
    """A saved artifact is missing, corrupted, tampered with, or was built for another GPU/version."""
