"""Rule ``unfold``: ``aten.im2col`` (``F.unfold``) -> exact reshapes or strided slices.

Matches: ``aten.im2col.default(x, kernel_size, dilation, padding, stride)`` on a 3-D or 4-D input.
Emits:
  * stride == kernel, no padding, dilation 1, and H, W provably divisible by the kernel (PRX's
    patchify in diffusers 0.36): ``view -> permute -> clone -> view``. No arithmetic: bit-exact.
  * any other configuration (overlap, padding, dilation, non-square, remainders): one strided
    ``slice`` pair per kernel offset, ``stack`` and ``view``. Also a pure copy: bit-exact.
Both forms keep symbolic H and W symbolic. TensorRT has no Im2Col layer; these are plain copies.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import Emitter, known_divisible, rewrite_calls

aten = torch.ops.aten


def im2col_exact(em: Emitter, x: fx.Node, kernel, dilation, padding, stride) -> fx.Node:
    """Emit im2col of a (B, C, H, W) node; returns a (B, C*kh*kw, oh*ow) node."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    b, c, h, w = (em.size(x, i) for i in range(4))
    ck = em.mul(c, kh * kw)
    simple = (kh, kw) == (sh, sw) and (ph, pw) == (0, 0) and (dh, dw) == (1, 1)
    hv, wv = x.meta["val"].shape[2:]
    if simple and known_divisible(hv, kh) and known_divisible(wv, kw):
        oh, ow = em.floordiv(h, kh), em.floordiv(w, kw)
        y = em.call(aten.view.default, x, [b, c, oh, kh, ow, kw])
        y = em.call(aten.permute.default, y, [0, 1, 3, 5, 2, 4])  # B, C, kh, kw, oh, ow
        y = em.call(aten.clone.default, y, memory_format=torch.contiguous_format)
        return em.call(aten.view.default, y, [b, ck, em.mul(oh, ow)])

    if (ph, pw) != (0, 0):
        x = em.call(aten.constant_pad_nd.default, x, [pw, pw, ph, ph], 0.0)
        h, w = em.add(h, 2 * ph), em.add(w, 2 * pw)
    # oh = (Hp - dh*(kh-1) - 1) // sh + 1
    oh = em.add(em.floordiv(em.sub(h, dh * (kh - 1) + 1), sh), 1)
    ow = em.add(em.floordiv(em.sub(w, dw * (kw - 1) + 1), sw), 1)
    span_h = em.add(em.mul(oh, sh), 1 - sh)  # sh*(oh-1)+1
    span_w = em.add(em.mul(ow, sw), 1 - sw)
    pieces = []
    for i in range(kh):
        rows = em.call(aten.slice.Tensor, x, 2, i * dh, em.add(span_h, i * dh), sh)
        for j in range(kw):
            pieces.append(em.call(aten.slice.Tensor, rows, 3, j * dw, em.add(span_w, j * dw), sw))
    y = em.call(aten.stack.default, pieces, 2)  # B, C, kh*kw, oh, ow
    return em.call(aten.view.default, y, [b, ck, em.mul(oh, ow)])


def _emit(em: Emitter, node: fx.Node) -> fx.Node:
    x, kernel, dilation, padding, stride = node.args[:5]
    batched = x.meta["val"].dim() == 4
    if not batched:  # F.unfold of a (C, H, W) image
        x = em.call(aten.unsqueeze.default, x, 0)
    out = im2col_exact(em, x, kernel, dilation, padding, stride)
    return out if batched else em.call(aten.squeeze.dim, out, 0)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Replace every ``aten.im2col`` by exact reshapes (patchify) or strided slices (general)."""
    rewrite_calls(gm, aten.im2col.default, "unfold", _emit)
    return gm
