"""Exceptions raised by prx_compile. Each message says what is wrong and what to do next."""

from __future__ import annotations

import reprlib
from typing import Any

#: The most characters of an offending value an error message shows (``excerpt``).
EXCERPT_CHARS = 80


class PRXCompileError(Exception):
    """Base class of every error prx_compile raises on purpose."""

    hint: str = ""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message if not hint else f"{message} Hint: {hint}")
        self.message = message
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


class _BoundedRepr(reprlib.Repr):
    """``reprlib.Repr`` that also bounds big integers (``repr(10**5000)`` raises, and a 4000-digit
    one is no help in a message)."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, limit, limit, limit
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 8

    def repr_int(self, x, level):
        if x.bit_length() > 4 * self.maxlong:
            return f"<{x.bit_length()}-bit int>"
        return super().repr_int(x, level)


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, in time and memory bounded whatever
    ``value`` is (a list of a billion items, a 10**5000 integer, a 1 GB string): what an error
    message shows of an offending value. Text (``str`` of an exception) is better cut with
    ``one_line``."""
    try:
        s = _BoundedRepr(limit).repr(value)
    except Exception:  # a repr of a foreign object that raises
        s = f"<{type(value).__name__}>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def one_line(text: Any, limit: int = 200) -> str:
    """``str(text)`` on one line (whitespace runs made one space), at most ``limit`` characters."""
    s = " ".join(str(text)[: 4 * limit].split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
