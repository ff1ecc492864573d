"""Rule ``linear_glue``: the GELU and the concatenation between linears that PyTorch runs, taken into
the GEMMs -> ``prx_compile::linear_gelu`` and ``prx_compile::linear_cat``.

Matches, on ``prx_compile::linear`` nodes (rule ``linear``: engine sets that run their linears in
cuBLAS):
* ``gelu(linear(x, W, b), approximate="tanh")`` with a bias, the linear read only by the GELU, the
  GELU (possibly through an eval-mode dropout) read only as the input of other linears or of a
  concatenation that one reads (FLUX.1's feed-forward ``ff.net.2(gelu(ff.net.0.proj(x)))``, a single
  block's ``gelu(proj_mlp(x))``); PRX's gate, whose GELU a product reads, is ``gelu_gate``'s;
* ``linear(cat([a, b], -1), W, b)``, the concatenation read only there, its parts of one dtype (a
  single block's ``proj_out(cat([attention, gelu(mlp)], -1))``); such a linear keeps its own GELU
  (one op does not do both).
Emits: ``linear_gelu(x, W, b)`` (one cuBLASLt GEMM, bias and GELU in its epilogue) and
``linear_cat(a, b, W, b)`` (two GEMMs over W's column blocks, the second accumulating into the first).
Why: in FLUX.1's bf16 step the engines between the GEMMs wrote the GELUs' outputs and the single
blocks' 4608 x 15360 concatenations in bf16 for the next GEMM to read again, the largest
elementwise traffic of the step (TensorRT's kernels took 6.9 ms of 125.8, ``flux_timeline_v22_h200.json``).
On a CPU the ops are the composition (exact); on CUDA the GELU takes the fp32 accumulator where
cuBLASLt's epilogue runs it (else a GELU pass after the GEMM) and ``linear_cat`` rounds once more (the
last bit or so).
The replaced nodes, and the GELUs, dropouts and concatenations folded in, are erased.
Switch: ``LoweringSettings.linear_glue`` (``CompileConfig.linear_glue``).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..ops import LINEAR, LINEAR_CAT, LINEAR_GELU
from ._graph import Emitter, concatenated, erase_unused, is_call, read_only_by, replace

logger = logging.getLogger(__name__)
aten = torch.ops.aten


def _bias(node: fx.Node) -> object:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _eval_dropout(node: fx.Node) -> bool:
    if not is_call(node, aten.dropout.default):
        return False
    return node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True) is False


def _read_by_linears(node: fx.Node) -> list[fx.Node] | None:
    """The eval dropouts on the way when every user of ``node`` (through them) reads it as a linear's
    input, or is a last-dim concatenation read only as a linear's input (what ``linear_cat`` takes);
    else None."""
    edges, dropouts = [(node, user) for user in node.users], []
    while edges:
        value, user = edges.pop(0)
        if _eval_dropout(user):
            dropouts.append(user)
            edges += [(user, u) for u in user.users]
            continue
        if is_call(user, LINEAR):
            if user.args[0] is not value or value in user.args[1:]:
                return None  # read as a weight or a bias
            continue
        only = next(iter(user.users)) if len(user.users) == 1 else None
        if concatenated(user) is None or not is_call(only, LINEAR) or only.args[0] is not user:
            return None
    return dropouts


def _splits(linear: fx.Node) -> bool:
    """``linear`` reads a concatenation that ``_cats`` splits (it stays a plain linear for that)."""
    cat = linear.args[0]
    return isinstance(cat, fx.Node) and concatenated(cat) is not None and read_only_by(cat, [linear])


def _gelus(gm: fx.GraphModule) -> int:
    count = 0
    for gelu in list(gm.graph.nodes):
        if not is_call(gelu, aten.gelu.default) or not gelu.users:
            continue
        approximate = gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")
        linear = gelu.args[0]
        if approximate != "tanh" or not is_call(linear, LINEAR) or list(linear.users) != [gelu]:
            continue
        dropouts = _read_by_linears(gelu)
        if _bias(linear) is None or dropouts is None or _splits(linear):
            continue
        node = Emitter(gm, gelu).call(LINEAR_GELU, linear.args[0], linear.args[1], _bias(linear))
        for dropout in dropouts:  # identities, nearest the GELU first
            replace(gm, dropout, node)
        replace(gm, gelu, node)
        gm.graph.erase_node(linear)
        count += 1
    return count


def _cats(gm: fx.GraphModule) -> int:
    count = 0
    for linear in list(gm.graph.nodes):
        if not is_call(linear, LINEAR):
            continue
        cat = linear.args[0]
        parts = concatenated(cat) if isinstance(cat, fx.Node) else None
        if parts is None or not read_only_by(cat, [linear]):
            continue
        node = Emitter(gm, linear).call(LINEAR_CAT, parts[0], parts[1], linear.args[1], _bias(linear))
        replace(gm, linear, node)
        erase_unused(gm, cat)
        count += 1
    return count


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Take GELUs and concatenations between cuBLAS linears into their GEMMs (switch: ``linear_glue``)."""
    if getattr(settings, "linear_glue", True) and getattr(settings, "linears_in_torch", False):
        gelus, cats = _gelus(gm), _cats(gm)
        if gelus or cats:
            logger.info("linear_glue: %d GELU(s) into their GEMMs, %d concatenation(s) split", gelus, cats)
    return gm
