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
from ._graph import (
    Emitter,
    concatenated,
    erase_unused,
    gelu_tanh_of,
    has_fake_values,
    is_call,
    read_only_by,
    replace,
)

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def _parts(x: fx.Node, readers: list[fx.Node]) -> list[tuple[fx.Node, bool]]:
    """What the quantising pass reads for ``x``: its two concatenated parts, or the input of its GELU,
    where only ``readers`` read ``x``; else x itself."""
    if not read_only_by(x, readers):
        return [(x, False)]
    parts = concatenated(x)
    if parts is not None:
        return [gelu_tanh_of(p, [x]) for p in parts]
    return [gelu_tanh_of(x, readers)]


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
        if is_call(node, FP8_LINEAR) and has_fake_values(node.args[0], node):
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
        erase_unused(gm, x)
        count += 1
    if count:
        logger.info("fp8_inputs: rewrote %d group(s) of %s", count, FP8_LINEAR)
    return gm
