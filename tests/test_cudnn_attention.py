"""``attention_kernel`` on a CPU: what the config resolves to with and without FlashAttention-4 and
cuDNN's frontend, the lowering rule, the one-call ops' named fallbacks (FlashAttention-4, then cuDNN,
then the split path), and the key-padding layout the Triton
norm/RoPE kernel writes (in Triton's CPU interpreter, where triton is installed), with exact
attention over it against ``prx_attention``."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from prx_compile import CompileConfig, ConfigError
from prx_compile.lowering import LoweringSettings, lower
from prx_compile.ops import (
    PRX_ATTENTION,
    PRX_ATTENTION_CUDNN,
    PRX_ATTENTION_FLASH4,
    PRX_ATTENTION_FP8,
    cudnn_attention,
    flash4_attention,
    kernels,
    library,
)

from .conftest import plan_of


def op_args(b=2, seq=24, t=10, h=2, d=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    img_qkv, txt_kv = torch.randn(b, seq, 3 * h * d, generator=g), torch.randn(b, t, 2 * h * d, generator=g)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, [1, 4, 5]] = True  # scattered kept tokens; row 1 keeps none
    rope_angle = torch.randn(b, seq, d // 2, generator=g)
    c, s = rope_angle.cos(), rope_angle.sin()
    rope = torch.stack([c, -s, s, c], -1).reshape(b, 1, seq, d // 2, 2, 2)
    ws = [1 + 0.2 * torch.randn(d, generator=g) for _ in range(3)]
    return [img_qkv, txt_kv, mask, rope, *ws, h, 1e-6, d**-0.5]


@pytest.mark.parametrize(
    "kernel, flash4, cudnn, expected",
    [
        ("auto", True, True, "flash4"),
        ("auto", False, True, "cudnn"),
        ("auto", False, False, None),
        ("flash4", True, False, "flash4"),
        ("cudnn", True, True, "cudnn"),
        ("split", True, True, None),
    ],
)
def test_attention_kernel_resolves_by_the_packages(monkeypatch, kernel, flash4, cudnn, expected):
    monkeypatch.setattr(flash4_attention, "installed", lambda: flash4)
    monkeypatch.setattr(cudnn_attention, "installed", lambda: cudnn)
    assert plan_of(attention_kernel=kernel).lowering().padded_attention == expected
    assert (
        plan_of(attention_kernel=kernel, attention="flash").lowering().padded_attention is None
    )  # fused only


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("cudnn", r"attention_kernel=cudnn needs cuDNN's frontend.*prx_compile\[cudnn\]"),
        (
            "flash4",
            r"attention_kernel=flash4 needs FlashAttention-4 \(the flash-attn-4.*prx_compile\[flash4\]",
        ),
    ],
)
def test_a_kernel_without_its_package_is_a_config_error(monkeypatch, kernel, message):
    monkeypatch.setattr(cudnn_attention, "installed", lambda: False)
    monkeypatch.setattr(flash4_attention, "installed", lambda: False)
    with pytest.raises(ConfigError, match=message):
        plan_of(attention_kernel=kernel)


def test_flux_takes_cudnn_without_the_extra(monkeypatch):
    """FLUX's dense attention reaches cuDNN through PyTorch's SDPA: the frontend is not needed."""
    from prx_compile import compile_transformer
    from prx_compile.tools.testing import make_flux

    monkeypatch.setattr(cudnn_attention, "installed", lambda: False)
    ct = compile_transformer(make_flux(), backend="eager", device="cpu", attention_kernel="cudnn")
    assert ct.plan.attention_candidates == ("cudnn",)


def test_lowering_settings_take_only_the_known_kernels():
    with pytest.raises(ConfigError, match=r"padded_attention='flash3' is not one of"):
        LoweringSettings(padded_attention="flash3")


def test_flash4_is_not_installed_here_and_loads_nothing_off_cuda():
    """CI has no FlashAttention-4 (and no GPU): the config's ``auto`` must not pick it, and asking
    for its kernel imports nothing."""
    if importlib.util.find_spec("flash_attn") is None:
        assert not flash4_attention.installed()
    if not torch.cuda.is_available():
        assert flash4_attention.kernel() is None


def test_attention_kernel_keys_the_engine_cache():
    keys = {
        str(CompileConfig.resolve(None, attention_kernel=k).engine_settings())
        for k in ("auto", "flash4", "cudnn", "split")
    }
    assert len(keys) == 4


def test_rule_retargets_what_fp8_attention_left():
    def graph():
        g = torch.fx.Graph()
        a = [g.placeholder(n) for n in ("qkv", "kv", "mask", "w")]
        g.output(g.call_function(PRX_ATTENTION, (a[0], a[1], a[2], None, a[3], a[3], a[3], 2, 1e-6, 0.25)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    def targets(settings):
        return [n.target for n in lower(graph(), settings).graph.nodes if n.op == "call_function"]

    assert targets(LoweringSettings()) == [PRX_ATTENTION]
    assert targets(LoweringSettings(padded_attention="cudnn")) == [PRX_ATTENTION_CUDNN]
    assert targets(LoweringSettings(padded_attention="flash4")) == [PRX_ATTENTION_FLASH4]
    assert targets(LoweringSettings(padded_attention="flash4", fp8_attention=True)) == [PRX_ATTENTION_FP8]


@pytest.mark.parametrize("op", ["prx_attention_cudnn", "prx_attention_flash4"])
def test_the_op_falls_back_to_prx_attention_off_cuda(op):
    args = op_args()
    torch.testing.assert_close(
        getattr(torch.ops.prx_compile, op)(*args),
        torch.ops.prx_compile.prx_attention(*args),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "kind, flash4, cudnn, expected",
    [
        ("flash4", True, True, flash4_attention),
        ("flash4", False, True, cudnn_attention),  # FlashAttention-4 cannot run: cuDNN
        ("flash4", False, False, None),  # neither: the split path
        ("cudnn", True, True, cudnn_attention),
        ("cudnn", True, False, None),
    ],
)
def test_the_one_call_kernel_falls_back_in_order(monkeypatch, kind, flash4, cudnn, expected):
    monkeypatch.setattr(kernels, "norm_rope_supported", lambda x: True)
    monkeypatch.setattr(flash4_attention, "supported", lambda q: flash4)
    monkeypatch.setattr(cudnn_attention, "supported", lambda q: cudnn)
    qkv = torch.zeros(2, 8, 3, 2, 16)
    assert library._padded_kernel(kind, qkv, torch.ones(16), 4) is expected
    assert library._padded_kernel(kind, qkv, torch.ones(16), 0) is None  # no text token
    assert library._padded_kernel(kind, qkv, torch.ones(16, dtype=torch.float64), 4) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its CPU interpreter)")
def test_padded_layout_from_the_kernel_gives_prx_attention():
    """The norm/RoPE kernel (interpreted) writes [image keys; kept text keys; zeros] and the lengths;
    exact attention over each row's first ``seq_len_kv`` keys is ``prx_attention``. In a new process:
    TRITON_INTERPRET must be set before triton is first imported (torch imports it where installed)."""
    code = "from tests.test_cudnn_attention import padded_layout_check; padded_layout_check()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def padded_layout_check() -> None:
    """The body of the test above (fp32: the interpreter's bf16 casts do not round as the GPU's)."""
    from prx_compile.ops import kernels

    img_qkv, txt_kv, mask, rope, wq, wk, wt, h, eps, scale = op_args()
    b, seq, t, d = img_qkv.shape[0], img_qkv.shape[1], txt_kv.shape[1], wq.shape[0]
    ref = torch.ops.prx_compile.prx_attention(img_qkv, txt_kv, mask, rope, wq, wk, wt, h, eps, scale)
    qkv, kv = img_qkv.view(b, seq, 3, h, d), txt_kv.clone().view(b, t, 2, h, d)
    kv[~mask] = float("nan")  # dropped tokens: never read into the layout
    keys = torch.full((b, seq + t, h, d), 5.0)
    values = keys.clone()
    lengths = cudnn_attention.seq_buffer(b, keys.device).fill_(-1)
    kernels.qk_norm_rope_into(qkv[:, :, 1], wk, eps, rope[:, 0], qkv[:, :, 2], keys, values, 0)
    kernels.qk_norm_rope_into(kv[:, :, 0], wt, eps, None, kv[:, :, 1], keys, values, seq, mask, lengths, seq)
    assert lengths[:, :b].tolist() == [[seq, seq], [seq + 3, seq]], lengths
    assert (keys[0, seq + 3 :] == 0).all() and (values[1, seq:] == 0).all()
    q = library.qk_norm_rope_torch(qkv[:, :, 0], wq, eps, rope[:, 0])
    live = torch.arange(seq + t)[None] < lengths[1, :b, None]
    got = library._reference(q, keys, values, live, scale).reshape(b, seq, h * d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_into_refuses_buffers_that_do_not_fit():
    from prx_compile.ops import kernels

    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="mask must be"):
        kernels.qk_norm_rope_into(x, torch.ones(8), 1e-6, None, None, torch.empty(1, 8, 2, 8), None, 0,
                                  torch.ones(1, 4))  # fmt: skip


def test_every_prx_compile_op_may_run_in_a_program():
    """A Program (and an artifact's) runs only the ops it lists: each ``torch.ops.prx_compile`` op
    that can run in PyTorch between engines must be one (the GPU tests once found
    ``prx_attention_cudnn`` missing). ``block_boundary`` only marks blocks during an export and is
    removed before a Program is made."""
    import prx_compile.export.repeat  # noqa: F401  (registers block_boundary)
    from prx_compile.backends.tensorrt import program

    names = [
        n for n in dir(torch.ops.prx_compile) if not n.startswith("_") and n not in ("name", "block_boundary")
    ]
    ops = [getattr(torch.ops.prx_compile, n) for n in names]
    ops = [str(op.default) for op in ops if hasattr(op, "default")]
    assert "prx_compile.prx_attention_cudnn.default" in ops and len(ops) >= 9, ops
    assert "prx_compile.prx_attention_flash4.default" in ops
    assert set(ops) <= set(program.OPS), set(ops) - set(program.OPS)


FP8 = ("fp8/0", "fp8/1", "fp8/2", "fp8/3")


@pytest.mark.parametrize(
    "overrides, flash4, cudnn, expected",
    [
        ({}, True, True, ("flash4", "cudnn", "split")),
        ({}, False, False, ("split",)),
        ({"attention_kernel": "cudnn"}, True, True, ("cudnn",)),
        ({"attention": "flash"}, True, True, ("split",)),
        ({"precision": "fp8"}, True, False, (*FP8, "flash4", "split")),
        ({"precision": "fp8", "fp8_attention": True}, True, True, (*FP8, "cudnn_fp8")),
        ({"precision": "fp8", "fp8_attention": True}, True, False, FP8),
        ({"precision": "fp8", "fp8_attention": False}, False, True, ("cudnn", "split")),
        ({"precision": "fp8", "attention_kernel": "split"}, True, True, (*FP8, "cudnn_fp8", "split")),
    ],
)
def test_the_attention_candidates_are_what_the_config_and_the_packages_allow(
    monkeypatch, overrides, flash4, cudnn, expected
):
    """Each engine set measures these and keeps the fastest (``ops.choice``): no size rule
    decides; ``fp8_attention: true`` and an explicit kernel narrow them; unmeasured, the first runs."""
    monkeypatch.setattr(flash4_attention, "installed", lambda: flash4)
    monkeypatch.setattr(cudnn_attention, "installed", lambda: cudnn)
    plan = plan_of(**overrides)
    assert plan.attention_candidates == expected
    first = plan.lowering()
    assert first.fp8_attention is (expected[0] == "fp8/0")
    assert first.padded_attention == (expected[0] if expected[0] in ("flash4", "cudnn") else None)


@pytest.mark.parametrize("value", [1, 0, "yes", None, "AUTO", [True]])
def test_fp8_attention_takes_true_false_or_auto(value):
    with pytest.raises(ConfigError, match=r"fp8_attention=.* must be true, false or auto"):
        CompileConfig.resolve(None, fp8_attention=value)
