"""PyTorch-level lowering rules that make an exported transformer step TensorRT-friendly.

Each rule lives in its own file, has the signature ``(gm, settings) -> gm``, rewrites only what it
can prove exact (anything else is left as is and logged at debug level) and logs how many nodes it
rewrote. ``fp8_mlp``, ``fp8_inputs`` and ``fp8_norm`` fold work into the FP8 quantising pass: exact
on a CPU, and on CUDA within one FP8 code of the unfused ops per element (their Triton GELU and norm
round like torch's, from another formula or summation order).
``fp8_attention`` is the one rule that trades exactness for speed, by request (``precision: fp8``).
Two explicit lists say when they run:

* ``RULES`` (unfold, fold, attention, select, fp8_mlp, fp8_inputs, fp8_norm, fp8_attention,
  padded_attention, dense_attention, gelu_gate, linear, linear_glue):
  ``lower(gm, settings)``, on the exported graph, before any backend sees it (``linear`` only for
  TensorRT engine sets over a range);
* ``ENGINE_RULES`` (shape_ints): on the graph Torch-TensorRT partitions, after its own
  decompositions (which would undo them), registered only while ``backends.tensorrt`` builds.

``KERNEL_RULES`` (fp8_attention, padded_attention, dense_attention), part of ``RULES``, only choose
which kernel an attention op kept in PyTorch runs: the engines do not depend on them, so a TensorRT
engine set lowers without them (``lower(..., kernels=False)``) and applies them to its partitioned
module once its kernels are measured (``lower_kernels``), while its engines build.

    >>> ep = torch.export.export(model, (), kwargs)
    >>> gm = prx_compile.lowering.lower(ep.module())                  # form (b): flash attention op
    >>> gm = prx_compile.lowering.lower(ep.module(), LoweringSettings(attention="tensorrt"))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import (
    attention,
    dense_attention,
    fold,
    fp8_attention,
    fp8_inputs,
    fp8_mlp,
    fp8_norm,
    gelu_gate,
    linear,
    linear_glue,
    padded_attention,
    select,
    shape_ints,
    unfold,
)

logger = logging.getLogger(__name__)

ATTENTION_FORMS = ("flash", "tensorrt")
PADDED_ATTENTION = (None, "flash4", "cudnn", "cudnn_fp8")
DENSE_ATTENTION = ("sdpa", "cudnn", "flash4")


@dataclass(frozen=True)
class LoweringSettings:
    """What the rules emit.

    attention: ``"flash"`` — masked/joint attention becomes a ``prx_compile`` op kept in PyTorch
        between TensorRT engines (fast, exact): ``joint_attention`` for PRX's [masked text keys; image
        keys], ``flash_attention`` for any other key mask; ``"tensorrt"`` — it is decomposed into
        matmul/softmax inside TensorRT (one engine, slower attention).
    select_as_slice: rewrite constant-index ``select`` into ``slice`` (no gather in TensorRT).
    fp8_mlp: fuse a gated MLP over three FP8 linears into one ``fp8_gated_mlp`` op.
    fp8_inputs: FP8 linears reading one input quantise it once, the concatenation or GELU that makes
        it fused into that pass (one ``fp8_linears`` op).
    fp8_norm: an FP8 op's input made by a modulated layer norm (``norm(x) * (1 + scale) + shift``)
        is made in its quantising pass (``norm_*`` arguments of ``fp8_linears``/``fp8_gated_mlp``).
    fp8_attention: run each ``prx_attention`` as ``prx_attention_fp8`` (attention on FP8 tensor cores).
    fp8_tile: the FP8 kernels' tiling, an index into ``ops.fp8_attention.TILES``.
    padded_attention: run each ``prx_attention`` left as one attention call over a key-padding
        layout: "flash4" (``prx_attention_flash4``), "cudnn" (``prx_attention_cudnn``), "cudnn_fp8"
        (``prx_attention_cudnn_fp8``) or None.
    dense_attention: the kernel each dense ``prx_compile::attention`` runs: "sdpa", "cudnn", "flash4".
    gelu_gate: fuse each MLP gate ``gelu_tanh(linear(x, Wg)) * linear(x, Wu)`` into one
        ``gelu_gate`` op (a cuDNN GEMM with the activation in its epilogue).
    linears_in_torch: rewrite every ``aten.linear`` into ``prx_compile::linear`` (run by PyTorch).
    linear_glue: with ``linears_in_torch``, a tanh GELU between two linears goes into the first's
        epilogue (``linear_gelu``) and a linear over a two-part concatenation runs as two GEMMs
        (``linear_cat``).
    """

    attention: str = "flash"
    select_as_slice: bool = True
    fp8_mlp: bool = True
    fp8_inputs: bool = True
    fp8_norm: bool = True
    fp8_attention: bool = False
    fp8_tile: int = 0
    padded_attention: str | None = None
    dense_attention: str = "sdpa"
    gelu_gate: bool = False
    linears_in_torch: bool = False
    linear_glue: bool = True

    def __post_init__(self):
        if self.attention not in ATTENTION_FORMS:
            from ..errors import ConfigError

            raise ConfigError(
                f"LoweringSettings.attention={self.attention!r} is not one of {ATTENTION_FORMS}.",
                "use 'flash' (attention between engines) or 'tensorrt' (one engine).",
            )
        if self.padded_attention not in PADDED_ATTENTION:
            from ..errors import ConfigError

            raise ConfigError(
                f"LoweringSettings.padded_attention={self.padded_attention!r} is not one of "
                f"{PADDED_ATTENTION}."
            )
        if self.dense_attention not in DENSE_ATTENTION:
            from ..errors import ConfigError

            raise ConfigError(
                f"LoweringSettings.dense_attention={self.dense_attention!r} is not one of {DENSE_ATTENTION}."
            )


Rule = Callable[[fx.GraphModule, LoweringSettings], fx.GraphModule]

#: name -> rule, applied in this order by ``lower``. Each rule's docstring says what it matches/emits.
RULES: dict[str, Rule] = {}


def register_rule(name: str) -> Callable[[Rule], Rule]:
    """Decorator: add ``rule`` to ``RULES`` under ``name`` (names are unique)."""

    def deco(rule: Rule) -> Rule:
        if name in RULES:
            raise ValueError(f"a lowering rule named {name!r} is already registered")
        RULES[name] = rule
        return rule

    return deco


register_rule("unfold")(unfold.rule)
register_rule("fold")(fold.rule)
register_rule("attention")(attention.rule)
register_rule("select")(select.rule)
register_rule("fp8_mlp")(fp8_mlp.rule)
register_rule("fp8_inputs")(fp8_inputs.rule)  # after fp8_mlp: PRX's gate and up read one x too
register_rule("fp8_norm")(fp8_norm.rule)  # after fp8_inputs: it takes a norm into their groups
register_rule("fp8_attention")(fp8_attention.rule)
register_rule("padded_attention")(padded_attention.rule)
register_rule("dense_attention")(dense_attention.rule)
register_rule("gelu_gate")(gelu_gate.rule)
register_rule("linear")(linear.rule)
register_rule("linear_glue")(linear_glue.rule)  # after linear: it rewrites prx_compile::linear

#: Rules for the graph Torch-TensorRT partitions into engines (after its decompositions), in order.
ENGINE_RULES: dict[str, Rule] = {"shape_ints": shape_ints.rule}
#: the rules of ``RULES`` that only pick the kernel of an attention op kept in PyTorch (their op's
#: variants take the same arguments and return the same result)
KERNEL_RULES = ("fp8_attention", "padded_attention", "dense_attention")


def lower(
    gm: fx.GraphModule, settings: LoweringSettings | None = None, kernels: bool = True
) -> fx.GraphModule:
    """Apply every rule in ``RULES`` to an ATen-level GraphModule (as ``torch.export`` makes it).

    Args:
        gm: ``ExportedProgram.module()`` or ``ExportedProgram.graph_module``; rewritten in place.
        settings: which forms the rules emit (default: ``LoweringSettings()``, flash attention).
        kernels: also the ``KERNEL_RULES`` (False: the attention ops keep their first form, for
            ``lower_kernels`` to retarget later).

    Returns:
        ``gm``, its graph linted and recompiled.
    """
    settings = settings or LoweringSettings()
    for name, rule in RULES.items():
        if kernels or name not in KERNEL_RULES:
            gm = rule(gm, settings)
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.graph.lint()
    gm.recompile()
    return gm


def lower_kernels(gm: torch.nn.Module, settings: LoweringSettings) -> None:
    """Apply the ``KERNEL_RULES`` to every graph of ``gm`` (a partitioned module: its PyTorch
    segments), in place: the attention ops kept in PyTorch run the kernels ``settings`` name."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for name in KERNEL_RULES:
                RULES[name](module, settings)
            module.recompile()


def _is_impure(node: fx.Node) -> bool:
    # Keep placeholders, outputs and side effects; sym_size nodes left unused by a rule can go.
    return node.op in ("placeholder", "output") or node.is_impure()


__all__ = [
    "lower",
    "lower_kernels",
    "RULES",
    "ENGINE_RULES",
    "KERNEL_RULES",
    "register_rule",
    "LoweringSettings",
    "ATTENTION_FORMS",
]
