"""Helpers shared by the lowering rules: emit ATen nodes with correct fake metadata.

Every node a rule inserts gets ``meta["val"]`` computed by running the op on the fake values of its
inputs, in the graph's own FakeTensorMode and ShapeEnv. Shapes stay symbolic where the export made them
dynamic, so Torch-TensorRT sees the same dynamic ranges after lowering as before.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def fake_value(arg: Any) -> Any:
    """The fake value behind an FX argument (node -> meta['val']; lists recurse; others unchanged)."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(fake_value(a) for a in arg)
    return arg


def has_fake_values(*nodes: fx.Node) -> bool:
    """True when every node carries a tensor meta['val'] (exported graphs do; symbolic_trace does not)."""
    return all(isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in nodes)


def known_equal(a: Any, b: Any) -> bool:
    """True only when a == b is provable (ints or SymInts), without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def known_divisible(a: Any, b: int) -> bool:
    """True only when a % b == 0 is provable."""
    if isinstance(a, int):
        return a % b == 0
    return statically_known_true(a % b == 0)


class Emitter:
    """Inserts nodes before ``anchor`` and fills their fake metadata.

    ``size`` and the arithmetic helpers return plain ints when a size is static and ``sym_size`` /
    ``operator`` nodes (exactly what torch.export emits) when it is symbolic.
    """

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node):
        self.graph = gm.graph
        self.anchor = anchor
        val = anchor.meta.get("val")
        vals = [fake_value(a) for a in anchor.all_input_nodes] + [val]
        self.fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), kwargs)
        fargs, fkwargs = fake_value(list(args)), {k: fake_value(v) for k, v in kwargs.items()}
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fargs, **fkwargs)
        else:
            node.meta["val"] = target(*fargs, **fkwargs)
        if "stack_trace" in self.anchor.meta:
            node.meta["stack_trace"] = self.anchor.meta["stack_trace"]
        return node

    def size(self, x: fx.Node, dim: int) -> Any:
        """x.shape[dim] as an int, or a ``sym_size`` node when it is symbolic."""
        s = x.meta["val"].shape[dim]
        if isinstance(s, int):
            return s
        return self.call(aten.sym_size.int, x, dim % x.meta["val"].dim())

    def _arith(self, op: Any, a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            return op(a, b)
        return self.call(op, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        if isinstance(a, int) and a == 1:
            return b
        if isinstance(b, int) and b == 1:
            return a
        return self._arith(operator.mul, a, b)

    def add(self, a: Any, b: Any) -> Any:
        if isinstance(b, int) and b == 0:
            return a
        return self._arith(operator.add, a, b)

    def sub(self, a: Any, b: Any) -> Any:
        if isinstance(b, int) and b == 0:
            return a
        return self._arith(operator.sub, a, b)

    def floordiv(self, a: Any, b: Any) -> Any:
        if isinstance(b, int) and b == 1:
            return a
        return self._arith(operator.floordiv, a, b)


def replace(gm: fx.GraphModule, old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` and erase ``old``."""
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)


def is_call(node: object, target: Any) -> bool:
    """``node`` is an FX call of ``target``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def read_only_by(node: fx.Node, readers: list[fx.Node]) -> bool:
    """Every user of ``node`` is one of ``readers``."""
    return all(user in readers for user in node.users)


def gelu_tanh_of(x: fx.Node, readers: list[fx.Node]) -> tuple[fx.Node, bool]:
    """(p, True) where ``x`` is ``gelu(p, approximate="tanh")``, or an eval-mode dropout of it (an
    identity: FLUX.1's feed-forward), every node on the way read only on the way to ``readers``;
    else (x, False)."""
    node, users = x, readers
    if is_call(node, aten.dropout.default) and read_only_by(node, users):
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        if train is False:
            node, users = node.args[0], [node]
    if is_call(node, aten.gelu.default) and read_only_by(node, users):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate == "tanh" and isinstance(node.args[0], fx.Node):
            return node.args[0], True
    return x, False


def concatenated(x: fx.Node) -> list[fx.Node] | None:
    """The two parts of ``x = cat([a, b], -1)`` (along the last dim, of x's rank and dtype: ``cat``
    promotes mixed dtypes and skips an empty 1-D part, a fused op would not); else None."""
    if not is_call(x, aten.cat.default) or not isinstance(x.args[0], (list, tuple)) or len(x.args[0]) != 2:
        return None
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    parts = list(x.args[0])
    if not has_fake_values(x, *parts):
        return None
    out = x.meta["val"]
    if any(p.meta["val"].dtype != out.dtype or p.meta["val"].dim() != out.dim() for p in parts):
        return None  # promoted dtypes, or a legacy empty 1-D part that cat skips
    return parts if dim in (-1, x.meta["val"].dim() - 1) else None


FOLDED = (aten.cat.default, aten.dropout.default, aten.gelu.default)


def erase_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and, up its inputs, every concatenation, dropout and GELU a rule folded into
    an op once nothing reads them: an eval dropout is impure to the dead-code pass (a random op), so
    it would keep its GELU alive."""
    stack = [node]
    while stack:
        node = stack.pop()
        if not node.users and node.op == "call_function" and node.target in FOLDED:
            stack.extend(node.all_input_nodes)
            gm.graph.erase_node(node)


def rewrite_calls(gm: fx.GraphModule, target: Any, rule: str, emit: Callable[[Emitter, fx.Node], Any]) -> int:
    """Replace each call of ``target`` by what ``emit(emitter, node)`` returns; a string return is the
    reason to leave that node as is (logged at debug level). Logs and returns how many were rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != target:
            continue
        if not has_fake_values(node.args[0], node):
            logger.debug("%s: %s left as is: no fake shapes on the graph (export it first)", rule, node)
            continue
        out = emit(Emitter(gm, node), node)
        if isinstance(out, str):
            logger.debug("%s: %s left as is: %s", rule, node, out)
            continue
        replace(gm, node, out)
        count += 1
    if count:
        logger.info("%s: rewrote %d %s node(s)", rule, count, target)
    return count


def retarget(gm: fx.GraphModule, target: Any, new_target: Any, rule: str) -> int:
    """Point each call of ``target`` at ``new_target`` (an op with the same arguments and result).
    Logs and returns how many were retargeted."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == target:
            node.target = new_target
            count += 1
    if count:
        logger.info("%s: rewrote %d %s node(s)", rule, count, target)
    return count
