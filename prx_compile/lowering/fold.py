"""Rule ``fold``: ``aten.col2im`` (``F.fold``) -> exact reshapes or padded strided sums.

Matches: ``aten.col2im.default(cols, output_size, kernel_size, dilation, padding, stride)``.
Emits:
  * stride == kernel, no padding, dilation 1, and H, W provably divisible by the kernel (PRX's
    unpatchify in diffusers 0.36): ``view -> permute -> clone -> view``. Bit-exact.
  * any other configuration: for each kernel offset, its block is spread by the stride (``pad`` of
    a size-1 axis), placed with ``constant_pad_nd`` and summed, then the padding is cropped with
    ``slice``. Overlapping blocks are summed in col2im's own order (kernel row, then column).
TensorRT has no Col2Im layer; Torch-TensorRT leaves it to PyTorch and splits the engine there.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._graph import Emitter, fake_value, known_divisible, rewrite_calls

aten = torch.ops.aten


def col2im_exact(em: Emitter, cols: fx.Node, out_hw, kernel, dilation, padding, stride) -> fx.Node:
    """Emit col2im of a (B, C*kh*kw, L) node into (B, C, H, W); ``out_hw`` are ints or size nodes."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    h, w = out_hw
    b = em.size(cols, 0)
    c = em.floordiv(em.size(cols, 1), kh * kw)
    hv, wv = fake_value(h), fake_value(w)
    simple = (kh, kw) == (sh, sw) and (ph, pw) == (0, 0) and (dh, dw) == (1, 1)
    if simple and known_divisible(hv, kh) and known_divisible(wv, kw):
        oh, ow = em.floordiv(h, kh), em.floordiv(w, kw)
        y = em.call(aten.view.default, cols, [b, c, kh, kw, oh, ow])
        y = em.call(aten.permute.default, y, [0, 1, 4, 2, 5, 3])  # B, C, oh, kh, ow, kw
        y = em.call(aten.clone.default, y, memory_format=torch.contiguous_format)
        return em.call(aten.view.default, y, [b, c, h, w])

    hp, wp = em.add(h, 2 * ph), em.add(w, 2 * pw)
    oh = em.add(em.floordiv(em.sub(hp, dh * (kh - 1) + 1), sh), 1)
    ow = em.add(em.floordiv(em.sub(wp, dw * (kw - 1) + 1), sw), 1)
    span_h = em.add(em.mul(oh, sh), 1 - sh)  # rows one block covers: sh*(oh-1)+1
    span_w = em.add(em.mul(ow, sw), 1 - sw)
    blocks = em.call(aten.view.default, cols, [b, c, kh, kw, oh, ow])
    acc = None
    for i in range(kh):
        for j in range(kw):
            blk = em.call(aten.select.int, em.call(aten.select.int, blocks, 2, i), 2, j)  # B, C, oh, ow
            if (sh, sw) != (1, 1):  # spread: put sh-1 zero rows after each row (and likewise columns)
                blk = em.call(aten.view.default, blk, [b, c, oh, 1, ow, 1])
                blk = em.call(aten.constant_pad_nd.default, blk, [0, sw - 1, 0, 0, 0, sh - 1], 0.0)
                blk = em.call(aten.view.default, blk, [b, c, em.mul(oh, sh), em.mul(ow, sw)])
                blk = em.call(aten.slice.Tensor, blk, 2, 0, span_h)
                blk = em.call(aten.slice.Tensor, blk, 3, 0, span_w)
            top, left = i * dh, j * dw
            pads = [left, em.sub(em.sub(wp, left), span_w), top, em.sub(em.sub(hp, top), span_h)]
            placed = em.call(aten.constant_pad_nd.default, blk, pads, 0.0)
            acc = placed if acc is None else em.call(aten.add.Tensor, acc, placed)
    if (ph, pw) != (0, 0):
        acc = em.call(aten.slice.Tensor, acc, 2, ph, em.add(h, ph))
        acc = em.call(aten.slice.Tensor, acc, 3, pw, em.add(w, pw))
    return acc


def _emit(em: Emitter, node: fx.Node) -> fx.Node:
    cols, out_hw, kernel, dilation, padding, stride = node.args[:6]
    batched = cols.meta["val"].dim() == 3
    if not batched:  # F.fold of (C*kh*kw, L) columns
        cols = em.call(aten.unsqueeze.default, cols, 0)
    out = col2im_exact(em, cols, list(out_hw), kernel, dilation, padding, stride)
    return out if batched else em.call(aten.squeeze.dim, out, 0)


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Replace every ``aten.col2im`` by exact reshapes (unpatchify) or padded strided sums (general)."""
    rewrite_calls(gm, aten.col2im.default, "fold", _emit)
    return gm
