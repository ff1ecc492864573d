"""``CompiledTransformer``: the drop-in replacement for ``pipe.transformer``, and ``compile_transformer``.

    pipe.transformer = compile_transformer(pipe.transformer)   # any supported class (prx_compile.models)
    pipe.transformer = compile_prx(pipe.transformer)           # the same, for a PRX transformer only

The compiled module is a facade with two parts behind it: ``EngineSets`` (the engine sets, the shape
policy that picks one per call, CUDA graphs) and ``ChangeFollower`` (what a change of the transformer
costs before the next call). It keeps what a pipeline and users read (``.config``, ``.dtype``,
``.device``, the forward's arguments including ``return_dict``) and the transformer's ``nn.Module``
view. ``load_compiled`` assembles a loaded module with the same ``assemble``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Collection
from typing import Any

import torch

from ..backends import Backend
from ..backends.base import empty_report
from ..config import CompileConfig
from ..errors import ConfigError
from ..lora.diffusers import DiffusersLoRA
from ..models import SPECS, ModelSpec, spec_for
from ..plan import Plan
from ..quant import fp8
from ..shapes import ShapeRange
from .engine_sets import EngineSets
from .follower import ChangeFollower, keepers

logger = logging.getLogger(__name__)


def _delegated(name: str):
    """A method that calls the transformer's ``name`` (the compiled module's nn.Module view)."""

    def method(self, *args, **kwargs):
        return getattr(self.transformer, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The transformer's ``{name}`` (the compiled module holds no tensors of its own)."
    return method


class _Refused:
    """What a compiled transformer refuses, in one line each: the diffusers class methods that would
    make a plain model under its name, diffusers' hooks that replace a module's forward (caches,
    layerwise casting, group offload) or pick an attention backend (engines never call those
    forwards or that attention), pickling and copying, and tensor conversions other than
    ``.to(dtype)``. Its first base,
    so these come before the transformer class's own (``_compiled_class``)."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise ConfigError(
            f"{cls.__name__}.from_pretrained cannot make a compiled transformer.",
            "load the transformer with its diffusers class and compile it; an artifact: load_compiled.",
        )

    def enable_cache(self, *args, **kwargs):
        raise ConfigError(
            "diffusers' caches (enable_cache) skip blocks by replacing their forward, which a compiled "
            "transformer's engines never call.",
            "use a cache with the eager transformer, or the compiled one without.",
        )

    def enable_layerwise_casting(self, *args, **kwargs):
        raise ConfigError(
            "layerwise casting replaces the layers' forward, which a compiled transformer's engines never "
            "call.",
            "compile with precision: fp8 for 8-bit weights, or cast the eager transformer.",
        )

    def enable_group_offload(self, *args, **kwargs):
        raise ConfigError(
            "group offload moves weights in the layers' forward, which a compiled transformer's engines "
            "never call.",
            "use pipe.enable_model_cpu_offload(); the compiled transformer stays on the GPU.",
        )

    def set_attention_backend(self, *args, **kwargs):
        raise ConfigError(
            "a compiled transformer's attention is chosen when it is built, not by diffusers' attention "
            "backend.",
            "compile with attention_kernel (auto, flash4, cudnn or split).",
        )

    @classmethod
    def from_config(cls, *args, **kwargs):
        raise ConfigError(
            f"{cls.__name__}.from_config cannot make a compiled transformer.",
            "make the transformer with its diffusers class and compile it.",
        )

    def __reduce_ex__(self, protocol):
        raise ConfigError(
            "a compiled transformer cannot be pickled or copied (pickle, torch.save, copy.deepcopy): its "
            "engines and live weights do not travel that way.",
            "save it with save_compiled(module, path) and load_compiled(path); to copy, copy the eager "
            "transformer and compile the copy.",
        )

    def _apply(self, fn, recurse: bool = True):
        raise ConfigError(
            "a compiled transformer cannot apply an arbitrary tensor conversion (.type(), .to_empty(), "
            ".share_memory(), ...).",
            "use .to(dtype), or convert compiled.transformer and compile it again.",
        )


class CompiledTransformer(_Refused, DiffusersLoRA, torch.nn.Module):
    """A compiled diffusers transformer with the same call signature and the transformer's module view.

    One copy of the weights: the transformer is held outside ``_modules`` (registering it would make
    every state-dict key ``transformer.*`` and let module-wide operations reach it twice), and the
    ``nn.Module`` view is the transformer's: ``parameters``, ``named_parameters``, ``buffers``,
    ``state_dict``, ``load_state_dict`` (strict semantics and return value its own), ``children``,
    ``modules``, ``named_modules``, ``apply``, ``train``/``eval`` delegate to it, and writing an
    attribute the compiled module does not own sets it on the transformer. Whatever changes the
    transformer, through either object, is followed at the next call (``ChangeFollower``).
    ``.to(dtype)``, ``.half()``, ``.float()``, ``.bfloat16()`` cast the transformer, so the engine sets
    are rebuilt for the new dtype.

    Made for a diffusers model, the object's class is a subclass of both this class and the
    transformer's (named like it), so diffusers' ``register_modules`` records the transformer's
    library and class in ``model_index.json`` and ``pipe.save_pretrained`` saves the transformer.
    diffusers' LoRA methods (``load_lora_adapter``, ``set_adapters``, ``disable_lora``, ...) act on
    prx_compile's adapters (``lora.diffusers``).

    Attributes:
        transformer: the original module; its parameters are the one copy of the weights.
        spec: the model's ``ModelSpec``. plan: the resolved ``Plan`` (``compile_config``: its config).
        sets: the ``EngineSets``. follower: the ``ChangeFollower``.
        backends, builds, cache_hits, replays_dropped: the engine sets' (see ``EngineSets``).
        load_s: seconds ``load_compiled`` took to make this module (None: compiled here).
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        plan: Plan,
        backends: list[Backend] | None = None,
        load_s: float | None = None,
    ):
        super().__init__()
        object.__setattr__(self, "transformer", transformer)  # not a submodule: no duplicate params
        self.spec: ModelSpec = plan.spec
        self._device = torch.device(plan.config.device)
        self.sets = EngineSets(transformer, plan, backends)
        self.follower = ChangeFollower(transformer, self.sets)
        self._forward_signature = inspect.signature(type(transformer).forward)
        self._moved_warned = False
        self._grad_warned = False
        self._ahead = True  # replay before the change check where that is safe (``_replay_ahead``)
        self.load_s = load_s
        if type(self) is CompiledTransformer and isinstance(transformer, _model_mixin()):
            self.__class__ = _compiled_class(type(transformer))  # what diffusers saves (save_pretrained)
        self._ready = True  # from here on, attributes it does not own are the transformer's

    # -- what the pipeline reads ----------------------------------------------------------------
    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def plan(self) -> Plan:
        return self.sets.plan

    @property
    def compile_config(self) -> CompileConfig:
        return self.sets.plan.config

    @property
    def backends(self) -> list[Backend]:
        return self.sets.backends

    @property
    def builds(self) -> int:
        return self.sets.builds

    @property
    def cache_hits(self) -> list[dict[str, Any]]:
        return self.sets.cache_hits

    @property
    def replays_dropped(self) -> int:
        return self.sets.replays_dropped

    @property
    def shapes(self) -> ShapeRange:
        """The widest engine set's range."""
        return self.sets.widest()

    @property
    def is_built(self) -> bool:
        return all(b.is_built for b in self.sets.backends)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            transformer = self.__dict__.get("transformer")
            if transformer is None:
                raise
            return getattr(transformer, name)

    def _owns(self, name: str) -> bool:
        """Attributes of the compiled module itself: its own state, its class's names (``forward``,
        which accelerate's hooks replace), and private names the transformer does not have (such as
        accelerate's ``_hf_hook``). Every other attribute write goes to the transformer."""
        d = self.__dict__
        return (
            not d.get("_ready")
            or name in d
            or hasattr(CompiledTransformer, name)
            or (name.startswith("_") and not hasattr(d["transformer"], name))
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_hf_hook":
            _refuse_sequential_offload(value)
        if name == "transformer" and self.__dict__.get("_ready"):
            raise ConfigError(
                "a compiled transformer's transformer cannot be replaced: its engine sets were built for it.",
                "compile the new one: compile_transformer(new_transformer).",
            )
        if self._owns(name):
            super().__setattr__(name, value)
        else:
            setattr(self.transformer, name, value)  # noticed at the next call (``ChangeFollower``)

    def __delattr__(self, name: str) -> None:
        if name == "transformer":
            raise ConfigError("a compiled transformer's transformer cannot be deleted.")
        if self._owns(name):
            super().__delattr__(name)
        else:
            delattr(self.transformer, name)

    def _get_name(self) -> str:  # the repr's name (the class is named like the transformer's)
        return "CompiledTransformer"

    # -- the nn.Module view: the transformer's --------------------------------------------------
    parameters = _delegated("parameters")
    named_parameters = _delegated("named_parameters")
    buffers = _delegated("buffers")
    named_buffers = _delegated("named_buffers")
    children = _delegated("children")
    named_children = _delegated("named_children")
    modules = _delegated("modules")
    named_modules = _delegated("named_modules")
    get_submodule = _delegated("get_submodule")
    get_parameter = _delegated("get_parameter")
    get_buffer = _delegated("get_buffer")
    state_dict = _delegated("state_dict")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The transformer's ``load_state_dict`` (same keys, strict semantics and return value); the
        engine sets follow at the next call (refit with ``weights: engine``; a rebuild if shapes or
        dtypes changed)."""
        return self.transformer.load_state_dict(state_dict, strict=strict, assign=assign)

    def apply(self, fn):
        """``fn`` on every module of the transformer (changes are followed at the next call)."""
        self.transformer.apply(fn)
        return self

    def train(self, mode: bool = True):
        self.transformer.train(mode)
        super().__setattr__("training", mode)
        return self

    def save_pretrained(self, save_directory, safe_serialization: bool = True, variant=None, **kwargs):
        """The transformer's ``save_pretrained``: a diffusers model folder of its class (what
        ``pipe.save_pretrained`` writes as ``transformer/``). With a LoRA loaded, the weights saved are
        the current ones, the LoRA merged at its scales (as the images are); ``save_compiled`` keeps the
        adapters apart instead."""
        self._sync_keepers()  # base weights written since the last call: the LoRA over them
        lora = self.transformer.__dict__.get("_prx_lora")
        if lora is not None and lora.active:
            logger.warning(
                "saving the transformer with LoRA %s merged into its weights; unload_lora first to save "
                "the base weights, or use save_compiled to keep the adapters apart.",
                ", ".join(f"{n!r} ({s:g})" for n, s in sorted(lora.active.items())),
            )
        kwargs.update(safe_serialization=safe_serialization, variant=variant)
        return self.transformer.save_pretrained(save_directory, **kwargs)

    # -- dtype and device -----------------------------------------------------------------------
    def to(self, *args, **kwargs):
        """``.to(dtype)`` casts the transformer: the engine sets are rebuilt for that dtype at their next
        call, with a warning (as ``pipe.to(dtype)`` does to every component, so the pipeline is never
        left half cast). A device move is ignored with a warning: engines live where they were built."""
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            self._sync_keepers()  # weights written since the last call are base values first
            self.transformer.to(dtype=dtype)
            self._sync_keepers()  # a LoRA merged again over its cast base (rounded once)
        if device is not None and torch.device(device).type != self._device.type:
            log = logger.info if self._moved_warned else logger.warning
            log("ignoring .to(%s): the compiled transformer stays on %s", device, self._device)
            self._moved_warned = True
        return self

    def half(self):
        return self.to(torch.float16)

    def float(self):
        return self.to(torch.float32)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def double(self):
        return self.to(torch.float64)

    def cuda(self, device=None):
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device))

    def cpu(self):
        return self.to("cpu")

    def _sync_keepers(self) -> None:
        """Bring what keepers derive from the weights (a loaded LoRA) up to date now, not at the next
        call: before a cast or a save, so that it sees every write made since the last call."""
        with torch.no_grad():
            for keeper in keepers(self.transformer).values():
                keeper.sync()

    # -- build ----------------------------------------------------------------------------------
    def build(self, example: dict[str, Any] | None = None) -> CompiledTransformer:
        """Build every engine set not built yet, each at its tuning point, and load every set read from
        an artifact (which otherwise loads at its first call); or, with ``example`` (the transformer's
        forward keyword arguments), only the set that call would run."""
        with torch.no_grad():
            self.follower.follow()
            if example is not None:
                self.sets.backend_for(self._inputs((), example))
                return self
            self.sets.build_all()
        return self

    # -- the step -------------------------------------------------------------------------------
    def _inputs(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The step's inputs of a forward call with ``args`` and ``kwargs`` (the transformer's own
        signature), checked (``ModelSpec.arguments``, then dtype and device)."""
        try:
            bound = self._forward_signature.bind(self.transformer, *args, **kwargs)
        except TypeError as e:
            names = [n for n in self._forward_signature.parameters if n != "self"]
            raise ConfigError(
                f"{type(self.transformer).__name__}.forward: {e}.", f"its arguments: {names}."
            ) from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        inputs = self.spec.arguments(self.transformer, arguments)
        dtype = self.dtype
        for k in self.spec.dtype_inputs:
            if inputs[k].dtype != dtype:
                raise ConfigError(
                    f"{k} is {inputs[k].dtype}, the compiled transformer is {dtype}.",
                    f"pass {dtype} inputs (the pipeline's torch_dtype, or .to(dtype)).",
                )
        for k, v in inputs.items():
            if v.device.type != self._device.type or (
                self._device.index is not None and v.device.index != self._device.index
            ):
                raise ConfigError(f"{k} is on {v.device}, the compiled transformer runs on {self._device}.")
        return inputs

    def engine_set_for(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """The engine set a call with ``inputs`` (the step's inputs) runs, or None
        (``EngineSets.for_inputs``)."""
        return self.sets.for_inputs(inputs)

    @torch.compiler.disable  # torch.compile(compiled) would trace the runtime itself: it runs as is
    def forward(self, *args, **kwargs):
        """The transformer's forward, with its arguments (PRX: hidden_states (B, C, H, W), timestep,
        encoder_hidden_states (B, T, C), attention_mask (B, T); FLUX: hidden_states (B, L, C), ...,
        img_ids, txt_ids, guidance) and ``return_dict``; the same prediction."""
        return_dict = kwargs.get("return_dict", True)
        _refuse_peft_layers(self.transformer)
        if torch.is_grad_enabled():
            self._check_grad(args, kwargs)
        with torch.no_grad():
            inputs = self._inputs(args, kwargs)
            out = self._replay_ahead(inputs)
            if out is None:
                self.follower.follow()
                out = self.sets.call(inputs)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def _check_grad(self, args: tuple, kwargs: dict) -> None:
        """Called with autograd on; the engines run inference only. An input that asks for a gradient
        is refused (a loss that also reads that input would get a gradient without the transformer's
        share, silently). In training mode, where the weights ask for gradients, a warning once
        that none flow to them. A call in eval mode (diffusers' ``from_pretrained`` gives one) without
        ``torch.no_grad()`` is inference."""
        for key, value in itertools.chain(enumerate(args), kwargs.items()):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                what = key if isinstance(key, str) else f"positional argument {key}"
                raise ConfigError(
                    f"{what} requires grad, but a compiled transformer runs inference only: no gradient "
                    "would flow back through it.",
                    "call it under torch.no_grad() or detach the input; for gradients, call the eager "
                    "transformer (compiled.transformer).",
                )
        if self.transformer.training and not self._grad_warned:
            self._warn_no_grad()

    def _warn_no_grad(self) -> None:
        """Training mode with autograd on: where the transformer's weights ask for gradients, say once
        that none flow (the engines run inference only)."""
        if any(p.requires_grad for p in self.transformer.parameters()):
            logger.warning(
                "the compiled transformer runs inference only: its output carries no gradient (call it "
                "under torch.no_grad(), as pipelines do; train the eager transformer)."
            )
        self._grad_warned = True  # looked once

    def _replay_ahead(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The step replayed from its captured CUDA graph before the transformer is checked for
        changes, so that the check (tenths of a millisecond of Python for the 1.17 B PRX) runs while
        the GPU works rather than before it starts. Only where that is safe: a graph captured for these
        inputs on a set that has run, and every tensor's storage where it was (``ModelWatch.in_place``:
        the graph then reads only memory that live tensors hold). Where the check then finds a change,
        the result is dropped once the GPU is done with it and None is returned: the caller follows
        the change and runs the step again."""
        if not (self._ahead and self.sets.graphs_on) or not self.follower.watch.in_place():
            return None
        out = self.sets.replay(inputs)
        if out is not None and self.follower.stale():
            torch.cuda.synchronize(self._device)  # it read what is about to change: let it finish first
            self.sets.replays_dropped += 1
            return None
        return out

    # -- MTTM's verbs ---------------------------------------------------------------------------
    def refit_gm(self) -> dict[str, Any]:
        """MTTM's ``refit_gm``: bring every engine set up to date with the transformer now, rather than
        at the next call (refit, re-bind or mark for rebuild, as a call would). Returns what was done."""
        with torch.no_grad():
            return self.follower.follow()

    def set_expected_dynamic_shape_range(
        self, args_dynamic_shape: tuple = (), kwargs_dynamic_shape: dict | None = None
    ) -> ShapeRange:
        """MTTM's ``set_expected_dynamic_shape_range``: the range engine set covers these axes.

        Each entry maps an axis index to a ``torch.export.Dim`` (anything with int ``min``/``max``), by
        forward position in ``args_dynamic_shape`` or by name in ``kwargs_dynamic_shape``; the dynamic
        axes of each input are the spec's (``ModelSpec.axes``; PRX: ``hidden_states`` 0 batch, 2 latent
        height, 3 latent width; ``encoder_hidden_states`` and ``attention_mask`` 0 batch, 1 text
        tokens; ``timestep`` 0 batch). Axes not named keep the current range. The range set is
        replaced (built at its first call); the static sets stay. Returns the new range."""
        names = [n for n in self._forward_signature.parameters if n != "self"]
        given = dict(zip(names, args_dynamic_shape, strict=False))
        given.update(kwargs_dynamic_shape or {})
        axes = self.spec.axes(self.transformer)
        base = self.shapes
        bounds: dict[str, tuple[int, int]] = {}
        for arg, dims in given.items():
            if arg not in axes or not isinstance(dims, dict):
                raise ConfigError(
                    f"set_expected_dynamic_shape_range: {arg!r} is not an input with dynamic axes.",
                    f"map axis -> torch.export.Dim for {sorted(axes)}.",
                )
            for axis, dim in dims.items():
                key = axes[arg].get(axis)
                lo, hi = getattr(dim, "min", None), getattr(dim, "max", None)
                if key is None or not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                    raise ConfigError(
                        f"set_expected_dynamic_shape_range: {arg} axis {axis}: {dim!r} is not a dynamic "
                        f"axis with int min/max (dynamic axes of {arg}: {axes[arg]}).",
                        "e.g. {'hidden_states': {0: Dim('batch', min=1, max=4)}}.",
                    )
                if bounds.setdefault(key, (lo, hi)) != (lo, hi):
                    raise ConfigError(f"set_expected_dynamic_shape_range: two different ranges for {key}.")
        m = base.multiple
        odd = [k for k in ("height", "width") if k in bounds and any(v % m for v in bounds[k])]
        if odd:
            raise ConfigError(
                f"set_expected_dynamic_shape_range: latent {odd[0]} {list(bounds[odd[0]])} must be "
                f"multiples of the patch size {m}."
            )
        shapes = ShapeRange(
            *(bounds.get(k, getattr(base, k)) for k in ("batch", "height", "width", "text")),
            multiple=m,
            tokens=base.tokens,
        )
        self.sets.set_range(shapes)
        return shapes

    # -- weights --------------------------------------------------------------------------------
    @property
    def needs_refit(self) -> bool:
        """True when weight changes must be pushed into engines (``weights: engine``)."""
        return self.sets.needs_refit

    def weights_changed(self, names: list[str], *, quantized: Collection[str] = ()) -> dict[str, Any]:
        """Bring every built engine set (and, with ``precision: fp8``, the FP8 copies of the
        weights but those of ``quantized``, already refreshed by the caller) up to date after these
        parameters changed in place (``ChangeFollower``)."""
        return self.follower.weights_changed(names, quantized)

    def report(self) -> dict[str, Any]:
        """Engine sets (shapes, engines (distinct) and engine calls, PyTorch segments, ops kept in
        PyTorch, build time and where a set's first call went: ``timings``; its four slowest engine
        builds: ``slowest_engines``; the kernels it measured and chose: ``kernels``,
        ``choice.KernelChoice``), the first built set's kernels (before any is
        built: the candidates), versions; ``lora``: the loaded adapters, the active scales and what
        ``disable_lora`` set aside (``lora.summary``; None without LoRA)."""
        from ..lora.adapters import summary as lora_summary  # it imports the runtime package

        backends = self.sets.backends
        built = [b for b in backends if b.is_built]
        sets = [
            {
                "shapes": b.shapes.describe(),
                "build_s": b.build_s,
                "timings": dict(b.timings),
                "slowest_engines": dict(list(b.engine_build_s.items())[:4]),
                "kernels": b.kernels.to_json() if b.kernels is not None else None,
                **b.report(),
            }
            if b.is_built
            else {"shapes": b.shapes.describe(), "build_s": None}
            for b in backends
        ]
        first = built[0].report() if built else empty_report()
        plan, cfg = self.plan, self.compile_config
        return {
            **first,
            "model": self.spec.name,
            "build_s": sum(b.build_s or 0.0 for b in built),
            "backend": cfg.backend,
            "attention": cfg.attention,
            "weights": cfg.weights,
            "precision": cfg.precision,
            "kernels": sets[backends.index(built[0])]["kernels"] if built else plan.kernels(),
            "cuda_graphs": self.sets.graphs_on,
            "shapes": self.shapes.describe(),
            "engine_sets": sets,
            "builds": self.builds,
            "lora": lora_summary(self),
            **(built[0].versions() if built else {}),
        }

    def extra_repr(self) -> str:
        cfg = self.compile_config
        return (
            f"model={self.spec.name}, backend={cfg.backend}, attention={cfg.attention}, "
            f"weights={cfg.weights}, "
            f"{len(self.backends)} engine set(s), widest: {self.shapes.describe()}"
        )


def _model_mixin() -> type:
    from diffusers import ModelMixin

    return ModelMixin


@functools.cache
def _compiled_class(model_class: type) -> type:
    """``CompiledTransformer`` as a subclass of ``model_class`` too, named like it and in its module:
    diffusers reads a component's library and class from ``__module__`` and ``__class__.__name__``
    (``_fetch_class_library_tuple``) and saves a component whose class is a ``ModelMixin``, through its
    ``save_pretrained`` (ours: the transformer's). The methods of this class come first."""
    return type(
        model_class.__name__,
        (CompiledTransformer, model_class),
        {
            "__module__": model_class.__module__,
            "__qualname__": f"CompiledTransformer[{model_class.__name__}]",
        },
    )


def _refuse_peft_layers(transformer: torch.nn.Module, walk: bool = False) -> None:
    """PEFT layers (a LoRA loaded on the eager transformer, or injected by PEFT) replace linears the
    engines never call: refused, at every call (a PEFT config) and before a compile (``walk``: also
    layers left without one, as diffusers' ``delete_adapters`` leaves them)."""
    peft_layers = walk and any(type(m).__module__.startswith("peft.") for m in transformer.modules())
    if getattr(transformer, "peft_config", None) or peft_layers:
        raise ConfigError(
            "the transformer holds PEFT adapters (a LoRA loaded before compiling, or injected by PEFT), "
            "whose layers a compiled transformer's engines never call.",
            "pipe.unload_lora_weights() first (pipe.fuse_lora() before it keeps the LoRA in the weights), "
            "compile, then load the LoRA on the compiled pipeline.",
        )


def _refuse_sequential_offload(hook: Any) -> None:
    """accelerate's ``cpu_offload`` (``enable_sequential_cpu_offload``) moves each layer's weights
    to the device at its call: engines never call the layers. Model offload (``CpuOffload``) is fine."""
    hooks = getattr(hook, "hooks", (hook,))
    if any(type(h).__name__ == "AlignDevicesHook" for h in hooks):
        raise ConfigError(
            "enable_sequential_cpu_offload cannot offload a compiled transformer: its engines read the "
            "weights on the GPU and never call the layers that would load them.",
            "use pipe.enable_model_cpu_offload() (the compiled transformer stays on the GPU), or none.",
        )


def _install_precision(transformer: torch.nn.Module, plan: Plan) -> None:
    """Apply ``precision`` (checked first, so a refused config leaves the model as it was)."""
    config, spec = plan.config, plan.spec
    device = torch.device(config.device)
    if config.precision != "fp8":
        if fp8.fp8_modules(transformer):
            raise ConfigError(
                f"this transformer's block linears are FP8 (precision=fp8 was applied before), "
                f"and this config asks for precision={config.precision}.",
                "compile it with precision='fp8', or start from a transformer without it.",
            )
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            f"precision=fp8 needs FP8 GEMMs (compute capability 8.9 or newer); {device} has "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}.",
            "use precision: dtype on this GPU.",
        )
    if not fp8.install(transformer, spec.block_linears):
        raise ConfigError("precision=fp8: no block linear of this transformer can run in FP8.")
    fp8.place_masters(transformer, config.fp8_masters)


def assemble(
    transformer: torch.nn.Module,
    plan: Plan,
    *,
    restore=None,
    backends=None,
    load_s: float | None = None,
) -> CompiledTransformer:
    """A ``CompiledTransformer`` over ``transformer``, in the one order both compiling and loading
    follow: the precision installed (FP8 copies), ``restore()`` (a loaded artifact's LoRA, which the
    FP8 copies then follow), the engine sets (``backends(plan)``: a loaded artifact's; None: new ones,
    built at first use)."""
    _install_precision(transformer, plan)
    if restore is not None:
        restore()
    return CompiledTransformer(transformer, plan, backends(plan) if backends is not None else None, load_s)


def compile_transformer(
    transformer: torch.nn.Module,
    *,
    config: CompileConfig | dict | str | None = None,
    backend: str | None = None,
    build: bool = False,
    **overrides: Any,
) -> CompiledTransformer:
    """Compile a diffusers transformer of a supported class; the result replaces ``pipe.transformer``.

    Args:
        transformer: a ``PRXTransformer2DModel`` or ``FluxTransformer2DModel`` (in its final dtype and
            device); ``prx_compile.models.supported()`` lists the classes.
        config: a ``CompileConfig``, a dict, a YAML path or a preset name from ``configs/``.
        backend: "tensorrt" (default), "inductor" or "eager": shorthand for the ``backend=`` override.
        build: build every engine set now instead of at first use.
        **overrides: any ``CompileConfig`` key, e.g. ``attention="tensorrt"``, ``batch=[1, 4]``.

    Raises:
        ConfigError: an unsupported class (naming the supported ones); unknown key or bad value;
            dtype mismatch; a config made for another model.
        BackendUnavailableError: backend="tensorrt" without Torch-TensorRT or a GPU.
    """
    if isinstance(transformer, CompiledTransformer):
        raise ConfigError(
            "this transformer is compiled already.", "pass compiled.transformer to compile it again."
        )
    spec = spec_for(transformer)  # an unsupported class is refused here, in one line
    why = spec.config_problem(transformer.config)
    if why is not None:
        raise ConfigError(f"this {type(transformer).__name__} cannot run: {why}.")
    _refuse_peft_layers(transformer, walk=True)
    if backend is not None:
        overrides["backend"] = backend
    cfg = CompileConfig.resolve(config, **overrides)
    plan = Plan.resolve(cfg, transformer, spec)  # what this model cannot take is refused before any work
    dtype = next(transformer.parameters()).dtype
    if cfg.dtype is not None and cfg.torch_dtype() != dtype:
        raise ConfigError(
            f"the transformer is {dtype} but config.dtype is {cfg.dtype!r}.",
            f"call transformer.to({cfg.torch_dtype()}) first, or set dtype: null.",
        )
    device = next(transformer.parameters()).device
    if cfg.backend == "tensorrt":
        from ..backends.tensorrt import shim

        shim.torch_tensorrt()  # BackendUnavailableError with an install hint, before anything moves
        if device.type != "cuda":
            logger.info("moving the transformer to %s for TensorRT", cfg.device)
            transformer.to(cfg.device)
    elif device.type != torch.device(cfg.device).type:  # PyTorch backends run where the model is
        plan = plan.replace(config=plan.config.replace(device=str(device)))
    if transformer.training:
        transformer.eval()
    compiled = assemble(transformer, plan)
    return compiled.build() if build else compiled


def compile_prx(transformer: torch.nn.Module, **kwargs: Any) -> CompiledTransformer:
    """``compile_transformer`` for a ``PRXTransformer2DModel`` (PRXPixel included); another class is
    refused in one line that names ``compile_transformer``. Takes the same arguments."""
    spec = spec_for(transformer) if isinstance(transformer, torch.nn.Module) else None
    if spec is None or spec.name != "prx":
        raise ConfigError(
            f"compile_prx takes a {SPECS['prx'].class_name}, got {type(transformer).__name__}.",
            "pass pipe.transformer of a PRX pipeline, or compile_transformer for the other supported "
            "classes.",
        )
    return compile_transformer(transformer, **kwargs)
