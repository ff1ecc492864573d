"""One way to check what is read from disk or from another process: a typed schema, checked whole
before anything uses the data.

    ENGINE_RECORD = Dict({"inputs": List(Str(100), max_len=10_000), "outputs_unowned": Bool()})
    rec = check(ENGINE_RECORD, data, "engine record")  # SchemaError: "engine record.inputs[3]: ..."

Specs (each a small class with ``check(value, path)`` that returns the value or raises):

* ``Int(lo, hi)`` — an int in [lo, hi] (a bool is not an int); ``Float(lo, hi)`` — an int or float,
  finite, in [lo, hi]; ``Bool()``; ``Null()``.
* ``Str(max_len, pattern=None, choices=None, test=None, what=None)`` — a str, at most ``max_len``
  characters, fully matching ``pattern``, one of ``choices``, or passing ``test``.
* ``List(item, max_len, min_len=0)`` — a list of ``item``; ``Tuple(*items)`` — a list of exactly
  those items in order.
* ``Dict(fields, optional=())`` — a dict with exactly the keys of ``fields`` (those in ``optional``
  may be left out), each value checked by its spec.
* ``Map(key, value, max_len)`` — a dict of any keys that pass ``key`` (a ``Str``) with values that
  pass ``value``.
* ``OneOf(*specs)`` — the first spec that accepts the value; ``Later(reader)`` — a part another
  reader checks whole (a Program inside a backend state).

Every size is bounded by the spec, so checking is linear in the data, and nothing is evaluated. A
failure is one ``SchemaError`` (a ValueError) naming the path and what was expected, with an excerpt
of the value; readers turn it into their own error type (``ArtifactError``, ``LoRAError``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

from .errors import excerpt


class SchemaError(ValueError):
    """``path``: where in the data; the message names the path, what was expected and what was there."""

    def __init__(self, path: str, expected: str, value: Any, message: str | None = None):
        self.path = path
        super().__init__(message or f"{path}: expected {expected}, got {excerpt(value, 60)}")


class Spec:
    what = "a value"

    def check(self, v: Any, path: str) -> Any:  # pragma: no cover - every spec overrides it
        raise NotImplementedError

    def fail(self, path: str, v: Any):
        raise SchemaError(path, self.what, v)


class Int(Spec):
    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.what = f"an integer in [{lo}, {hi}]"

    def check(self, v, path):
        if not isinstance(v, int) or isinstance(v, bool) or not self.lo <= v <= self.hi:
            self.fail(path, v)
        return v


class Float(Spec):
    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi
        self.what = f"a finite number in [{lo}, {hi}]"

    def check(self, v, path):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok or (isinstance(v, float) and not math.isfinite(v)) or not self.lo <= v <= self.hi:
            self.fail(path, v)
        return v


class Bool(Spec):
    what = "true or false"

    def check(self, v, path):
        if not isinstance(v, bool):
            self.fail(path, v)
        return v


class Null(Spec):
    what = "null"

    def check(self, v, path):
        if v is not None:
            self.fail(path, v)
        return v


class Str(Spec):
    def __init__(
        self,
        max_len: int,
        pattern: str | None = None,
        choices: tuple[str, ...] | None = None,
        test: Callable[[str], bool] | None = None,
        what: str | None = None,
    ):
        if choices is not None and any(len(c) > max_len for c in choices):  # a spec that refuses its own
            raise ValueError(f"Str({max_len}) cannot hold its choices {list(choices)}")
        self.max_len, self.choices, self.test = max_len, choices, test
        self.pattern = re.compile(pattern) if pattern else None
        self.what = what or (
            f"one of {list(choices)}" if choices else f"a string of at most {max_len} characters"
        )

    def check(self, v, path):
        ok = isinstance(v, str) and len(v) <= self.max_len
        ok = ok and (self.pattern is None or self.pattern.fullmatch(v) is not None)
        ok = ok and (self.choices is None or v in self.choices)
        if not ok or (self.test is not None and not self.test(v)):
            self.fail(path, v)
        return v


class List(Spec):
    def __init__(self, item: Spec, max_len: int, min_len: int = 0):
        self.item, self.max_len, self.min_len = item, max_len, min_len
        self.what = f"a list of {min_len}..{max_len} items"

    def check(self, v, path):
        if not isinstance(v, list) or not self.min_len <= len(v) <= self.max_len:
            self.fail(path, v)
        for i, x in enumerate(v):
            self.item.check(x, f"{path}[{i}]")
        return v


class Tuple(Spec):
    def __init__(self, *items: Spec):
        self.items = items
        self.what = f"a list of {len(items)} items"

    def check(self, v, path):
        if not isinstance(v, list) or len(v) != len(self.items):
            self.fail(path, v)
        for i, (spec, x) in enumerate(zip(self.items, v, strict=True)):
            spec.check(x, f"{path}[{i}]")
        return v


class Dict(Spec):
    def __init__(self, fields: dict[str, Spec], optional: tuple[str, ...] = ()):
        self.fields, self.optional = fields, set(optional)
        self.what = f"a mapping with the keys {sorted(fields)}"

    def check(self, v, path):
        if not isinstance(v, dict):
            self.fail(path, v)
        missing = sorted(set(self.fields) - self.optional - set(v))
        if missing:
            raise SchemaError(f"{path}.{missing[0]}", "", None, f"{path}.{missing[0]} is missing")
        extra = sorted(set(v) - set(self.fields), key=str)
        if extra:
            key = excerpt(extra[0], 60)
            raise SchemaError(path, "", v, f"{path} has the key {key}, not one of {sorted(self.fields)}")
        for key, spec in self.fields.items():
            if key in v:
                spec.check(v[key], f"{path}.{key}")
        return v


class Map(Spec):
    def __init__(self, key: Str, value: Spec, max_len: int):
        self.key, self.value, self.max_len = key, value, max_len
        self.what = f"a mapping of at most {max_len} entries"

    def check(self, v, path):
        if not isinstance(v, dict) or len(v) > self.max_len:
            self.fail(path, v)
        for k, x in v.items():
            self.key.check(k, f"{path} key")
            self.value.check(x, f"{path}[{k!r}]")
        return v


class Later(Spec):
    """Any value, left to the reader named (``Later("Program.from_json")``), which checks it whole."""

    def __init__(self, reader: str):
        self.what = f"anything (checked by {reader})"

    def check(self, v, path):
        return v


class OneOf(Spec):
    def __init__(self, *specs: Spec):
        self.specs = specs
        self.what = " or ".join(s.what for s in specs)

    def check(self, v, path):
        for spec in self.specs:
            try:
                return spec.check(v, path)
            except SchemaError:
                continue
        self.fail(path, v)


def check(spec: Spec, value: Any, where: str) -> Any:
    """``value`` if it has the shape ``spec`` describes; else a SchemaError naming ``where`` + path."""
    return spec.check(value, where)


def mostly_holes(st: os.stat_result) -> bool:
    """Whether a file read from disk is mostly holes (sparse: over 64 MiB, 64 times larger than the
    blocks it takes, where a compressed file system shrinks real weights far less): reading or
    hashing it would read zeros for hours, or make gigabytes of tensors of a small file."""
    return st.st_size > 64 * 2**20 and st.st_blocks * 512 * 64 < st.st_size


__all__ = [
    "SchemaError",
    "Int",
    "Float",
    "Bool",
    "Null",
    "Str",
    "List",
    "Tuple",
    "Dict",
    "Map",
    "OneOf",
    "Later",
    "check",
    "mostly_holes",
]
