"""Every op the step keeps in PyTorch between TensorRT engines, declared once.

    declare(torch.ops.prx_compile.linear, "linear")

An op's role says when TensorRT leaves it to PyTorch (``kept``): "attention" unless ``attention:
tensorrt``; "fp8" with ``precision: fp8``; "linear" where an engine set runs its linears in PyTorch
(cuBLAS). A Program (``backends.tensorrt.program``) may call every declared op and nothing else of
``prx_compile``: the registry is the one list of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("attention", "fp8", "linear")


@dataclass(frozen=True)
class KeptOp:
    name: str  # "prx_compile.linear.default"
    overload: torch._ops.OpOverload
    role: str


#: every declared op, by name, in declaration order
KEPT: dict[str, KeptOp] = {}


def declare(op, role: str) -> torch._ops.OpOverload:
    """Declare ``op`` (a ``torch.library.custom_op`` or its overload) as kept in PyTorch under
    ``role``; returns its overload."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    overload = getattr(op, "_opoverload", op)
    name = f"{overload.namespace}.{overload._opname}.{overload._overloadname}"
    if name in KEPT:
        raise ValueError(f"op {name} is declared twice")
    KEPT[name] = KeptOp(name, overload, role)
    return overload


def kept(roles: set[str] | frozenset[str]) -> set[torch._ops.OpOverload]:
    """The overloads of every op declared under one of ``roles``."""
    return {op.overload for op in KEPT.values() if op.role in roles}


def overloads() -> list[torch._ops.OpOverload]:
    """Every declared op's overload (what a Program may call)."""
    return [op.overload for op in KEPT.values()]
