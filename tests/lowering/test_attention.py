"""The attention rule on hand-made graphs: which SDPA nodes it takes, what it emits, exactness."""

import pytest
import torch
import torch.nn.functional as F

from prx_compile.lowering import RULES, LoweringSettings, lower
from prx_compile.ops import FLASH_ATTENTION, JOINT_ATTENTION

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class Attn(torch.nn.Module):
    def __init__(self, expand_mask: bool = False):
        super().__init__()
        self.expand_mask = expand_mask

    def forward(self, q, k, v, mask=None):
        if self.expand_mask:  # diffusers 0.36 materialised the mask as [B, H, Lq, Lk] inside the model
            mask = mask.expand(-1, q.shape[1], q.shape[2], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Joint(torch.nn.Module):
    """PRX's pattern: keys/values are cat([text, image]); the mask is cat([text mask, ones])."""

    def forward(self, q, kt, vt, ki, vi, text_mask):
        k, v = torch.cat([kt, ki], dim=2), torch.cat([vt, vi], dim=2)
        ones = torch.ones(q.shape[0], ki.shape[2], dtype=torch.bool)
        mask = torch.cat([text_mask, ones], dim=-1)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def run(module, args, form, **switches):
    gm = lower(torch.export.export(module, args).module(), LoweringSettings(attention=form, **switches))
    return gm, {n.target for n in gm.graph.nodes if n.op == "call_function"}


def qkv(b=2, h=2, lq=5, lk=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk)]


def key_mask(b=2, lk=9, hide=(1, slice(0, 4))):
    m = torch.ones(b, lk, dtype=torch.bool)
    m[hide] = False
    return m


@pytest.mark.parametrize(
    "form,expected,unexpected",
    [
        ("flash", {FLASH_ATTENTION}, {SDPA, aten._softmax.default}),
        ("tensorrt", {aten._softmax.default, aten.matmul.default}, {SDPA, FLASH_ATTENTION}),
    ],
)
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "expanded"])
def test_masked_joint_sdpa_forms_are_exact(form, expected, unexpected, mask_kind):
    q, k, v = qkv()
    m = key_mask()[:, None, None, :]
    if mask_kind == "additive":
        m = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    module = Attn(expand_mask=mask_kind == "expanded")
    gm, t = run(module, (q, k, v, m), form)
    assert expected <= t and not unexpected & t
    torch.testing.assert_close(gm(q, k, v, m), module(q, k, v, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["flash", "tensorrt"])
def test_a_row_with_every_key_masked_is_finite_and_zero(form):
    q, k, v = qkv()
    m = key_mask(hide=(1, slice(None)))[:, None, None, :]  # row 1 may attend to nothing
    gm, _ = run(Attn(), (q, k, v, m), form)
    out = gm(q, k, v, m)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, Attn()(q, k, v, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["flash", "tensorrt"])
def test_query_dependent_mask_never_goes_causal(form):
    q, k, v = qkv()
    m = torch.rand(2, 1, 5, 9) > 0.3
    m[..., 0] = True
    gm, t = run(Attn(), (q, k, v, m), form)
    assert SDPA not in t and FLASH_ATTENTION not in t  # not a key mask: form (a) for both settings
    torch.testing.assert_close(gm(q, k, v, m), Attn()(q, k, v, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hidden", [0, 2, 4])  # none, some, all text tokens of row 1
def test_joint_pattern_becomes_joint_attention(hidden):
    g = torch.Generator().manual_seed(1)
    q, ki, vi = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    kt, vt = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(2))
    tm = torch.ones(2, 4, dtype=torch.bool)
    tm[1, 4 - hidden :] = False
    args = (q, kt, vt, ki, vi, tm)
    gm, t = run(Joint(), args, "flash")
    assert JOINT_ATTENTION in t and SDPA not in t
    torch.testing.assert_close(gm(*args), Joint()(*args), rtol=1e-5, atol=1e-5)


def test_unmasked_self_attention_is_left_to_torch_tensorrt():
    q, k, v = qkv(lk=5)
    _, t = run(Attn(), (q, k, v), "flash")
    assert SDPA in t


def test_unmasked_cross_attention_is_rewritten():
    q, k, v = qkv(lq=5, lk=9)
    gm, t = run(Attn(), (q, k, v), "flash")
    assert FLASH_ATTENTION in t and SDPA not in t
    torch.testing.assert_close(gm(q, k, v), Attn()(q, k, v), rtol=1e-5, atol=1e-5)


def test_causal_and_dropout_are_left_alone():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv(lk=5)
    _, t = run(Causal(), (q, k, v), "flash")
    assert SDPA in t


def test_rules_registry_is_ordered_and_documented():
    assert list(RULES) == [
        "unfold",
        "fold",
        "attention",
        "select",
        "fp8_mlp",
        "fp8_inputs",
        "fp8_norm",
        "fp8_attention",
        "padded_attention",
        "dense_attention",
        "gelu_gate",
        "linear",
        "linear_glue",
    ]
    for rule in RULES.values():
        assert rule.__doc__ and rule.__module__.startswith("prx_compile.lowering.")
        assert "Matches" in __import__(rule.__module__, fromlist=["x"]).__doc__


def test_select_rule_emits_slices():
    class Sel(torch.nn.Module):
        def forward(self, x):
            return x[..., 0] * x[:, 1]

    x = torch.randn(2, 3, 3)
    gm, t = run(Sel(), (x,), "flash")
    assert aten.select.int not in t and aten.slice.Tensor in t
    assert torch.equal(gm(x), Sel()(x))
    _, t = run(Sel(), (x,), "flash", select_as_slice=False)
    assert aten.select.int in t


def test_bad_form_is_a_clear_error():
    from prx_compile import ConfigError

    with pytest.raises(ConfigError, match="attention='fast'"):
        LoweringSettings(attention="fast")


def test_graph_without_shapes_is_left_untouched():
    gm = torch.fx.symbolic_trace(Attn())
    before = [n.target for n in gm.graph.nodes]
    lower(gm)
    assert [n.target for n in gm.graph.nodes] == before
