"""Rule ``gelu_gate``: PRX's MLP gate ``gelu_tanh(linear(x, Wg)) * linear(x, Wu)`` -> one
``prx_compile::gelu_gate(x, Wg, linear(x, Wu))``.

Matches: ``aten.mul(aten.gelu(aten.linear(x, Wg), approximate="tanh"), aten.linear(x, Wu))`` (either
order) without biases, the GELU and the gate's linear used only there (PRX's
``mlp_act(gate_proj(x)) * up_proj(x)``).
Emits: ``gelu_gate(x, Wg, up)`` with the up projection's node as ``up`` (the ``linear`` rule then runs
it in cuBLAS, as the down projection): on CUDA one cuDNN GEMM with GELU * up in its epilogue, so the
gate's output never reaches device memory and the engine that held GELU * up is gone.
Exact on a CPU (the op is the composition); on CUDA the GELU takes the fp32 accumulator, not the
gate rounded to bf16 (a difference in the last bit or so).
The replaced nodes are left unused, for ``lower``'s dead-code pass.
Switch: ``LoweringSettings.gelu_gate`` (``CompileConfig.fuse_mlp_gate``, with the linears in PyTorch
and cuDNN's frontend installed).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ops import GELU_GATE
from ._graph import Emitter, rewrite_calls

aten = torch.ops.aten


def _bias_free_linear(node: object) -> tuple | None:
    """(x, weight) of a bias-free ``aten.linear`` node."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target != aten.linear.default:
        return None
    x, weight, *rest = node.args
    if (rest and rest[0] is not None) or node.kwargs.get("bias") is not None:
        return None
    return x, weight


def _gate(act: object, user: fx.Node) -> tuple | None:
    """(x, Wg) where ``act`` is gelu_tanh(linear(x, Wg)), both used only on the way to ``user``."""
    if not isinstance(act, fx.Node) or list(act.users) != [user]:
        return None
    if act.op != "call_function" or act.target != aten.gelu.default:
        return None
    if act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none") != "tanh":
        return None
    if not isinstance(act.args[0], fx.Node) or list(act.args[0].users) != [act]:
        return None
    return _bias_free_linear(act.args[0])


def _emit(em: Emitter, mul: fx.Node) -> fx.Node | str:
    if len(mul.args) != 2:
        return "not a product of two tensors"
    for act, up in (mul.args, mul.args[::-1]):
        gate, up_linear = _gate(act, mul), _bias_free_linear(up)
        if gate is not None and up_linear is not None and gate[0] is up_linear[0]:
            return em.call(GELU_GATE, gate[0], gate[1], up)
    return "not gelu_tanh(linear(x)) * linear(x) over one x"


def rule(gm: fx.GraphModule, settings) -> fx.GraphModule:
    """Fuse the MLP gates into ``gelu_gate`` (switch: ``gelu_gate``)."""
    if getattr(settings, "gelu_gate", False):
        rewrite_calls(gm, aten.mul.Tensor, "gelu_gate", _emit)
    return gm
