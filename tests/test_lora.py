"""LoRA: exact fuse/unfuse/switch on eager and compiled (CPU backends); both file layouts; errors
leave the weights bit-identical."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from prx_compile import LoRAError, compile_prx
from prx_compile.lora import load_lora, make_random_lora, set_lora, summary, unload_lora
from prx_compile.tools.testing import make_prx

from .conftest import eager, prx_inputs

RANGE = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(params=["eager-model", "compiled-eager", "compiled-inductor"])
def target(request):
    model = make_prx()
    if request.param == "eager-model":
        return model, model
    return model, compile_prx(model, backend=request.param.split("-")[1], **RANGE)


def run(target, kw):
    with torch.no_grad():
        return target(**kw, return_dict=False)[0]


def test_fuse_switch_unload_are_exact(target):
    model, t = target
    kw = prx_inputs(model, h=16, w=16)
    w0, out0 = weights(model), run(t, kw)
    a = make_random_lora(model, 4, seed=1, std=0.1)
    b = make_random_lora(model, 8, seed=2, std=0.1, layout="kohya", alpha=4.0)
    load_lora(t, a, "a")
    wa, out_a = weights(model), run(t, kw)
    assert not same(wa, w0) and (out_a - out0).abs().max() > 1e-3
    torch.testing.assert_close(out_a, eager(model, kw), rtol=0, atol=1e-5)
    load_lora(t, b, "b", scale=0.5)  # a and b together
    set_lora(t, "b")
    set_lora(t, ["a"], [1.0])
    assert same(weights(model), wa)
    torch.testing.assert_close(run(t, kw), out_a, rtol=0, atol=1e-6)
    set_lora(t, ["a", "b"], [0.0, 0.0])
    assert same(weights(model), w0)
    assert summary(t)["active"] == {"a": 0.0, "b": 0.0}
    unload_lora(t)
    assert same(weights(model), w0) and summary(t) is None
    torch.testing.assert_close(run(t, kw), out0, rtol=0, atol=1e-6)


def test_lora_math_matches_the_definition():
    model = make_prx()
    w = model.blocks[0].attention.img_qkv_proj.weight.detach().clone()
    sd = make_random_lora(model, 4, seed=3, std=0.1, alpha=2.0)
    load_lora(model, sd, "x", scale=0.5)
    a = sd["transformer.blocks.0.attention.img_qkv_proj.lora_A.weight"]
    b = sd["transformer.blocks.0.attention.img_qkv_proj.lora_B.weight"]
    expected = (w.float() + 0.5 * (2.0 / 4) * (b @ a)).to(w.dtype)
    assert torch.equal(model.blocks[0].attention.img_qkv_proj.weight, expected)


@pytest.mark.parametrize("layout", ["peft", "kohya"])
def test_files_in_both_layouts(tmp_path, layout):
    model = make_prx()
    sd = make_random_lora(model, 4, seed=1, layout=layout)
    save_file(sd, str(tmp_path / "l.safetensors"))
    rep = load_lora(model, tmp_path / "l.safetensors", "f")
    assert rep["layers"] == 12 and rep["unmatched"] == []


def test_peft_directory_with_adapter_config(tmp_path):
    model = make_prx()
    sd = {k.replace("transformer.", "base_model.model."): v for k, v in make_random_lora(model, 4).items()}
    save_file(sd, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    w = model.blocks[0].up_proj.weight.detach().clone()
    load_lora(model, tmp_path, "p")
    a, b = (
        sd["base_model.model.blocks.0.up_proj.lora_A.weight"],
        sd["base_model.model.blocks.0.up_proj.lora_B.weight"],
    )
    assert torch.equal(model.blocks[0].up_proj.weight, (w.float() + 2.0 * (b @ a)).to(w.dtype))


def corrupt(kind, model, tmp_path):
    sd = make_random_lora(model, 4, seed=1)
    key_a = "transformer.blocks.0.up_proj.lora_A.weight"
    if kind == "unknown_key":
        sd["transformer.blocks.9.nope.lora_A.weight"] = torch.zeros(4, 64)
        sd["transformer.blocks.9.nope.lora_B.weight"] = torch.zeros(64, 4)
        return sd, r"match no Linear layer.*blocks\.9\.nope"
    if kind == "wrong_shape":
        sd[key_a] = torch.zeros(4, 65)
        return sd, r"blocks\.0\.up_proj expects A \(4, 64\)"
    if kind == "rank_mismatch":
        sd[key_a] = torch.zeros(3, 64)
        return sd, r"rank mismatch: down/A has rank 3, up/B has rank 4"
    if kind == "missing_half":
        del sd[key_a]
        return sd, r"blocks\.0\.up_proj has no lora_A/lora_down"
    if kind == "not_a_lora":
        return {"weight": torch.zeros(3)}, "it is not a LoRA"
    if kind == "not_safetensors":
        p = tmp_path / "x.safetensors"
        p.write_bytes(b"\x80\x04not a safetensors file")
        return p, "is not a safetensors LoRA file"
    if kind == "missing_file":
        return tmp_path / "nope.safetensors", "does not exist"
    if kind == "nan_values":
        sd[key_a][0, 0] = float("nan")
        return sd, r"blocks\.0\.up_proj matrix A/down holds NaN or infinite values"
    if kind == "inf_values":
        sd[key_a.replace("lora_A", "lora_B")][1, 1] = float("inf")
        return sd, r"blocks\.0\.up_proj matrix B/up holds NaN or infinite values"
    if kind == "nan_alpha":
        sd["transformer.blocks.0.up_proj.alpha"] = torch.tensor(float("nan"))
        return sd, r"alpha' is nan, not a finite number"
    if kind == "rank_zero":
        sd[key_a], sd[key_a.replace("lora_A", "lora_B")] = torch.zeros(0, 64), torch.zeros(128, 0)
        return sd, "has rank 0"
    if kind == "duplicate_matrix":
        sd["blocks.0.up_proj.lora_A.weight"] = sd[key_a] + 1  # the same layer without the prefix
        return sd, r"blocks\.0\.up_proj has two different lora_A/lora_down matrices"
    if kind == "integer_matrix":
        sd[key_a] = sd[key_a].to(torch.int32)
        return sd, "not a floating-point matrix"
    if kind == "bad_adapter_config":
        d = tmp_path / "peft"
        d.mkdir()
        save_file(sd, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text('{"r": 0, "lora_alpha": 8}')
        return d, "r=0 must be a positive number"
    if kind == "broken_adapter_config":
        d = tmp_path / "peft2"
        d.mkdir()
        save_file(sd, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha"')
        return d, "adapter_config.json is not valid JSON"
    if kind == "huge_alpha":
        sd["transformer.blocks.0.up_proj.alpha"] = torch.tensor(3e38)
        return sd, r"layer blocks\.0\.up_proj alpha 3e\+38 is beyond \+-100000"
    if kind == "alpha_over_r":
        sd["transformer.blocks.0.up_proj.alpha"] = torch.tensor(90000.0)
        return sd, r"layer blocks\.0\.up_proj: alpha / r = 90000 / 4 = 22500 is beyond \+-10000"
    if kind == "huge_matrices":  # finite in fp32, the product is not
        sd[key_a] = torch.full((4, 64), 1e19)
        sd[key_a.replace("lora_A", "lora_B")] = torch.full((128, 4), 1e19)
        return (
            sd,
            r"LoRA bad, good: layer blocks\.0\.up_proj: the fused weight is not finite in torch\.float32",
        )
    if kind == "zero_alpha":  # diffusers' converters: no update; kohya's trainers: alpha = r
        sd["transformer.blocks.0.up_proj.alpha"] = torch.tensor(0.0)
        return sd, r"alpha' is 0, which readers disagree on"
    if kind == "lora_bias":  # PEFT's lora_bias: left out, the rest of the LoRA applied (0.31)
        sd["transformer.blocks.0.up_proj.lora_B.bias"] = torch.ones(128)
        return sd, r"a LoRA bias \(lora_B\.bias: PEFT's lora_bias\) is not supported"
    if kind == "dora":
        sd["transformer.blocks.0.up_proj.lora_magnitude_vector"] = torch.ones(128)
        return sd, r"DoRA \(lora_magnitude_vector\) is not supported"
    if kind == "file_rank_over_max":  # refused from the header, before any tensor is read
        sd["transformer.elsewhere.lora_A.weight"] = torch.zeros(65537, 1, dtype=torch.float16)
        save_file(sd, str(tmp_path / "big.safetensors"))
        return tmp_path / "big.safetensors", r"lora_A\.weight' has rank 65537, more than 65536"
    if kind == "sparse_file":  # 1 GiB of holes: reading it would make a gigabyte of tensors
        p = tmp_path / "holes.safetensors"
        save_file(sd, str(p))
        with open(p, "r+b") as f:
            f.truncate(2**30)
        return p, "is a sparse file"
    if kind.startswith("adapter_config_"):
        d = tmp_path / kind
        d.mkdir()
        save_file(sd, str(d / "adapter_model.safetensors"))
        alpha, r, match = {
            "adapter_config_huge_alpha": (
                1e308,
                1e-300,
                r"lora_alpha=1e\+308 must be a positive number up to",
            ),
            "adapter_config_tiny_r": (8, 1e-300, r"r=1e-300 must be a positive number, an integer rank"),
            "adapter_config_big_int_alpha": (10**400, 4, r"lora_alpha=<1329-bit int> must be a positive"),
            "adapter_config_big_int_r": (8, 10**400, r"r=<1329-bit int> must be a positive number"),
            "adapter_config_scale": (100000, 1, r"alpha / r = 100000 / 1 = 100000 is beyond"),
        }[kind]
        (d / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": alpha}))
        return d, match
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "unknown_key",
        "wrong_shape",
        "rank_mismatch",
        "missing_half",
        "not_a_lora",
        "not_safetensors",
        "missing_file",
        "nan_values",
        "inf_values",
        "nan_alpha",
        "rank_zero",
        "duplicate_matrix",
        "integer_matrix",
        "bad_adapter_config",
        "broken_adapter_config",
        "huge_alpha",
        "alpha_over_r",
        "huge_matrices",
        "adapter_config_huge_alpha",
        "adapter_config_tiny_r",
        "adapter_config_big_int_alpha",
        "adapter_config_big_int_r",
        "adapter_config_scale",
        "zero_alpha",
        "lora_bias",
        "dora",
        "file_rank_over_max",
        "sparse_file",
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(kind, tmp_path):
    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    load_lora(ct, make_random_lora(model, 4, seed=5), "good", 0.3)
    before = weights(model)
    bad, match = corrupt(kind, model, tmp_path)
    with pytest.raises(LoRAError, match=match):
        load_lora(ct, bad, "bad")
    assert same(weights(model), before) and list(summary(ct)["adapters"]) == ["good"]


def test_other_errors_change_nothing():
    model = make_prx()
    load_lora(model, make_random_lora(model, 4), "a")
    before = weights(model)
    with pytest.raises(LoRAError, match="already loaded"):
        load_lora(model, make_random_lora(model, 4), "a")
    with pytest.raises(LoRAError, match=r"no adapter named \['zz'\]"):
        set_lora(model, ["zz"])
    with pytest.raises(LoRAError, match="2 adapter names and 1 scales"):
        set_lora(model, ["a", "a"], [1.0])
    assert same(weights(model), before)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda m: load_lora(m, make_random_lora(m, 4), "b", scale=float("nan")),
            "scale nan is not a finite",
        ),
        (lambda m: load_lora(m, make_random_lora(m, 4), "b", scale=True), "scale True is not a finite"),
        (lambda m: load_lora(m, make_random_lora(m, 4), "../b"), "adapter name"),
        (lambda m: set_lora(m, ["a"], [float("inf")]), "scale inf is not a finite"),
        (lambda m: set_lora(m, "a", "1"), "scale '1' is not a finite"),
        (lambda m: set_lora(m, "a", 10**400), r"scale <1329-bit int> is not a finite number in"),
        (lambda m: load_lora(m, make_random_lora(m, 4), "b", scale=10**400), "scale <1329-bit int> is not"),
        (lambda m: set_lora(m, "a", 1e5), r"scale 100000\.0 is not a finite number in \[-10000, 10000\]"),
    ],
)
def test_bad_scales_and_names_change_nothing(call, match):
    model = make_prx()
    load_lora(model, make_random_lora(model, 4), "a")
    before = weights(model)
    with pytest.raises(LoRAError, match=match):
        call(model)
    assert same(weights(model), before) and list(summary(model)["adapters"]) == ["a"]


def test_messages_show_a_bounded_part_of_hostile_keys():
    """0.31 put whole keys in its messages: five unmatched keys of 4 MiB made one of 20 M characters."""
    model = make_prx()
    sd = make_random_lora(model, 4, seed=1)
    sd.update({("x" * 2**22) + f"{i}.lora_A.weight": torch.zeros(1) for i in range(5)})
    with pytest.raises(LoRAError, match="match no Linear layer") as e:
        load_lora(model, sd, "long")
    assert len(str(e.value)) < 1500


def test_identical_duplicate_keys_are_accepted():
    model = make_prx()
    sd = make_random_lora(model, 4)
    sd["blocks.0.up_proj.lora_A.weight"] = sd["transformer.blocks.0.up_proj.lora_A.weight"].clone()
    assert load_lora(model, sd, "a")["layers"] == 12


def test_non_strict_reports_unmatched_keys():
    model = make_prx()
    sd = make_random_lora(model, 4)
    sd["text_encoder.layer.lora_A.weight"] = torch.zeros(4, 4)
    rep = load_lora(model, sd, "a", strict=False)
    assert rep["unmatched"] == ["text_encoder.layer.lora_A.weight"]


def test_pipeline_helper():
    from prx_compile.tools.testing import tiny_pipeline

    pipe = tiny_pipeline()
    load_lora(pipe, make_random_lora(pipe.transformer, 4), "p")
    assert summary(pipe)["active"] == {"p": 1.0}
    unload_lora(pipe)


def test_originals_that_cannot_be_pinned_are_a_lora_error_that_changes_nothing(monkeypatch):
    """Host masters (fp8_masters: host) keep a LoRA's originals pinned; a host that cannot pin them
    refuses the LoRA in one line, the weights as they were (pinning is faked on this CPU)."""
    model = make_prx()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(LoRAError, match=r"could not pin \d+ MB .*fp8_masters: device; nothing was changed"):
        load_lora(model, make_random_lora(model, 4, seed=1, std=0.1), "a")
    monkeypatch.undo()
    assert summary(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_failing_refit_rolls_the_weights_back(monkeypatch):
    """With weights baked into engines a refit can fail: the parameters then return to their values."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    ct(**prx_inputs(model, h=16, w=16), return_dict=False)
    load_lora(ct, make_random_lora(model, 4, seed=5), "good", 0.3)
    before = weights(model)
    backend = next(b for b in ct.backends if b.is_built)
    calls = []

    def refit(names):
        calls.append(sorted(names))
        if len(calls) == 1:
            raise RuntimeError("TensorRT refit_cuda_engine() failed")
        return {"refit_s": 0.0}

    monkeypatch.setattr(type(backend), "needs_refit", property(lambda self: True))
    monkeypatch.setattr(backend, "weights_changed", refit)
    with pytest.raises(RuntimeError, match="refit_cuda_engine"):
        load_lora(ct, make_random_lora(model, 4, seed=6), "bad")
    assert same(weights(model), before) and list(summary(ct)["adapters"]) == ["good"]
    assert len(calls) == 2 and calls[0] == calls[1]  # the restored values were pushed again


def test_a_failure_half_way_through_a_merge_rolls_every_weight_back(monkeypatch):
    """The weights are written layer by layer: out of memory at the third, the two already written
    go back too, the adapter is not kept, and the module still switches exactly afterwards."""
    from prx_compile.lora import adapters

    model = make_prx()
    kw = prx_inputs(model, h=16, w=16)
    ct = compile_prx(model, backend="eager", **RANGE)
    base_out = ct(**kw, return_dict=False)[0]
    load_lora(ct, make_random_lora(model, 4, seed=5, std=0.1), "good", 0.3)
    before, good_out = weights(model), ct(**kw, return_dict=False)[0]
    real, calls = adapters._fuse, []

    def fuse(w0, terms, out):
        calls.append(len(terms))
        if len(calls) == 3:
            raise RuntimeError("CUDA error: out of memory")
        return real(w0, terms, out)

    monkeypatch.setattr(adapters, "_fuse", fuse)
    with pytest.raises(RuntimeError, match="out of memory"):
        load_lora(ct, make_random_lora(model, 4, seed=6, std=0.1), "bad")
    monkeypatch.undo()
    assert same(weights(model), before) and list(summary(ct)["adapters"]) == ["good"]
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], good_out, rtol=0, atol=0)
    unload_lora(ct)
    torch.testing.assert_close(ct(**kw, return_dict=False)[0], base_out, rtol=0, atol=0)


def test_fused_weights_are_checked_in_the_weight_dtype():
    """An fp16 weight overflows at 65504: a LoRA finite in fp32 (and accepted by an fp32 model) that
    makes it infinite is refused naming the layer, at load and at a switch, and nothing changes."""
    sd = make_random_lora(make_prx(), 4, seed=2)
    key = "transformer.blocks.0.up_proj.lora_"
    sd[key + "A.weight"], sd[key + "B.weight"] = torch.full((4, 64), 200.0), torch.full((128, 4), 200.0)
    fp32 = make_prx()
    load_lora(fp32, sd, "big")
    assert float(fp32.blocks[0].up_proj.weight.detach().abs().max()) > 160_000 - 1  # 200 * 200 * 4
    half = make_prx(dtype=torch.float16)
    before = weights(half)
    with pytest.raises(
        LoRAError, match=r"layer blocks\.0\.up_proj: the fused weight is not finite in torch\.float16"
    ):
        load_lora(half, sd, "big")
    assert same(weights(half), before) and summary(half) is None
    load_lora(half, sd, "big", scale=0.25)  # 40000: finite in fp16
    assert bool(torch.isfinite(half.blocks[0].up_proj.weight).all())
    before = weights(half)
    with pytest.raises(LoRAError, match=r"LoRA big: layer blocks\.0\.up_proj.*float16 \(scales \[1\.0\]\)"):
        set_lora(half, "big", 1.0)
    assert same(weights(half), before) and summary(half)["active"] == {"big": 0.25}


def test_fp16_alpha_of_1e7_is_refused():
    model = make_prx(dtype=torch.float16)
    sd = make_random_lora(model, 4, alpha=1e7)
    with pytest.raises(LoRAError, match=r"alpha 1e\+07 is beyond"):
        load_lora(model, sd, "a")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_new_base_weights_keep_the_lora_over_them_and_unload_leaves_exactly_them(compiled):
    """0.16: load_lora, then load_state_dict of another fine-tune, then unload_lora left the output 15 %
    off on a CPU (7 % on the H200), silently: the unload subtracted a LoRA the new weights never held.
    As PEFT: a loaded LoRA stays applied over new base weights (strict or partial), and unloading
    leaves exactly them; writing back what state_dict() gave changes nothing."""
    from prx_compile import compile_prx

    model, other = make_prx(), make_prx(seed=5)
    kw = prx_inputs(model, h=16, w=16, text=16)
    target = (
        compile_prx(
            model,
            backend="eager",
            device="cpu",
            static=True,
            specialize=[[16, 16, 2]],
            batch=[1, 2],
            text_len=[1, 16],
            resolution=16,
            aspect_bins=[],
            vae_scale_factor=1,
        )
        if compiled
        else model
    )
    lora = make_random_lora(model, 4, std=0.1, seed=1)
    load_lora(target, lora, "a", 0.9)
    with torch.no_grad():
        target.load_state_dict(other.state_dict())
    want = copy.deepcopy(other)
    load_lora(want, lora, "a", 0.9)
    assert torch.equal(target(**kw, return_dict=False)[0], eager(want, kw))  # the LoRA over the new base
    assert summary(target)["active"] == {"a": 0.9}
    with torch.no_grad():
        target.load_state_dict(target.state_dict())  # what runs, written back: no change
    assert torch.equal(target(**kw, return_dict=False)[0], eager(want, kw))
    part = {k: v for k, v in make_prx(seed=9).state_dict().items() if k.startswith("blocks.1.")}
    with torch.no_grad():
        target.load_state_dict(part, strict=False)  # one block's new base
        other.load_state_dict(part, strict=False)
    unload_lora(target)
    assert torch.equal(target(**kw, return_dict=False)[0], eager(other, kw))  # exactly the new base


def _flux_lora_file(tmp_path, metadata=None):
    from prx_compile.tools.testing import make_flux

    model = make_flux()
    sd = make_random_lora(model, 4, std=0.1)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    save_file(sd, str(path), metadata={"format": "pt", **(metadata or {})})
    layer = "transformer_blocks.0.attn.to_q"
    delta = sd[f"transformer.{layer}.lora_B.weight"] @ sd[f"transformer.{layer}.lora_A.weight"]
    return model, path, layer, delta


@pytest.mark.parametrize(
    "config, scale",
    [
        ({"transformer.r": 4, "transformer.lora_alpha": 8}, 2.0),
        ({"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.use_rslora": True}, 4.0),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]}, 2.0),
        ({"text_encoder.r": 4, "text_encoder.lora_alpha": 8}, 1.0),
        (None, 1.0),
    ],
    ids=["alpha-over-r", "rslora", "model-save-lora-adapter", "another-component", "none"],
)
def test_the_alpha_diffusers_writes_in_the_file_header_is_applied(tmp_path, config, scale):
    """diffusers' ``save_lora_weights(..., transformer_lora_adapter_metadata=LoraConfig(...).to_dict())``
    keeps the config in the header as ``lora_adapter_metadata`` (keys prefixed by component; a model's
    ``save_lora_adapter`` writes them bare); diffusers applies its alpha / r (alpha / sqrt(r) with
    rsLoRA), and so does load_lora (0.26 applied 1.0)."""
    meta = {} if config is None else {"lora_adapter_metadata": json.dumps(config)}
    model, path, layer, delta = _flux_lora_file(tmp_path, meta)
    w0 = model.get_parameter(f"{layer}.weight").detach().clone()
    load_lora(model, path, "m")
    d = model.get_parameter(f"{layer}.weight").detach() - w0
    assert abs(float((d * delta).sum() / (delta * delta).sum()) - scale) < 1e-4


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"r": 4, "lora_alpha": 8, "alpha_pattern": {"to_q": 40}},
            "per-layer alpha_pattern is not supported",
        ),
        ({"r": 4, "lora_alpha": 8, "rank_pattern": {"to_q": 2}}, "per-layer rank_pattern is not supported"),
        ({"r": 8, "lora_alpha": 8}, "has rank 4; its adapter config says r=8"),
        ({"r": 4, "lora_alpha": 8, "use_rslora": "yes"}, "use_rslora='yes' must be true or false"),
    ],
    ids=["alpha-pattern", "rank-pattern", "rank", "rslora-type"],
)
def test_an_adapter_config_it_cannot_apply_exactly_is_refused(tmp_path, config, match):
    """In the file's header or a PEFT folder's adapter_config.json: refused, never ignored."""
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    model, path, _, _ = _flux_lora_file(tmp_path, meta)
    before = weights(model)
    with pytest.raises(LoRAError, match=match):
        load_lora(model, path, "m")
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file(
        {k.replace("transformer.", "base_model.model."): v for k, v in make_random_lora(model, 4).items()},
        str(folder / "adapter_model.safetensors"),
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match=match):
        load_lora(model, folder, "p")
    assert same(weights(model), before)


def test_an_fp8_lora_file_loads_as_its_fp32_values(tmp_path):
    model, twin = make_prx(), make_prx()
    sd = {k: v.to(torch.float8_e4m3fn) for k, v in make_random_lora(model, 4, std=0.1).items()}
    save_file(sd, str(tmp_path / "fp8.safetensors"))
    load_lora(model, tmp_path / "fp8.safetensors", "q")
    load_lora(twin, {k: v.float() for k, v in sd.items()}, "q")
    assert same(weights(model), weights(twin))


def test_unload_restores_what_is_left_after_the_structure_changed(caplog):
    """A LoRA'd block removed: the call says the LoRA cannot stay applied and how to recover;
    unload_lora then restores every weight that is left (0.26 raised a raw KeyError)."""
    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    base = weights(model)
    load_lora(ct, make_random_lora(model, 4, std=0.1), "a")
    model.blocks = torch.nn.ModuleList(list(model.blocks)[:1])
    kw = prx_inputs(model, text=16)
    with pytest.raises(LoRAError, match="unload_lora .it restores the weights that are left"):
        run(ct, kw)
    unload_lora(ct)
    assert same(weights(model), {k: v for k, v in base.items() if k in model.state_dict()})
    assert summary(ct) is None
    assert torch.equal(run(ct, kw), eager(model, kw))


def test_casts_and_saves_see_every_write_made_since_the_last_call(tmp_path):
    """No call between the operations (0.26 lost them): new base weights then a cast keep the LoRA
    over the new base; a cast there and back, then an unload, leaves the cast base; a swapped layer
    then an unload keeps the new layer's weights; save_pretrained right after an edit writes it
    with the LoRA over it."""
    from safetensors.torch import load_file

    lora = make_random_lora(make_prx(), 4, std=0.1, seed=1)

    def twins():
        model = make_prx()
        return model, compile_prx(model, backend="eager", **RANGE)

    def with_lora(model):
        model = copy.deepcopy(model)
        load_lora(model, lora, "a")
        return model

    kw = prx_inputs(make_prx(), text=16)
    kw_bf16 = {
        k: v.bfloat16() if k in ("hidden_states", "encoder_hidden_states") else v for k, v in kw.items()
    }
    model, ct = twins()
    load_lora(ct, lora, "a")
    new = make_prx(seed=3)
    ct.load_state_dict(new.state_dict())
    ct.to(torch.bfloat16)
    assert torch.equal(run(ct, kw_bf16), eager(with_lora(new.to(torch.bfloat16)), kw_bf16))

    for cast in ("compiled", "transformer", "eager"):  # the compiled module's .to, or around it
        model, ct = twins()
        target = model if cast == "eager" else ct
        load_lora(target, lora, "a")
        # held: else the allocator may give the weights their old addresses back, which makes the
        # round trip invisible (docs/semantics.md); the compiled module's .to() sees it regardless
        held = [p.detach() for p in model.parameters()] if cast != "compiled" else []
        (ct if cast == "compiled" else model).half().float()
        del held
        unload_lora(target)
        want = make_prx().half().float()
        assert same(weights(model), weights(want)), cast  # exactly the base, rounded through fp16
        torch.testing.assert_close(run(target, kw), eager(want, kw), rtol=0, atol=1e-5)  # an output's
        # last bit may differ between two models (a CPU matmul's depends on its buffers' alignment)

    model, ct = twins()
    load_lora(ct, lora, "a")
    layer = torch.nn.Linear(
        model.blocks[0].up_proj.in_features, model.blocks[0].up_proj.out_features, bias=False
    )
    mine = layer.weight.detach().clone()
    model.blocks[0].up_proj = layer
    unload_lora(ct)
    assert torch.equal(layer.weight, mine)

    model, ct = twins()
    load_lora(ct, lora, "a")
    w = "blocks.0.up_proj.weight"
    x = torch.randn_like(model.get_parameter(w)) * 0.05
    with torch.no_grad():
        model.get_parameter(w).copy_(x)
    ct.save_pretrained(tmp_path / "saved")
    saved = load_file(str(next((tmp_path / "saved").glob("*.safetensors"))))
    assert torch.equal(saved[w], model.get_parameter(w)) and not torch.equal(saved[w], x)


def test_an_edit_of_a_weight_holding_a_loras_share_is_said(caplog):
    """A weight an active adapter changed holds base + share: ``mul_(2)`` doubles both, and the
    result is the new base (``docs/semantics.md``), where PEFT would double the base alone. 0.31
    took it silently; a write of the value that runs is no edit and says nothing."""
    import logging

    model = make_prx()
    ct = compile_prx(model, backend="eager", **RANGE)
    load_lora(ct, make_random_lora(model, 4, seed=1), "a")
    kw = prx_inputs(model)
    ct(**kw, return_dict=False)
    with caplog.at_level(logging.WARNING, logger="prx_compile.lora"):
        model.load_state_dict(model.state_dict())
        ct(**kw, return_dict=False)
        assert "holding a LoRA's share" not in caplog.text
        with torch.no_grad():
            model.blocks[0].up_proj.weight.mul_(2)
        ct(**kw, return_dict=False)
    assert "1 weight(s) holding a LoRA's share were written (blocks.0.up_proj.weight)" in caplog.text
