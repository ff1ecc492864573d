"""The gelu_gate rule on hand-made graphs and on the tiny PRX: which MLP gates it fuses, which it
leaves, exactness on a CPU (the op's named fallback is the composition), and the config switch."""

import pytest
import torch
import torch.nn.functional as F

from prx_compile import CompileConfig
from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import GELU_GATE, cudnn_attention
from prx_compile.shapes import ShapeRange

from ..conftest import plan_of

aten = torch.ops.aten


class Gated(torch.nn.Module):
    """PRX's MLP over plain linears, with the variants the rule must leave alone."""

    def __init__(self, approximate="tanh", reuse_gate=False, bias=False, swap=False, two_inputs=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate, self.up, self.down = (
            torch.nn.Linear(k, n, bias=bias) for n, k in ((96, 32), (96, 32), (32, 96))
        )
        for lin in (self.gate, self.up, self.down):
            torch.nn.init.normal_(lin.weight, std=0.2, generator=g)
        self.approximate, self.reuse_gate, self.swap, self.two_inputs = (
            approximate,
            reuse_gate,
            swap,
            two_inputs,
        )

    def forward(self, x):
        gate = self.gate(x)
        act, up = F.gelu(gate, approximate=self.approximate), self.up(x * 2 if self.two_inputs else x)
        out = self.down(up * act if self.swap else act * up)
        return out + gate[..., :32] if self.reuse_gate else out


def lowered(module, **switches):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    gm = lower(torch.export.export(module, (x,)).module(), LoweringSettings(**switches))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return gm(x), module(x), ops


@pytest.mark.parametrize("swap", [False, True])
def test_fuses_the_gate_exactly_on_a_cpu(swap):
    out, ref, ops = lowered(Gated(swap=swap), gelu_gate=True)  # gelu(gate) * up or up * gelu(gate)
    assert ops.count(GELU_GATE) == 1 and ops.count(aten.linear.default) == 2  # up and down remain
    assert aten.gelu.default not in ops
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(
    "variant,switches",
    [
        (dict(approximate="none"), dict(gelu_gate=True)),  # erf GELU: the epilogue computes tanh GELU
        (dict(reuse_gate=True), dict(gelu_gate=True)),  # the gate's output is read elsewhere too
        (dict(two_inputs=True), dict(gelu_gate=True)),  # gate and up read different inputs
        (dict(bias=True), dict(gelu_gate=True)),  # biases: the op has none
        ({}, {}),  # the switch (off by default)
    ],
)
def test_leaves_other_patterns_alone(variant, switches):
    out, ref, ops = lowered(Gated(**variant), **switches)
    assert GELU_GATE not in ops and ops.count(aten.linear.default) == 3
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_the_op_checks_its_arguments():
    x, w = torch.randn(3, 8), torch.randn(16, 8)
    torch.testing.assert_close(
        torch.ops.prx_compile.gelu_gate(x, w, torch.ones(3, 16)), F.gelu(x @ w.T, approximate="tanh")
    )
    with pytest.raises(ValueError, match="x has 8 features, gate_weight 7"):
        torch.ops.prx_compile.gelu_gate(x, w[:, :7], torch.ones(3, 16))
    with pytest.raises(ValueError, match=r"up has shape \(3, 15\)"):
        torch.ops.prx_compile.gelu_gate(x, w, torch.ones(3, 15))


@pytest.mark.parametrize("installed", [True, False])
def test_config_fuses_only_with_linears_in_pytorch_and_the_frontend(monkeypatch, installed):
    monkeypatch.setattr(cudnn_attention, "installed", lambda: installed)
    static = ShapeRange.static(2, 128, 128, 256, 2)
    cfg = CompileConfig.resolve(None)
    assert plan_of(cfg).lowering(static).gelu_gate is installed  # static_linears: torch (the default)
    assert plan_of(cfg).lowering(None).gelu_gate is False  # PyTorch backends keep aten.linear
    assert plan_of(cfg, static_linears="tensorrt").lowering(static).gelu_gate is False
    assert plan_of(cfg, fuse_mlp_gate=False).lowering(static).gelu_gate is False
    assert plan_of(cfg, precision="fp8").lowering(static).gelu_gate is False
    assert "fuse_mlp_gate" in cfg.engine_settings()
