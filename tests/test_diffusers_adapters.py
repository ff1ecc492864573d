"""diffusers' LoRA methods on a compiled transformer (``lora/diffusers.py``): they act on prx_compile's
adapters as PEFT's act on PEFT layers (0.27's were PEFT's own: ``load_lora_weights`` added layers the
engines never call, and ``disable_lora``, ``delete_adapters`` and ``unload_lora_weights`` left the LoRA
in the weights, silently). CPU, eager backend, the tiny FLUX.1; outputs compared with diffusers' own
LoRA (PEFT) on an eager copy where PEFT is installed (the dev extra has it), and with ``load_lora`` /
``set_lora`` on an eager copy."""

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
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    ct = compile_transformer(pipe.transformer, backend="eager")
    assert rel(ct(**kw, return_dict=False)[0], want) < 1e-5
