"""diffusers' LoRA methods on a compiled transformer (``lora/diffusers.py``): they act on prx_compile's
adapters as PEFT's act on PEFT layers (0.27's were PEFT's own: ``load_lora_weights`` added layers the
engines never call, and ``disable_lora``, ``delete_adapters`` and ``unload_lora_weights`` left the LoRA
in the weights, silently). CPU, eager backend, the tiny FLUX.1; outputs compared with diffusers' own
LoRA (PEFT) on an eager copy where PEFT is installed (the dev extra has it), and with ``load_lora`` /
``set_lora`` on an eager copy."""

import numpy as np
import pytest
import torch

from prx_compile import ConfigError, LoRAError, compile_transformer, load_lora, set_lora, unload_lora
from prx_compile.lora import adapters as lora_module
from prx_compile.lora import make_random_lora
from prx_compile.tools.testing import make_flux, tiny_flux_pipeline

from .conftest import eager


def inputs(model):
    from prx_compile.export import example_inputs

    return example_inputs(model, 1, 64, 1, 8)  # FLUX: 64 image tokens, 8 text tokens


def loras(model):
    return {n: make_random_lora(model, rank=2, seed=s, std=0.2) for n, s in (("a", 1), ("b", 2))}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_the_transformers_adapter_methods_act_on_the_loaded_lora():
    model, twin = make_flux(seed=0), make_flux(seed=0)
    ct = compile_transformer(model, backend="eager")
    kw = inputs(model)
    base = ct(**kw, return_dict=False)[0]
    with pytest.raises(LoRAError, match="set_adapters: no LoRA is loaded"):
        ct.set_adapters(["a"])
    ct.disable_lora(), ct.enable_lora(), ct.unload_lora()  # nothing loaded: nothing to do, as PEFT
    assert ct.active_adapters() == [] and not hasattr(ct, "peft_config")
    for name, lora in loras(model).items():  # as load_lora_weights hands them over: alone active
        ct.load_lora_adapter(lora, adapter_name=name, network_alphas=None, metadata=None, _pipeline=None)
        load_lora(twin, lora, name)

    def expect(names, scales):  # set_lora on the eager twin
        set_lora(twin, names, scales)
        return eager(twin, kw)

    def now():
        return ct(**kw, return_dict=False)[0]

    assert ct.active_adapters() == ["b"] and rel(now(), expect(["b"], [1.0])) < 1e-5
    ct.set_adapters(["a", "b"], [0.5, None])  # None: 1.0, as diffusers
    both = expect(["a", "b"], [0.5, 1.0])
    assert rel(now(), both) < 1e-5 and rel(now(), base) > 1e-2  # the LoRA matters
    assert ct.active_adapters() == ["a", "b"] and list(ct.peft_config) == ["a", "b"]
    ct.disable_lora()
    assert torch.equal(now(), base) and ct.active_adapters() == ["a", "b"]  # as PEFT reports them
    ct.set_adapters("a", 2.0)  # while disabled: what enable applies (PEFT keeps layers disabled)
    assert torch.equal(now(), base)
    ct.enable_lora()
    assert rel(now(), expect(["a"], [2.0])) < 1e-5
    ct.set_adapter("b")
    assert rel(now(), expect(["b"], [1.0])) < 1e-5
    ct.delete_adapters("b")  # the active one: as PEFT, the first left is active, at its last scale
    assert rel(now(), expect(["a"], [2.0])) < 1e-5 and list(ct.peft_config) == ["a"]
    with pytest.raises(LoRAError, match=r"no adapter named \['b'\] is loaded"):
        ct.set_adapters("b")
    ct.set_adapters("a")
    unload_lora(twin, "b")
    assert rel(now(), expect(["a"], [1.0])) < 1e-5
    ct.unload_lora()
    assert torch.equal(now(), base) and not hasattr(ct, "peft_config")
    for call, error, match in (
        (lambda: ct.add_adapter(None), ConfigError, "LoRA is in its weights already"),
        (lambda: ct.fuse_lora(), ConfigError, "LoRA is in its weights already"),
        (lambda: ct.unfuse_lora(), ConfigError, "LoRA is in its weights already"),
        (lambda: ct.load_lora_adapter({}, hotswap=True), ConfigError, "switches in place without it"),
        (lambda: ct.load_lora_adapter({}, color="red"), ConfigError, r"unknown arguments \['color'\]"),
        (lambda: ct.load_lora_adapter("user/some-lora"), LoRAError, "nothing is downloaded"),
    ):
        with pytest.raises(error, match=match):
            call()
    assert not lora_module.loaded(ct)
    load_lora(ct, loras(model)["a"], "a")
    with pytest.raises(LoRAError, match="per-block LoRA weights"):
        ct.set_adapters(["a"], [{"transformer_blocks.0": 1.0}])
    with pytest.raises(LoRAError, match="got 1 adapter names and 2 scales"):
        ct.set_adapters(["a"], [1.0, 2.0])


def test_a_pipelines_lora_methods_match_diffusers_peft_on_an_eager_copy():
    """The same sequence on a FluxPipeline with a compiled transformer (prx_compile's LoRA) and on one
    with the eager transformer (diffusers' load_lora_weights: PEFT layers)."""
    pytest.importorskip("peft")
    ours, theirs = tiny_flux_pipeline(make_flux(seed=0)), tiny_flux_pipeline(make_flux(seed=0))
    ours.transformer = compile_transformer(ours.transformer, backend="eager")
    kw = inputs(theirs.transformer)
    files = loras(theirs.transformer)
    files["a"] = make_random_lora(theirs.transformer, rank=2, seed=1, std=0.2, alpha=4.0)  # alpha / r = 2

    def close():
        with torch.no_grad():
            a = ours.transformer(**kw, return_dict=False)[0]
            b = theirs.transformer(**kw, return_dict=False)[0]
        assert rel(a, b) < 1e-5, rel(a, b)
        assert ours.get_list_adapters() == theirs.get_list_adapters()
        assert ours.transformer.active_adapters() == theirs.get_active_adapters()

    for step in (
        lambda p: p.load_lora_weights(files["a"], adapter_name="a"),
        lambda p: p.load_lora_weights(files["b"], adapter_name="b"),  # the last loaded alone active
        lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.5, 1.5]),
        lambda p: p.disable_lora(),
        lambda p: p.set_adapters("b", 0.7),
        lambda p: p.enable_lora(),
        lambda p: p.delete_adapters("b"),
        lambda p: p.set_adapters("a"),
        lambda p: p.load_lora_weights(files["b"]),  # named default_<n>, as diffusers names it
        lambda p: p.unload_lora_weights(),
    ):
        step(ours), step(theirs)
        close()
    assert not hasattr(ours.transformer.transformer, "peft_config")  # no PEFT layers were added


def test_a_transformer_holding_peft_layers_is_refused_before_compiling():
    """A LoRA loaded by diffusers before compiling (PEFT layers, which engines never call) is refused
    at compile time in one line (0.27: at the first call); fused and unloaded first, it compiles."""
    pytest.importorskip("peft")
    pipe = tiny_flux_pipeline(make_flux(seed=0))
    pipe.load_lora_weights(loras(pipe.transformer)["a"], adapter_name="a")
    kw = inputs(pipe.transformer)
    with torch.no_grad():
        want = pipe.transformer(**kw, return_dict=False)[0]
    with pytest.raises(ConfigError, match="holds PEFT adapters"):
        compile_transformer(pipe.transformer, backend="eager")
    other = tiny_flux_pipeline(make_flux(seed=0))
    other.load_lora_weights(loras(other.transformer)["b"], adapter_name="b")
    other.delete_adapters("b")  # no PEFT config left, its layers stay
    with pytest.raises(ConfigError, match="holds PEFT adapters"):
        compile_transformer(other.transformer, backend="eager")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    ct = compile_transformer(pipe.transformer, backend="eager")
    assert rel(ct(**kw, return_dict=False)[0], want) < 1e-5


def _text_encoder_lora(pipe):
    g = torch.Generator().manual_seed(0)
    out = {}
    for n, m in pipe.text_encoder.named_modules():
        if isinstance(m, torch.nn.Linear) and n.endswith("q_proj"):
            out[f"text_encoder.{n}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g) * 0.2
            out[f"text_encoder.{n}.lora_B.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.2
    return out


def _with_metadata(tmp_path, lora):
    """``lora`` as diffusers' save_lora_weights writes it: alpha 8 / r 2 in the header's metadata only."""
    from diffusers import FluxPipeline

    layers = {k.removeprefix("transformer."): v for k, v in lora.items()}
    targets = sorted({k.split(".lora_")[0] for k in layers})
    FluxPipeline.save_lora_weights(
        tmp_path,
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata={"r": 2, "lora_alpha": 8, "target_modules": targets},
    )
    return tmp_path / "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize(
    "sequence",
    [
        "delete-order",
        "delete-inactive",
        "delete-twice",
        "load-disabled",
        "delete-all-disabled",
        "metadata",
        "text-encoder",
        "alphas",
    ],
)
def test_sequences_a_review_found_match_peft(tmp_path, sequence):
    """Each was 0.07-0.70 off PEFT in the first version of 0.28 (a review of it): which adapter a
    delete activates (the first by name, and only when an active one went), a load while disabled,
    PEFT's layers staying disabled, alpha from a file's metadata, a text-encoder-only LoRA, alphas
    on some layers only (the most common for the rest)."""
    pytest.importorskip("peft")
    ours, theirs = tiny_flux_pipeline(make_flux(seed=0)), tiny_flux_pipeline(make_flux(seed=0))
    ours.transformer = compile_transformer(ours.transformer, backend="eager")
    kw = inputs(theirs.transformer)
    ref = make_flux(seed=0)
    lo = {n: make_random_lora(ref, rank=2, seed=s, std=0.2) for n, s in (("a", 1), ("b", 2), ("c", 3))}
    with torch.no_grad():
        base = ref(**kw, return_dict=False)[0]
    partial = make_random_lora(ref, rank=2, seed=4, std=0.2, alpha=6.0)
    partial = {k: v for k, v in partial.items() if not (k.endswith(".alpha") and "single" in k)}
    steps = {
        "delete-order": [("load", "c"), ("load", "b"), ("load", "a"), ("delete", "a")],
        "delete-inactive": [("load", "a"), ("load", "b"), ("set", []), ("delete", "b")],
        "delete-twice": [("load", "a"), ("load", "b"), ("delete", ["b", "b"])],  # 0.28's first fix: KeyError
        "load-disabled": [("load", "a"), ("disable",), ("load", "b"), ("enable",)],
        "delete-all-disabled": [("load", "a"), ("disable",), ("delete", "a"), ("load", "c"), ("enable",)],
        "metadata": [("file", _with_metadata(tmp_path, lo["a"]))],
        "text-encoder": [("load", "a"), ("dict", _text_encoder_lora(theirs))],
        "alphas": [("dict", partial), ("set", ["default_0"], [np.float32(0.5)])],
    }[sequence]
    for step in steps:
        for p in (ours, theirs):
            verb, *args = step
            if verb == "load":
                p.load_lora_weights(lo[args[0]], adapter_name=args[0])
            elif verb == "dict":
                p.load_lora_weights(args[0])
            elif verb == "file":
                p.load_lora_weights(args[0].parent, weight_name=args[0].name)
            elif verb == "set":  # the transformer's: a pipeline refuses an empty list
                p.transformer.set_adapters(*args)
            elif verb == "delete":
                p.delete_adapters(args[0])
            else:
                getattr(p, f"{verb}_lora")()
        with torch.no_grad():
            a = ours.transformer(**kw, return_dict=False)[0]
            b = theirs.transformer(**kw, return_dict=False)[0]
        assert rel(a, b) < 1e-5, (step, rel(a, b), rel(b, base))
        assert ours.get_list_adapters().get("transformer") == theirs.get_list_adapters().get("transformer")


def test_a_saved_module_keeps_the_scales_and_what_disable_set_aside(tmp_path):
    """save_compiled / load_compiled keep each adapter's last scale (a delete reads it) and what
    disable_lora set aside (0.28's first version lost both)."""
    from prx_compile import load_compiled, save_compiled

    model, twin = make_flux(seed=0), make_flux(seed=0)
    ct = compile_transformer(model, backend="eager")
    kw = inputs(model)
    for name, lora in loras(model).items():
        ct.load_lora_adapter(lora, adapter_name=name)
        load_lora(twin, lora, name)
    ct.set_adapters(["a", "b"], [0.5, 1.0])
    ct.set_adapters("b")
    ct.disable_lora()
    ct = load_compiled(save_compiled(ct, tmp_path / "art"))
    assert ct.active_adapters() == ["b"] and torch.equal(
        *(m(**kw, return_dict=False)[0] for m in (ct, make_flux(seed=0)))
    )
    ct.enable_lora()
    ct.delete_adapters("b")  # a comes back at its last scale
    set_lora(twin, ["a"], [0.5])
    assert rel(ct(**kw, return_dict=False)[0], eager(twin, kw)) < 1e-5
    ct.disable_lora()
    ct.delete_adapters("a")  # every adapter gone, still disabled (PEFT's layers stay disabled)
    ct = load_compiled(save_compiled(ct, tmp_path / "art2"))
    ct.load_lora_adapter(loras(model)["b"], adapter_name="b")  # set aside, as before the round trip
    assert torch.equal(ct(**kw, return_dict=False)[0], make_flux(seed=0)(**kw, return_dict=False)[0])


def test_what_diffusers_loader_would_refuse_or_leave_out():
    """As diffusers' load_lora_adapter: keys of layers the model lacks are left out with a warning,
    .alpha keys of the state dict are not read (alpha comes from network_alphas or metadata), both of
    those at once are refused; DoRA, which PEFT applies and this does not, is refused in one line."""
    model, twin = make_flux(seed=0), make_flux(seed=0)
    ct = compile_transformer(model, backend="eager")
    kw = inputs(model)
    lo = make_random_lora(model, rank=2, seed=1, std=0.2, alpha=8.0)  # alpha 8 / r 2, in .alpha keys
    extra = {**lo, "transformer.not_a_layer.lora_A.weight": torch.zeros(2, 4)}
    with pytest.raises(LoRAError, match="DoRA"):
        ct.load_lora_adapter({**lo, "transformer.x_embedder.lora_magnitude_vector": torch.ones(4)})
    with pytest.raises(LoRAError, match="takes a state dict or a local path, not a int"):
        ct.load_lora_adapter(3)
    with pytest.raises(ConfigError, match="network_alphas and metadata"):
        ct.load_lora_adapter(lo, network_alphas={"transformer.x.alpha": 1.0}, metadata={"r": 2})
    for header in ([1, 2], "x"):  # a file's lora_adapter_metadata that is JSON, not an object
        with pytest.raises(LoRAError, match="metadata .* is a (list|str), not a JSON object"):
            ct.load_lora_adapter(lo, metadata=header)
    assert not lora_module.loaded(ct)
    ct.load_lora_adapter(extra, adapter_name="a")
    load_lora(twin, {k: v for k, v in lo.items() if not k.endswith(".alpha")}, "a")  # alpha / r = 1
    assert rel(ct(**kw, return_dict=False)[0], eager(twin, kw)) < 1e-5


def test_fusing_the_projections_under_a_lora_is_refused_and_without_one_runs_as_eager():
    """diffusers' fuse_qkv_projections copies q/k/v's weights into one new layer: under a LoRA the copy
    would take the LoRA's share as that layer's base, which unload_lora never took out (0.31: 3.5e-2
    off eager after the unload, silently)."""
    model, twin = make_flux(seed=0), make_flux(seed=0)
    ct = compile_transformer(model, backend="eager")
    kw = inputs(model)
    ct.load_lora_adapter(loras(model)["a"], adapter_name="a")
    with pytest.raises(LoRAError, match="fuse_qkv_projections: a LoRA is loaded"):
        ct.fuse_qkv_projections()
    ct.unload_lora()
    ct.fuse_qkv_projections()
    twin.fuse_qkv_projections()
    assert rel(ct(**kw, return_dict=False)[0], eager(twin, kw)) < 1e-5
