"""A model-based test of the compiled module's state: random sequences of every operation that changes
it, against a plain eager mirror that receives the same operations with PEFT's semantics.

The mirror is an uncompiled copy of the transformer whose weights the test sets itself, after every
operation, to what the semantics promise (docs/semantics.md):

* a loaded LoRA lives beside the base weights: the weights that run are ``base + sum over the active
  adapters of scale * layer_scale * B @ A`` (in fp32, then the weight's dtype; adapters in name order);
* ``load_state_dict`` (strict or partial), an in-place edit, a new ``Parameter`` or a swapped layer set
  the *base* value of what they write; the active adapters stay applied over it;
* ``unload_lora`` leaves exactly the base weights; ``set_lora`` changes the active adapters only;
* diffusers' verbs act as PEFT's: ``disable_lora`` sets the active adapters aside (``set_adapters``
  then changes what ``enable_lora`` applies); ``load_lora_adapter`` (``load_lora_weights``) makes the
  new adapter alone active; ``delete_adapters`` drops some, and when an active one went and none is
  left active, the first left by name is, at the scale it last had;
* ``save_compiled`` + ``load_compiled`` keeps everything (the loaded module replaces the compiled one);
* ``.to(dtype)`` casts the base weights; ``save_pretrained`` writes the weights that run.

After every step the compiled module's output is compared with the mirror's on the same inputs:
bit for bit on a CPU (the eager backend runs the same graph as the model), within ``tolerance`` on a
GPU (TensorRT's kernels), where a silent drift such as 0.16's (7 % after a load_state_dict and an
unload) is far outside it. ``tests/test_state_machine.py`` runs it in CI, ``benchmarks/state_machine.py``
on the device with the TensorRT backend, bf16 and FP8.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prx_compile import load_compiled, load_lora, save_compiled, set_lora, unload_lora
from prx_compile.lora import make_random_lora
from prx_compile.lora.adapters import summary
from prx_compile.quant import fp8


@dataclass
class Setup:
    """What one machine runs on: a compiled module (made once, reset between sequences), the eager
    model it was compiled from (kept as the mirror's template), inputs, and what is compared how."""

    compiled: Any
    template: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    tolerance: float = 0.0  # relative L2 error allowed (0: bit for bit)
    slow_ops: bool = False  # save/load and dtype casts (each rebuilds the engine set)
    lora_std: float = 0.1
    log: list[str] = field(default_factory=list)
    steps: int = 0
    sequences: int = 0
    worst: float = 0.0


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Mirror:
    """The transformer as PEFT's semantics describe it: base weights and adapters, kept apart."""

    def __init__(self, template: torch.nn.Module, base: dict[str, torch.Tensor]):
        self.model = copy.deepcopy(template)
        self.base = {k: v.clone() for k, v in base.items()}
        self.adapters: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # in load order
        self.active: dict[str, float] = {}
        self.disabled: dict[str, float] | None = None  # what disable_lora set aside
        self.last: dict[str, float] = {}  # the scale each adapter last had

    def activate(self, active: dict[str, float], *, disabled: bool = False) -> None:
        """``active`` in the weights, or (``disabled``) set aside for enable_lora."""
        if disabled:
            self.disabled = dict(active)
        else:
            self.active, self.disabled = dict(active), None
        self.last.update(active)

    def weights(self) -> dict[str, torch.Tensor]:
        out = dict(self.base)
        for fqn, w0 in self.base.items():
            mod = fqn.rsplit(".", 1)[0]
            acc = None
            for name in sorted(self.active):
                layer = self.adapters[name].get(mod)
                if layer is not None and self.active[name] != 0.0 and fqn.endswith(".weight"):
                    down, up = (t.to(w0.device) for t in layer)  # on the weight's device, as a LoRA is
                    d = ((up @ down) * 1.0) * self.active[name]
                    acc = d if acc is None else acc + d
            if acc is not None:
                out[fqn] = (w0.float() + acc).to(w0.dtype)
        return out

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        weights = self.weights()
        with torch.no_grad():
            for fqn, p in self.model.named_parameters():
                if p.dtype != weights[fqn].dtype:
                    self.model.to(weights[fqn].dtype)
                    break
            for fqn, p in self.model.named_parameters():
                p.copy_(weights[fqn])
            for m in self.model.modules():
                if isinstance(m, fp8.FP8Linear):
                    m.requantize()
            return self.model(**inputs, return_dict=False)[0]


def peft_pairs(lora: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) of a PEFT-layout LoRA (``make_random_lora``'s, no alpha)."""
    out = {}
    for key, a in lora.items():
        if key.endswith(".lora_A.weight"):
            mod = key[len("transformer.") : -len(".lora_A.weight")]
            out[mod] = (a.float(), lora[key.replace("lora_A", "lora_B")].float())
    return out


def machine(setup: Setup) -> type[RuleBasedStateMachine]:
    """The state machine class over ``setup`` (hypothesis runs it: ``run_state_machine_as_test``)."""

    base_state = {k: v.detach().clone() for k, v in setup.compiled.transformer.state_dict().items()}
    block_weights = [
        k for k, v in base_state.items() if k.endswith(".weight") and v.dim() == 2 and ".0." in k
    ]
    tmp = Path(tempfile.mkdtemp(prefix="prx-state-machine-"))

    class CompiledState(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            ct = setup.compiled
            if summary(ct) is not None:  # adapters, or disable_lora still holding (all deleted)
                unload_lora(ct)
            dtype = next(iter(base_state.values())).dtype
            if ct.dtype != dtype:  # a cast in the last sequence
                ct.to(dtype)
            with torch.no_grad():
                ct.load_state_dict(base_state)
            self.ct = ct
            self.mirror = Mirror(setup.template, base_state)
            self.names = 0
            self.rebuilds = 0
            setup.sequences += 1
            setup.log.append("-- sequence")

        @property
        def transformer(self) -> torch.nn.Module:
            return self.ct.transformer

        def note(self, text: str) -> None:
            setup.log.append(text)
            setup.steps += 1

        # -- LoRA --------------------------------------------------------------------------------
        @rule(
            seed=st.integers(0, 2**16),
            scale=st.sampled_from([1.0, 0.5, -0.7, 1.3]),
            diffusers=st.booleans(),
        )
        def load(self, seed, scale, diffusers):
            name = f"l{self.names}"
            self.names += 1
            lora = make_random_lora(self.transformer, rank=2 + seed % 3, seed=seed, std=setup.lora_std)
            m = self.mirror
            m.adapters[name] = peft_pairs(lora)
            if diffusers:  # as load_lora_weights hands it over: alone active at 1.0 (set aside if disabled)
                self.ct.load_lora_adapter(lora, adapter_name=name)
                m.activate({name: 1.0}, disabled=m.disabled is not None)
                self.note(f"load_lora_adapter {name}")
            else:  # with the adapters active, enabled
                load_lora(self.ct, lora, name, scale=scale)
                m.activate({**m.active, name: scale})
                self.note(f"load_lora {name} {scale}")

        @precondition(lambda self: bool(self.mirror.adapters))
        @rule(data=st.data())
        def switch(self, data):
            names = sorted(self.mirror.adapters)
            chosen = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
            scales = [data.draw(st.sampled_from([1.0, 0.25, -1.0])) for _ in chosen]
            set_lora(self.ct, chosen, scales)
            self.mirror.activate(dict(zip(chosen, scales, strict=True)))
            self.note(f"set_lora {chosen} {scales}")

        @precondition(lambda self: bool(self.mirror.adapters))
        @rule()
        def unload(self):
            unload_lora(self.ct)
            self.mirror.adapters.clear()
            self.mirror.activate({})
            self.note("unload_lora")

        # -- diffusers' verbs (PEFT's semantics) ------------------------------------------------------
        @precondition(lambda self: bool(self.mirror.adapters))
        @rule(data=st.data())
        def set_adapters(self, data):
            names = sorted(self.mirror.adapters)
            chosen = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=1, max_size=len(names)))
            scales = [data.draw(st.sampled_from([1.0, 0.5, -1.0])) for _ in chosen]
            self.ct.set_adapters(chosen, scales)
            self.mirror.activate(
                dict(zip(chosen, scales, strict=True)), disabled=self.mirror.disabled is not None
            )
            self.note(f"set_adapters {chosen} {scales}")

        @precondition(lambda self: bool(self.mirror.adapters))
        @rule(enable=st.booleans())
        def disable_or_enable(self, enable):
            m = self.mirror
            if enable:
                self.ct.enable_lora()
                if m.disabled is not None:
                    m.activate(m.disabled)
            else:
                self.ct.disable_lora()
                if m.disabled is None:
                    m.disabled, m.active = m.active, {}
            self.note("enable_lora" if enable else "disable_lora")

        @precondition(lambda self: bool(self.mirror.adapters))
        @rule(data=st.data())
        def delete_adapters(self, data):
            m = self.mirror
            gone = data.draw(st.lists(st.sampled_from(list(m.adapters)), unique=True, min_size=1))
            self.ct.delete_adapters(gone)
            for n in gone:
                del m.adapters[n]
            off = m.disabled is not None
            current = m.disabled if off else m.active
            left = {n: v for n, v in current.items() if n not in gone}
            if m.adapters and not left and set(gone) & set(current):
                first = min(m.adapters)  # PEFT: the first left by name is active, at its last scale
                left = {first: m.last[first]}
            m.activate(left, disabled=off)  # PEFT's layers stay disabled, all adapters gone or not
            self.note(f"delete_adapters {gone}")

        # -- base weights --------------------------------------------------------------------------
        @rule(seed=st.integers(0, 2**16))
        def load_state_dict(self, seed):
            g = torch.Generator().manual_seed(seed)
            new = {
                k: (v + torch.randn(v.shape, generator=g).to(v) * 0.02) if v.is_floating_point() else v
                for k, v in self.mirror.base.items()
            }
            with torch.no_grad():
                self.ct.load_state_dict(new)
            self.mirror.base = {k: v.clone() for k, v in new.items()}
            self.note("load_state_dict (strict)")

        @rule(seed=st.integers(0, 2**16), block=st.integers(0, 1))
        def load_state_dict_partial(self, seed, block):
            g = torch.Generator().manual_seed(seed)
            prefix = [k for k in block_weights][0].split(".0.")[0] + f".{block}."
            part = {
                k: v + torch.randn(v.shape, generator=g).to(v) * 0.02
                for k, v in self.mirror.base.items()
                if k.startswith(prefix) and v.is_floating_point()
            }
            with torch.no_grad():
                self.ct.load_state_dict(part, strict=False)
            self.mirror.base.update({k: v.clone() for k, v in part.items()})
            self.note(f"load_state_dict (strict=False, {len(part)} tensors)")

        @rule(index=st.integers(0, 10**6), factor=st.sampled_from([1.1, 0.8, -1.0]))
        def edit_in_place(self, index, factor):
            fqn = block_weights[index % len(block_weights)]
            p = self.transformer.get_parameter(fqn)
            with torch.no_grad():
                p.mul_(factor)  # the value the user wrote: what runs now, times factor
                self.mirror.base[fqn] = p.detach().clone()
            self.note(f"{fqn}.mul_({factor})")

        @rule(index=st.integers(0, 10**6), seed=st.integers(0, 2**16))
        def new_parameter(self, index, seed):
            fqn = block_weights[index % len(block_weights)]
            mod, _, attr = fqn.rpartition(".")
            old = self.transformer.get_parameter(fqn)
            g = torch.Generator().manual_seed(seed)
            value = (torch.randn(old.shape, generator=g).to(old.device) * old.float().std()).to(old)
            setattr(self.transformer.get_submodule(mod), attr, torch.nn.Parameter(value, requires_grad=False))
            self.mirror.base[fqn] = value.clone()
            self.note(f"{fqn} = Parameter(...)")

        @rule(index=st.integers(0, 10**6), seed=st.integers(0, 2**16))
        def swap_layer(self, index, seed):
            fqn = block_weights[index % len(block_weights)]
            mod = fqn.rpartition(".")[0]
            parent, _, attr = mod.rpartition(".")
            new = copy.deepcopy(self.transformer.get_submodule(mod))  # its own parameters: a new base
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                w = new.weight
                w.copy_((torch.randn(w.shape, generator=g).to(w.device) * w.float().std()).to(w))
            setattr(self.transformer.get_submodule(parent), attr, new)
            self.mirror.base[fqn] = new.weight.detach().clone()
            self.note(f"{mod} swapped for a new layer")

        # -- whole-module operations ---------------------------------------------------------------
        @rule()
        def save_pretrained(self):
            folder = tmp / "pretrained"
            self.ct.save_pretrained(folder)
            from safetensors.torch import load_file

            saved = load_file(str(next(folder.glob("*.safetensors"))))
            want = self.mirror.weights()
            assert set(saved) == set(want)
            for k, v in saved.items():
                assert torch.equal(v.to(want[k].device), want[k]), (
                    f"save_pretrained wrote {k} unlike the mirror"
                )
            self.note("save_pretrained (the weights that run)")

        @precondition(lambda self: setup.slow_ops and self.rebuilds < 2)
        @rule()
        def save_and_load(self):
            save_compiled(self.ct, tmp / "compiled.art")
            self.ct = load_compiled(tmp / "compiled.art")
            self.rebuilds += 1
            self.note("save_compiled + load_compiled")

        @precondition(lambda self: setup.slow_ops and self.rebuilds < 2)
        @rule(dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # dtypes engines run
        def cast(self, dtype):
            self.ct.to(dtype)
            self.mirror.base = {
                k: v.to(dtype) if v.is_floating_point() else v for k, v in self.mirror.base.items()
            }
            self.rebuilds += 1
            self.note(f".to({dtype})")

        @rule(data=st.data())
        def two_without_a_call(self, data):
            """Two operations back to back, no call between them: where 0.26 lost writes (a cast after
            a load_state_dict under a LoRA, a LoRA operation after a swapped layer, save_pretrained
            after an edit)."""
            for _ in range(2):
                ops = ["load_state_dict", "edit_in_place", "new_parameter", "swap_layer", "save_pretrained"]
                lora = ["switch", "unload", "set_adapters", "delete_adapters", "disable_or_enable"]
                ops += lora if self.mirror.adapters else []
                ops += ["cast"] if setup.slow_ops and self.rebuilds < 2 else []
                op = data.draw(st.sampled_from(ops))
                seed, index = data.draw(st.integers(0, 2**16)), data.draw(st.integers(0, 10**6))
                if op == "load_state_dict":
                    self.load_state_dict(seed)
                elif op == "edit_in_place":
                    self.edit_in_place(index, data.draw(st.sampled_from([1.1, -1.0])))
                elif op in ("new_parameter", "swap_layer"):
                    getattr(self, op)(index, seed)
                elif op == "cast":
                    self.cast(data.draw(st.sampled_from([torch.float32, torch.bfloat16])))
                elif op == "disable_or_enable":
                    self.disable_or_enable(data.draw(st.booleans()))
                elif op in ("switch", "set_adapters", "delete_adapters"):
                    getattr(self, op)(data)
                else:
                    getattr(self, op)()

        # -- the promise ---------------------------------------------------------------------------
        @invariant()
        def same_output(self):
            dtype = next(self.transformer.parameters()).dtype
            kw = {
                k: v.to(dtype)
                if v.is_floating_point()
                and k in ("hidden_states", "encoder_hidden_states", "pooled_projections")
                else v
                for k, v in setup.inputs.items()
            }
            got = self.ct(**kw, return_dict=False)[0]
            want = self.mirror(kw)
            err = rel(got, want)
            setup.worst = max(setup.worst, err)
            if setup.tolerance == 0.0:
                assert torch.equal(got, want), f"after {setup.log[-1]}: {err:.3e} from the mirror"
            else:
                assert err <= setup.tolerance, f"after {setup.log[-1]}: {err:.3e} from the mirror"
            state = summary(self.ct) or {}
            assert state.get("active", {}) == self.mirror.active, (state, self.mirror.active)
            assert state.get("disabled") == self.mirror.disabled, (state, self.mirror.disabled)

    return CompiledState
