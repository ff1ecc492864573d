"""Rule ``fp8_mlp``: PRX's gated MLP over three FP8 linears -> one ``prx_compile::fp8_gated_mlp``.

Matches: ``fp8_linear(mul(gelu(fp8_linear(x, Wg, Sg), approximate="tanh"), fp8_linear(x, Wu, Su)),
Wd, Sd)`` without biases, each intermediate used only there (``precision: fp8``: PRX's
``down_proj(mlp_act(gate_proj(x)) * up_proj(x))``).
Emits: ``fp8_gated_mlp(x, Wg, Sg, Wu, Su, Wd, Sd)`` — the same GEMMs, with ``x`` quantised once and
GELU, product and the next quantisation in one pass. The whole MLP then stays in PyTorch, so the
engine that held GELU * up between two FP8 GEMMs is gone (one engine fewer per block).
Exact on a CPU (the op is the composition); on CUDA the one-pass GELU may round an element of the
product across an FP8 code boundary (relative error 1e-5 on an MLP at PRX width, measured).
The replaced nodes are erased (later rules ask who reads ``x``).
Switch: ``LoweringSettings.fp8_mlp``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import FP8_GATED_MLP, FP8_LINEAR
from ._graph import Emitter, rewrite_calls

aten = torch.ops.aten


def _only_user(node: object, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _linear(node: object, user: fx.Node) -> tuple | None:
    """(x, weight_fp8, weight_scale) of a bias-free fp8_linear used only by ``user``."""
    if not _only_user(node, user) or node.op != "call_function" or node.target != FP8_LINEAR:
        return None
    x, w, s, *bias = node.args
    if bias and bias[0] is not None or node.kwargs.get("bias") is not None:
        return None
    return x, w, s


def _gelu_tanh_input(node: object, user: fx.Node) -> object:
    if not _only_user(node, user) or node.op != "call_function" or node.target != aten.gelu.default:
        return None
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return node.args[0] if approximate == "tanh" else None


def _emit(em: Emitter, down: fx.Node, folded: list[fx.Node]) -> fx.Node | str:
    hidden, wd, sd, *bias = down.args
    if bias and bias[0] is not None or down.kwargs.get("bias") is not None:
        return "down projection has a bias"
    if not _only_user(hidden, down) or hidden.op != "call_function" or hidden.target != aten.mul.Tensor:
        return "input is not a product used only here"
    for act, up in (hidden.args, hidden.args[::-1]):
        gate_out = _gelu_tanh_input(act, hidden)
        gate, up_ = _linear(gate_out, act), _linear(up, hidden)
        if gate is not None and up_ is not None and gate[0] is up_[0]:
            folded += [hidden, act, gate_out, up]  # in the order they become unused
            return em.call(FP8_GATED_MLP, gate[0], gate[1], gate[2], up_[1], up_[2], wd, sd)
    return "not gelu_tanh(fp8_linear(x)) * fp8_linear(x) over one x"


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Fuse gated FP8 MLPs into ``fp8_gated_mlp`` (switch: ``fp8_mlp``)."""
    if getattr(settings, "fp8_mlp", True):
        folded: list[fx.Node] = []
        rewrite_calls(gm, FP8_LINEAR, "fp8_mlp", lambda em, down: _emit(em, down, folded))
        for node in folded:  # erased now, so that the next rules see x read by the op alone
            gm.graph.erase_node(node)
    return gm
