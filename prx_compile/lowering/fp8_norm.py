"""Rule ``fp8_norm``: the modulated layer norm that makes an FP8 input, run in its quantising pass.

Matches: the input ``x`` of one FP8 op that quantises it itself (``fp8_linears`` over one part
without GELU, ``fp8_linear`` or ``fp8_gated_mlp``) where ``x = layer_norm(x0, [K], None, None, eps) *
m + shift`` (the product's and the sum's operands in either order): diffusers' modulated norm,
``norm(x) * (1 + scale) + shift`` (PRX's ``img_pre_norm`` and ``post_attention_layernorm``, FLUX.1's
``AdaLayerNormZero`` and ``norm2``). ``x0`` is (B, L, K); ``m`` and ``shift`` are (B or 1, 1, K); all
of one dtype; ``x``, the product and the norm are read only on the way to that op.
Emits: the op over ``x0`` with ``norm_mult=m, norm_shift=shift, norm_eps=eps``; an ``fp8_linear``
becomes ``fp8_linears`` and a ``getitem``.
Why: the engine before the FP8 op wrote the modulated norm in bf16 only for the quantiser to read it
again (PRXPixel 7B's fp8 step: 64 of them, 8192 x 3072 each; FLUX.1's: 114). The quantising pass
reads a whole row anyway, so it takes the row's mean and variance too: one bf16 write and one read
fewer per site, the engine keeps the residual stream it writes anyway.
Exact on a CPU (the op is the composition); on CUDA the kernel behaves as if its multiply and add
fused and rounded once where torch rounds the product first, so about a fifth of the rows get a
scale one bf16 step away and about 4 % of the codes differ by one, the error against the exact
value no larger (``benchmarks/results/norm_rounding_v33_h100.json``).
Switch: ``LoweringSettings.fp8_norm`` (``CompileConfig.fp8_norm``).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ..ops import FP8_GATED_MLP, FP8_LINEAR, FP8_LINEARS
from ._graph import Emitter, has_fake_values, is_call, known_equal, read_only_by, replace

logger = logging.getLogger(__name__)
aten = torch.ops.aten

#: the norm's arguments after its input: normalized_shape, weight, bias, eps (aten.layer_norm's order)
_LN_ARGS = ("normalized_shape", "weight", "bias", "eps")


def _sum_of_two(node: fx.Node, target) -> list[tuple[object, object]]:
    """Both orders of a binary ``target`` call's two operands (no ``alpha``); [] otherwise."""
    if not is_call(node, target) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _layer_norm(node: object, reader: fx.Node) -> tuple[fx.Node, float] | None:
    """(x0, eps) of ``layer_norm(x0, [K], None, None, eps)`` over x0's last dim, read only by ``reader``."""
    if not is_call(node, aten.layer_norm.default) or not read_only_by(node, [reader]):
        return None
    x0, *rest = node.args
    given = dict(zip(_LN_ARGS, rest, strict=False))
    given.update({k: v for k, v in node.kwargs.items() if k in _LN_ARGS})
    shape, eps = given.get("normalized_shape"), given.get("eps", 1e-5)
    if given.get("weight") is not None or given.get("bias") is not None or not has_fake_values(x0, node):
        return None
    k = x0.meta["val"].shape[-1]
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not known_equal(shape[0], k):
        return None
    return (x0, float(eps)) if isinstance(eps, (int, float)) else None


def _per_batch(t: object, x0: torch.Tensor) -> bool:
    """``t`` is a node of x0's dtype shaped (B or 1, 1, K) for x0 (B, L, K)."""
    if not has_fake_values(t):
        return False
    v = t.meta["val"]
    b, _, k = x0.shape
    return (
        v.dtype == x0.dtype
        and v.dim() == 3
        and known_equal(v.shape[1], 1)
        and known_equal(v.shape[2], k)
        and (known_equal(v.shape[0], b) or known_equal(v.shape[0], 1))
    )


def modulated_norm(x: object, reader: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, float, list] | None:
    """(x0, m, shift, eps, [x, product, norm]) where ``x = layer_norm(x0) * m + shift`` as the module
    docstring says, read only by ``reader``; else None."""
    if not isinstance(x, fx.Node) or not read_only_by(x, [reader]) or not has_fake_values(x):
        return None
    for prod, shift in _sum_of_two(x, aten.add.Tensor):
        if not isinstance(prod, fx.Node) or not read_only_by(prod, [x]):
            continue
        for ln, m in _sum_of_two(prod, aten.mul.Tensor):
            found = _layer_norm(ln, prod)
            if found is None:
                continue
            x0, eps = found
            v0 = x0.meta["val"]
            folded = [x, prod, ln]
            if m in folded or shift in folded:  # e.g. n * n + shift with one token: n is no modulation
                continue
            if (
                v0.dim() == 3
                and v0.dtype == x.meta["val"].dtype
                and _per_batch(m, v0)
                and _per_batch(shift, v0)
            ):
                return x0, m, shift, eps, folded
    return None


def _erase(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    for node in nodes:  # x, then the product, then the norm: each unused once the one before is gone
        gm.graph.erase_node(node)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Run each FP8 input's modulated norm in its quantising pass (switch: ``fp8_norm``)."""
    if not getattr(settings, "fp8_norm", True):
        return gm
    count = 0
    for node in list(gm.graph.nodes):
        if is_call(node, FP8_LINEARS):
            parts, gelu, *rest = node.args
            if len(parts) != 1 or gelu[0] or len(rest) != 3 or node.kwargs:
                continue  # a concatenation, a GELU, or a norm already
            found = modulated_norm(parts[0], node)
            if found is None:
                continue
            x0, m, shift, eps, folded = found
            node.args = ([x0], [False], *rest, m, shift, eps)
        elif is_call(node, FP8_GATED_MLP):
            x, *weights = node.args
            if len(weights) != 6 or node.kwargs:
                continue
            found = modulated_norm(x, node)
            if found is None:
                continue
            x0, m, shift, eps, folded = found
            node.args = (x0, *weights, m, shift, eps)
        elif is_call(node, FP8_LINEAR):
            found = modulated_norm(node.args[0], node)
            if found is None:
                continue
            x0, m, shift, eps, folded = found
            _, w, s, *bias = node.args
            em = Emitter(gm, node)
            fused = em.call(
                FP8_LINEARS,
                [x0],
                [False],
                [w],
                [s],
                [bias[0] if bias else node.kwargs.get("bias")],
                m,
                shift,
                eps,
            )
            replace(gm, node, em.call(operator.getitem, fused, 0))
        else:
            continue
        _erase(gm, folded)
        count += 1
    if count:
        logger.info("fp8_norm: took %d modulated norm(s) into their quantising pass", count)
    return gm
