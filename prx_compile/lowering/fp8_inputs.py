"""Rule ``fp8_inputs``: the FP8 linears that read one input, that input made and quantised once ->
one ``prx_compile::fp8_linears``.

Matches: a run of ``fp8_linear`` nodes that read one ``x`` with no other FP8 linear between them
(so one block's, not every block's reading one text input), where the run has two or more (FLUX.1's
q/k/v projections; a single block's with its MLP projection), or ``x`` is made by ops the quantising
pass can do itself and read only by the run: ``cat([a, b], -1)`` (a single block's
``proj_out(cat([attention, gelu(mlp)], -1))``) or ``gelu(p, approximate="tanh")``, a part possibly
behind an ``aten.dropout`` that is off (``train=False``: FLUX.1's feed-forward).
Emits: ``fp8_linears(parts, gelu, [W_j], [S_j], [b_j])`` and one ``getitem`` per linear.
Why: ``fp8_linear`` quantises its input at every call. FLUX.1-dev's step quantised 418 inputs, 190
of them for the second to fourth time (7.2 ms of quantisation a step, ``flux_timeline_v22_h200.json``),
and TensorRT engines between the GEMMs wrote the GELUs' and the concatenations' bf16 outputs for the
quantiser to read again.
Exact on a CPU (the op is the composition); on CUDA the fused GELU rounds like torch's from a
different formula (within one FP8 code per element, as ``fp8_mlp``'s).
The replaced linears are erased, and so are the concatenation, GELU and dropout folded into the
op (an eval dropout is impure to ``lower``'s dead-code pass).
Switch: ``LoweringSettings.fp8_inputs`` (``CompileConfig.fp8_inputs``).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ..ops import FP8_LINEAR, FP8_LINEARS
from ._graph import Emitter, has_fake_values, replace

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def _is(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def _read_only_by(node: fx.Node, readers: list[fx.Node]) -> bool:
    return all(user in readers for user in node.users)


def _act(x: fx.Node, readers: list[fx.Node]) -> tuple[fx.Node, bool]:
    """(p, True) where ``x`` is gelu_tanh(p), or an eval-mode dropout of it, every node on the way
    read only on the way to ``readers``; else (x, False)."""
    node, users = x, readers
    if _is(node, aten.dropout.default) and _read_only_by(node, users):
        train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
        if train is False:
            node, users = node.args[0], [node]
    if _is(node, aten.gelu.default) and _read_only_by(node, users):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate == "tanh" and isinstance(node.args[0], fx.Node):
            return node.args[0], True
    return x, False


def _parts(x: fx.Node, readers: list[fx.Node]) -> list[tuple[fx.Node, bool]]:
    """What the quantising pass reads for ``x``: its two concatenated parts, or the input of its GELU,
    where only ``readers`` read ``x``; else x itself."""
    if not _read_only_by(x, readers):
        return [(x, False)]
    if _is(x, aten.cat.default) and isinstance(x.args[0], (list, tuple)) and len(x.args[0]) == 2:
        dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
        parts = x.args[0]
        same = has_fake_values(*parts) and all(p.meta["val"].dtype == x.meta["val"].dtype for p in parts)
        if same and dim in (-1, x.meta["val"].dim() - 1):  # (cat promotes mixed dtypes; the op does not)
            return [_act(p, [x]) for p in parts]
    return [_act(x, readers)]


def _erase_folded(gm: fx.GraphModule, x: fx.Node) -> None:
    """Erase ``x`` and the producers folded into the quantisation once nothing reads them: an eval
    dropout is impure to the dead-code pass (a random op), so it would keep its GELU alive."""
    stack = [x]
    while stack:
        node = stack.pop()
        folded = (aten.cat.default, aten.dropout.default, aten.gelu.default)
        if not node.users and node.op == "call_function" and node.target in folded:
            stack.extend(node.all_input_nodes)
            gm.graph.erase_node(node)


def _linear_args(node: fx.Node) -> tuple:
    """(weight_fp8, weight_scale, bias) of an ``fp8_linear`` node."""
    _, w, s, *rest = node.args
    return w, s, rest[0] if rest else node.kwargs.get("bias")


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Make each FP8 linear input once (switch: ``fp8_inputs``)."""
    if not getattr(settings, "fp8_inputs", True):
        return gm
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups: list[list[fx.Node]] = []  # runs of adjacent FP8 linears (no other between) over one x
    for node in gm.graph.nodes:
        if _is(node, FP8_LINEAR) and has_fake_values(node.args[0], node):
            if groups and groups[-1][0].args[0] is node.args[0]:
                groups[-1].append(node)
            else:
                groups.append([node])
    count = 0
    for linears in groups:
        x = linears[0].args[0]
        parts = _parts(x, linears)
        if len(linears) == 1 and parts == [(x, False)]:
            continue  # nothing to share or fuse
        if not has_fake_values(*(p for p, _ in parts)):
            logger.debug("fp8_inputs: %s left as is: no fake shapes on its parts", x)
            continue
        weights = [_linear_args(lin) for lin in linears]
        first = order[linears[0]]
        late = [a for ws in weights for a in ws if isinstance(a, fx.Node) and order[a] > first]
        if late:
            logger.debug("fp8_inputs: %s left as is: %s is made after its first linear", x, late[0])
            continue
        em = Emitter(gm, linears[0])
        fused = em.call(
            FP8_LINEARS,
            [p for p, _ in parts],
            [g for _, g in parts],
            [w for w, _, _ in weights],
            [s for _, s, _ in weights],
            [b for _, _, b in weights],
        )
        items = [em.call(operator.getitem, fused, j) for j in range(len(linears))]
        for lin, item in zip(linears, items, strict=True):
            replace(gm, lin, item)
        _erase_folded(gm, x)
        count += 1
    if count:
        logger.info("fp8_inputs: rewrote %d group(s) of %s", count, FP8_LINEAR)
    return gm
