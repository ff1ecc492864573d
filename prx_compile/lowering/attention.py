"""Rule ``attention``: masked or joint (keys != queries) SDPA -> forms that are exact on TensorRT.

Matches: ``aten.scaled_dot_product_attention`` and its fused variants (``_scaled_dot_product_
{flash,efficient,cudnn}_attention``, ``_scaled_dot_product_flash_attention_for_cpu``) on 4-D
(B, H, L, D) inputs that carry an attention mask (boolean or additive, any broadcastable shape) or
whose key length is not provably the query length — PRX's image queries over text+image keys.
Torch-TensorRT 2.11 converts no such SDPA and, by default, rewrites masked attention as causal.

Emits, by ``settings.attention``:
  * ``"tensorrt"`` — form (a), everything inside TensorRT: ``matmul -> scale -> +bias (fp32) ->
    _softmax -> zero fully-masked rows -> matmul``. The mask becomes a finite additive bias (never
    -inf), so no row can produce NaN; a row whose every key is masked gives 0, like PyTorch.
  * ``"flash"`` — form (b), one op that Torch-TensorRT leaves to PyTorch between engines, in
    (B, L, H, D) layout. When the keys are a concatenation ``cat([k_a, k_b])`` and the mask is
    ``cat([m_a, all-True])`` (PRX: padded text keys, then image keys), it is
    ``prx_compile::joint_attention``: a dense cuDNN kernel over k_b, a small masked kernel over k_a,
    merged exactly by log-sum-exp. Otherwise ``prx_compile::flash_attention`` with a (B, Lk) key mask
    (varlen flash; padded keys are never read rather than masked). A mask that varies over queries
    or heads cannot be a key mask: such a node gets form (a) instead, and the rule logs it.
Left untouched (logged at debug level): dropout, ``is_causal=True``, GQA, non-4-D inputs, tuple
variants whose log-sum-exp is used, graphs without fake shapes.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..ops import FLASH_ATTENTION, JOINT_ATTENTION
from ._graph import Emitter, fake_value, has_fake_values, known_equal

logger = logging.getLogger(__name__)
aten = torch.ops.aten

MASK_BIAS = -1.0e30  # finite "minus infinity": exp(MASK_BIAS - m) == 0 in fp32, never NaN


@dataclass
class _SDPA:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: Any
    dropout: Any
    is_causal: Any
    scale: Any
    gqa: bool
    result: fx.Node  # the node whose value is the attention output (B, H, Lq, D)


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _single_output(node: fx.Node) -> fx.Node | None:
    """For tuple-returning variants: the getitem(node, 0) user, if no other output is used."""
    users = list(node.users)
    if not all(u.target is operator.getitem for u in users):
        return None
    firsts = [u for u in users if u.args[1] == 0]
    others = [u for u in users if u.args[1] != 0 and u.users]
    if len(firsts) != 1 or others:
        return None
    return firsts[0]


def _parse(node: fx.Node) -> _SDPA | None:
    t = node.target
    if t == aten.scaled_dot_product_attention.default:
        return _SDPA(
            *node.args[:3],
            _arg(node, 3, "attn_mask", None),
            _arg(node, 4, "dropout_p", 0.0),
            _arg(node, 5, "is_causal", False),
            node.kwargs.get("scale"),
            bool(node.kwargs.get("enable_gqa", False)),
            node,
        )
    variants = {
        aten._scaled_dot_product_efficient_attention.default: (3, 5, 6),
        aten._scaled_dot_product_cudnn_attention.default: (3, 5, 6),
        aten._scaled_dot_product_flash_attention.default: (None, 3, 4),
    }
    if t in variants:
        mask_i, drop_i, causal_i = variants[t]
        out = _single_output(node)
        if out is None:
            return None
        mask = node.args[mask_i] if mask_i is not None and len(node.args) > mask_i else None
        return _SDPA(
            *node.args[:3],
            mask,
            _arg(node, drop_i, "dropout_p", 0.0),
            _arg(node, causal_i, "is_causal", False),
            node.kwargs.get("scale"),
            False,
            out,
        )
    if t == aten._scaled_dot_product_flash_attention_for_cpu.default:
        out = _single_output(node)
        if out is None:
            return None
        return _SDPA(
            *node.args[:3],
            node.kwargs.get("attn_mask"),
            _arg(node, 3, "dropout_p", 0.0),
            _arg(node, 4, "is_causal", False),
            node.kwargs.get("scale"),
            False,
            out,
        )
    return None


def _why_not(a: _SDPA) -> str | None:
    """Reason the node must stay as it is, or None when the rule may rewrite it."""
    if not has_fake_values(a.q, a.k, a.v):
        return "no fake shapes on the graph (export it first)"
    q, k = a.q.meta["val"], a.k.meta["val"]
    if q.dim() != 4 or k.dim() != 4:
        return "inputs are not 4-D (B, H, L, D)"
    if a.dropout != 0.0:
        return "dropout is not 0"
    if a.is_causal:
        return "is_causal=True (Torch-TensorRT handles causal attention itself)"
    if a.gqa or not known_equal(q.shape[1], k.shape[1]):
        return "grouped-query attention (query and key head counts differ)"
    if not isinstance(q.shape[-1], int):
        return "head dim is symbolic"
    if a.mask is None and known_equal(q.shape[2], k.shape[2]):
        return "plain self-attention without a mask: Torch-TensorRT converts it as it is"
    return None


def _key_mask(em: Emitter, mask: fx.Node, q: fx.Node, k: fx.Node) -> fx.Node | None:
    """A (B, Lk) version of ``mask`` if the mask varies over batch and keys only, else None.

    SDPA broadcasts the mask to (B, H, Lq, Lk): dims -3 (heads) and -2 (queries) must be 1.
    """
    src = mask
    while src.target == aten.expand.default:  # diffusers 0.36 expands [B,1,1,Lk] to [B,H,Lq,Lk]
        src = src.args[0]
    shape = src.meta["val"].shape
    n = len(shape)
    if n >= 2 and not known_equal(shape[-2], 1):
        return None
    if n >= 3 and not known_equal(shape[-3], 1):
        return None
    batch, keys = em.size(q, 0), em.size(k, 2)
    bm = em.size(src, 0) if n == 4 else 1
    km = em.call(aten.view.default, src, [bm, em.size(src, -1)])
    if not (
        known_equal(fake_value(bm), fake_value(batch)) and known_equal(shape[-1], k.meta["val"].shape[2])
    ):
        km = em.call(aten.expand.default, km, [batch, keys])
    return km


_VIEWS = (
    aten.unsqueeze.default,
    aten.view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.expand.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
)
_ALL_TRUE = (aten.ones.default, aten.ones_like.default, aten.new_ones.default)


def _is_full_slice(node: fx.Node) -> bool:
    if node.target != aten.slice.Tensor:
        return False
    x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = x.meta["val"].shape[dim]
    return (
        start in (None, 0)
        and step == 1
        and (end is None or known_equal(end, size) or (isinstance(end, int) and end >= 2**62))
    )


def _is_all_true(node: Any) -> bool:
    """Provably all-True: ``ones``/``full(True)`` (possibly cast to bool)."""
    while isinstance(node, fx.Node) and node.target in (aten._to_copy.default, aten.to.dtype):
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return False
    if node.target in _ALL_TRUE:
        return True
    return node.target == aten.full.default and node.args[1] in (True, 1, 1.0)


def _cat_of(node: fx.Node, along_last: bool) -> tuple[fx.Node, list[int]] | None:
    """Walk back through views to an ``aten.cat``; for keys, track the permutation.

    Keys (along_last=False): returns (cat node, P) with ``sdpa_arg = permute(cat_out, P)`` and the
    cat along P[2] (the sequence dim). Masks (along_last=True): the cat along its last dim.
    """
    perm = [0, 1, 2, 3]
    while True:
        t = node.target
        if t == aten.cat.default:
            ndim = node.meta["val"].dim()
            cdim = (node.args[1] if len(node.args) > 1 else 0) % ndim
            if along_last:
                return (node, []) if cdim == ndim - 1 else None
            return (node, perm) if ndim == 4 and cdim == perm[2] else None
        if along_last and (
            t in _VIEWS or _is_full_slice(node) or t in (aten._to_copy.default, aten.to.dtype)
        ):
            node = node.args[0]
        elif not along_last and t == aten.permute.default:
            q = list(node.args[1])
            perm = [q[p] % 4 for p in perm]
            node = node.args[0]
        elif not along_last and t == aten.transpose.int:
            q = [0, 1, 2, 3]
            d0, d1 = node.args[1] % 4, node.args[2] % 4
            q[d0], q[d1] = q[d1], q[d0]
            perm = [q[p] for p in perm]
            node = node.args[0]
        elif not along_last and t in (aten.clone.default, aten.contiguous.default, aten.alias.default):
            node = node.args[0]
        else:
            return None


def _joint_parts(em: Emitter, a: _SDPA):
    """(k_a, v_a, mask_a, k_b, v_b) in (B, L, H, D) if the node is joint attention, else None."""
    if a.mask is None or a.mask.meta["val"].dtype != torch.bool:
        return None
    kc, vc = _cat_of(a.k, False), _cat_of(a.v, False)
    mc = _cat_of(a.mask, True)
    if not (kc and vc and mc) or any(len(c[0].args[0]) != 2 for c in (kc, vc, mc)):
        return None
    (kcat, kp), (vcat, vp), (mcat, _) = kc, vc, mc
    ks, vs, ms = kcat.args[0], vcat.args[0], mcat.args[0]
    sizes = [[x.meta["val"].shape[p[2]] for x in xs] for xs, p in ((ks, kp), (vs, vp))]
    msizes = [m.meta["val"].shape[-1] for m in ms]
    if not all(known_equal(sizes[0][i], sizes[1][i]) and known_equal(sizes[0][i], msizes[i]) for i in (0, 1)):
        return None
    dense = 1 if _is_all_true(ms[1]) else 0 if _is_all_true(ms[0]) else None
    if dense is None or ms[1 - dense].meta["val"].dim() != 2:
        return None
    masked = 1 - dense

    def bshd(x: fx.Node, p: list[int]) -> fx.Node:  # permute(x, P) is (B, H, L, D); then swap H and L
        return em.call(aten.permute.default, x, [p[0], p[2], p[1], p[3]])

    mask_a = ms[masked]
    if mask_a.meta["val"].dtype != torch.bool:
        return None
    return (bshd(ks[masked], kp), bshd(vs[masked], vp), mask_a, bshd(ks[dense], kp), bshd(vs[dense], vp))


def _emit_flash(em: Emitter, a: _SDPA, scale: float) -> fx.Node | None:
    qt = em.call(aten.transpose.int, a.q, 1, 2)
    joint = _joint_parts(em, a)
    if joint is not None:
        out = em.call(JOINT_ATTENTION, qt, *joint, scale)
        return em.call(aten.transpose.int, out, 1, 2)
    key_mask = None
    if a.mask is not None:
        key_mask = _key_mask(em, a.mask, a.q, a.k)
        if key_mask is None:
            return None
    kt, vt = (em.call(aten.transpose.int, t, 1, 2) for t in (a.k, a.v))
    out = em.call(FLASH_ATTENTION, qt, kt, vt, key_mask, scale)
    return em.call(aten.transpose.int, out, 1, 2)


def _emit_tensorrt(em: Emitter, a: _SDPA, scale: float) -> fx.Node:
    dtype = a.q.meta["val"].dtype
    scores = em.call(aten.matmul.default, a.q, em.call(aten.transpose.int, a.k, -2, -1))
    scores = em.call(aten._to_copy.default, scores, dtype=torch.float32)
    scores = em.call(aten.mul.Tensor, scores, scale)
    row_ok = None
    if a.mask is not None:
        mask_dtype = a.mask.meta["val"].dtype
        if mask_dtype == torch.bool:
            keep = em.call(aten._to_copy.default, a.mask, dtype=torch.float32)
            bias = em.call(aten.mul.Tensor, em.call(aten.sub.Tensor, keep, 1.0), -MASK_BIAS)
            row_ok = em.call(aten.any.dim, a.mask, -1, True)
        else:
            bias = em.call(aten._to_copy.default, a.mask, dtype=torch.float32)
            row_ok = em.call(aten.gt.Scalar, em.call(aten.amax.default, bias, [-1], True), MASK_BIAS)
            bias = em.call(aten.clamp_min.default, bias, MASK_BIAS)
        scores = em.call(aten.add.Tensor, scores, bias)
    probs = em.call(aten._softmax.default, scores, -1, False)
    if row_ok is not None:  # a row that may attend to nothing gives 0 (PyTorch's convention)
        probs = em.call(aten.mul.Tensor, probs, em.call(aten._to_copy.default, row_ok, dtype=torch.float32))
    probs = em.call(aten._to_copy.default, probs, dtype=dtype)
    return em.call(aten.matmul.default, probs, a.v)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Rewrite masked / joint SDPA into form (a) ``"tensorrt"`` or form (b) ``"flash"``."""
    form = getattr(settings, "attention", "flash")
    counts = {"flash": 0, "tensorrt": 0}
    before = sum(1 for n in gm.graph.nodes if n.target == JOINT_ATTENTION)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        a = _parse(node)
        if a is None:
            continue
        why = _why_not(a)
        if why is not None:
            logger.debug("attention: %s left as is: %s", node, why)
            continue
        head_dim = a.q.meta["val"].shape[-1]
        scale = float(a.scale) if a.scale is not None else 1.0 / math.sqrt(head_dim)
        em = Emitter(gm, node)
        out = _emit_flash(em, a, scale) if form == "flash" else None
        if out is None:
            if form == "flash":
                logger.debug("attention: %s has a mask that varies over queries or heads: form (a)", node)
            out = _emit_tensorrt(em, a, scale)
            counts["tensorrt"] += 1
        else:
            counts["flash"] += 1
        a.result.replace_all_uses_with(out)
        if a.result is not node:
            gm.graph.erase_node(a.result)
        gm.graph.erase_node(node)
    joint = sum(1 for n in gm.graph.nodes if n.target == JOINT_ATTENTION) - before
    for name, n in counts.items():
        if n:
            extra = f" ({joint} as joint text+image attention)" if name == "flash" and joint else ""
            logger.info("attention: rewrote %d SDPA node(s) into the %s form%s", n, name, extra)
    return gm
