"""``CompiledTransformer``: the drop-in replacement for ``pipe.transformer``.

It keeps what PRXPipeline and users read (``.config``, ``.dtype``, ``.device``, the forward kwargs
including ``attention_mask`` and ``return_dict``) and holds one or more engine sets over the same
weights: one per ``specialize`` shape (static, the fastest) and one for the whole range. A call runs
the most specific set that fits, building it on first use. A shape whose batch alone is too large
runs in batch chunks that the sets take (``on_shape_miss: split``, the default; a warning once per
shape); any other shape outside every set gets a set of its own (``build`` does that for every
miss, with a warning); ``error`` raises ``ShapeOutOfRangeError``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from .. import progress
from ..backends import Backend, make_backend
from ..backends.base import empty_report
from ..config import DTYPES, CompileConfig
from ..errors import ConfigError, LoRAError, ShapeOutOfRangeError
from ..export import example_inputs
from ..quant import fp8
from ..shapes import ShapeRange
from .cudagraphs import CUDAGraphRunner
from .watch import ModelWatch, changes, signature

logger = logging.getLogger(__name__)


def _delegated(name: str):
    """A method that calls the transformer's ``name`` (the compiled module's nn.Module view)."""

    def method(self, *args, **kwargs):
        return getattr(self.transformer, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The transformer's ``{name}`` (the compiled module holds no tensors of its own)."
    return method


class CompiledTransformer(torch.nn.Module):
    """A compiled PRXTransformer2DModel with the same call signature and the transformer's module view.

    One copy of the weights: the transformer is held outside ``_modules`` (registering it would make
    every state-dict key ``transformer.*`` and let module-wide operations reach it twice), and the
    ``nn.Module`` view is the transformer's: ``parameters``, ``named_parameters``, ``buffers``,
    ``state_dict``, ``load_state_dict`` (strict semantics and return value its own), ``children``,
    ``modules``, ``named_modules``, ``apply``, ``train``/``eval`` delegate to it, and writing an
    attribute the compiled module does not own sets it on the transformer. Whatever changes the
    transformer, through either object, is followed at the next call (``_follow``): weights changed in
    place are read live (``weights: inputs``), refit (``weights: engine``) or re-quantised (fp8); a
    changed structure (names, shapes, dtypes, module types) rebuilds the engine sets with a warning;
    a swapped submodule of the same structure is re-bound. ``.to(dtype)``, ``.half()``, ``.float()``,
    ``.bfloat16()`` cast the transformer, so the engine sets are rebuilt for the new dtype.

    Made for a diffusers model, the object's class is a subclass of both this class and the
    transformer's (named like it), so diffusers' ``register_modules`` records the transformer's
    library and class in ``model_index.json`` and ``pipe.save_pretrained`` saves the transformer.

    Attributes:
        transformer: the original module; its parameters are the one copy of the weights.
        compile_config: the ``CompileConfig`` it was built with.
        backends: one ``Backend`` per engine set (``backend.shapes`` is its ``ShapeRange``).
        builds: how many engine sets were built in this process (cache hits and loads not counted).
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        config: CompileConfig,
        backends: list[Backend] | None = None,
        load_s: float | None = None,
    ):
        super().__init__()
        object.__setattr__(self, "transformer", transformer)  # not a submodule: no duplicate params
        self.compile_config = config
        self._device = torch.device(config.device)
        patch = transformer.config.patch_size
        if backends is None:
            sets = config.shape_sets(patch)
            odd = [s.describe() for s in sets if s.height[0] % patch or s.width[0] % patch]
            if odd:
                raise ConfigError(
                    f"engine set {odd[0]}: latent sizes must be multiples of the patch size {patch}.",
                    f"use pixel sizes that are multiples of {patch * config.vae_scale_factor}.",
                )
        self._fp8 = self._precision(transformer, config)
        self._fp8_versions: tuple[int, ...] | None = None  # the weights' version counters last seen
        if backends is None:
            backends = [make_backend(transformer, config, s) for s in sets]
        self.backends: list[Backend] = backends
        self._graphs: dict[int, CUDAGraphRunner] = {}
        self._pool = None
        self._watch = ModelWatch(transformer)  # what the engine sets were built for (``_follow``)
        self._rebuilding: dict[int, str] = {}  # id(engine set) -> why it is built again
        self._moved_warned = False
        self._ahead = True  # replay before the change check where that is safe (``_replay_ahead``)
        self.replays_dropped = 0  # steps replayed ahead whose result a change then made void
        self._split_warned: set[tuple[int, int, int, int]] = set()  # shapes run in batch chunks
        self.builds = 0
        self.cache_hits: list[dict[str, Any]] = []
        self.load_s = load_s  # seconds load_compiled took to make this module (None: compiled here)
        if type(self) is CompiledTransformer and isinstance(transformer, _model_mixin()):
            self.__class__ = _compiled_class(type(transformer))  # what diffusers saves (save_pretrained)
        self._ready = True  # from here on, attributes it does not own are the transformer's

    def _precision(self, transformer: torch.nn.Module, config: CompileConfig) -> list[fp8.FP8Linear]:
        """Apply ``precision`` (checked first, so a refused config leaves the model as it was);
        returns the FP8 modules."""
        if config.precision != "fp8":
            if fp8.fp8_modules(transformer):
                raise ConfigError(
                    f"this transformer's block linears are FP8 (precision=fp8 was applied before), "
                    f"and this config asks for precision={config.precision}.",
                    "compile it with precision='fp8', or start from a transformer without it.",
                )
            return []
        if self._device.type == "cuda" and torch.cuda.get_device_capability(self._device) < (8, 9):
            raise ConfigError(
                f"precision=fp8 needs FP8 GEMMs (compute capability 8.9 or newer); {self._device} has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(self._device)))}.",
                "use precision: dtype on this GPU.",
            )
        if not fp8.install(transformer):
            raise ConfigError("precision=fp8: no block linear of this transformer can run in FP8.")
        return [m for m in transformer.modules() if isinstance(m, fp8.FP8Linear)]

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
    def shapes(self) -> ShapeRange:
        """The widest engine set's range."""
        return max((b.shapes for b in self.backends), key=lambda s: s.volume())

    @property
    def is_built(self) -> bool:
        return all(b.is_built for b in self.backends)

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
        if self._owns(name):
            super().__setattr__(name, value)
        else:
            setattr(self.transformer, name, value)  # noticed at the next call (``_follow``)

    def __delattr__(self, name: str) -> None:
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
        """The transformer's ``save_pretrained``: a diffusers ``PRXTransformer2DModel`` folder (what
        ``pipe.save_pretrained`` writes as ``transformer/``). With a LoRA loaded, the weights saved are
        the current ones, the LoRA merged at its scales (as the images are); ``save_compiled`` keeps the
        adapters apart instead."""
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
            self.transformer.to(dtype=dtype)
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

    def _apply(self, fn, recurse: bool = True):
        raise ConfigError(
            "a compiled transformer cannot apply an arbitrary tensor conversion (.type(), .to_empty(), "
            ".share_memory(), ...).",
            "use .to(dtype), or convert compiled.transformer and compile it again.",
        )

    # -- build ----------------------------------------------------------------------------------
    def build(self, example: dict[str, torch.Tensor] | None = None) -> CompiledTransformer:
        """Build every engine set not built yet, each at its tuning point, and load every set read from
        an artifact (which otherwise loads at its first call); or, with ``example`` (PRX forward
        kwargs), only the set that call would run."""
        with torch.no_grad():
            self._follow()
            if example is not None:
                inputs = self._normalise(**example)
                self._check(inputs)
                self._backend_for(inputs)
                return self
            for i, backend in enumerate(self.backends):
                if not backend.is_built:
                    self._build_backend(i)
                else:
                    backend.load()  # a loaded artifact's engines, deserialised now rather than at first use
        return self

    def _example(self, shapes: ShapeRange) -> dict[str, torch.Tensor]:
        b, h, w, t = shapes.opt_point()
        return self._normalise(
            **example_inputs(self.config, b, h, w, t, dtype=self.dtype, device=self._device)
        )

    def _build_backend(self, index: int) -> Backend:
        backend = self.backends[index]
        why = self._rebuilding.pop(id(backend), None)
        example = self._example(backend.shapes)
        logger.info("building engine set %d/%d: %s", index + 1, len(self.backends), backend.shapes.describe())
        t0 = time.perf_counter()
        with progress.stage(f"engine set {index + 1}/{len(self.backends)}: {backend.shapes.describe()}"):
            if self.compile_config.engine_cache_dir:
                from ..io.cache import build_through_cache

                backend, hit = build_through_cache(backend, example)
                self.cache_hits.append(hit)
                self.backends[index] = backend
                if hit["load_s"] is None:
                    self.builds += 1
            else:
                backend.build(example)
                self.builds += 1
        logger.info("engine set ready in %.1f s: %s", time.perf_counter() - t0, backend.shapes.describe())
        if why:
            logger.warning(
                "rebuilt engine set %s in %.1f s: the transformer changed (%s).",
                backend.shapes.describe(),
                time.perf_counter() - t0,
                why,
            )
        return backend

    # -- the step -------------------------------------------------------------------------------
    def _normalise(self, hidden_states, timestep, encoder_hidden_states, attention_mask=None):
        for name, v in (("hidden_states", hidden_states), ("encoder_hidden_states", encoder_hidden_states)):
            if not isinstance(v, torch.Tensor):
                raise ShapeOutOfRangeError(f"{name} must be a tensor, got {type(v).__name__}.")
        b = hidden_states.shape[0] if hidden_states.dim() else 0
        timestep = torch.as_tensor(timestep, device=hidden_states.device).float().reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b).contiguous()
        if attention_mask is None:  # all-True mask == no mask, exactly; keeps one build for both
            if encoder_hidden_states.dim() < 2:
                raise ShapeOutOfRangeError(
                    f"encoder_hidden_states has shape {tuple(encoder_hidden_states.shape)}, "
                    "expected (B, T, C)."
                )
            attention_mask = torch.ones(
                encoder_hidden_states.shape[:2], dtype=torch.bool, device=encoder_hidden_states.device
            )
        elif not isinstance(attention_mask, torch.Tensor):
            raise ShapeOutOfRangeError(
                f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}."
            )
        return {
            "hidden_states": hidden_states,
            "timestep": timestep,
            "encoder_hidden_states": encoder_hidden_states,
            "attention_mask": attention_mask.bool(),
        }

    def _check(self, inputs: dict[str, torch.Tensor]) -> None:
        """Rank, channels, batch agreement, dtype and device of every input (not the shape range)."""
        cfg = self.config
        hs, ehs = inputs["hidden_states"], inputs["encoder_hidden_states"]
        problems = []
        if hs.dim() != 4 or hs.shape[1] != cfg.in_channels:
            problems.append(
                f"hidden_states has shape {tuple(hs.shape)}, expected (B, {cfg.in_channels}, H, W)"
            )
        if ehs.dim() != 3 or ehs.shape[2] != cfg.context_in_dim:
            problems.append(
                f"encoder_hidden_states has shape {tuple(ehs.shape)}, expected (B, T, {cfg.context_in_dim})"
            )
        if not problems and min(*hs.shape, *ehs.shape) < 1:
            problems.append(
                f"empty input: hidden_states {tuple(hs.shape)}, encoder_hidden_states {tuple(ehs.shape)}"
            )
        if not problems:
            b, t = hs.shape[0], ehs.shape[1]
            if ehs.shape[0] != b:
                problems.append(f"encoder_hidden_states has batch {ehs.shape[0]}, hidden_states {b}")
            if inputs["timestep"].shape != (b,):
                problems.append(
                    f"timestep has shape {tuple(inputs['timestep'].shape)}, expected ({b},) or (1,)"
                )
            if tuple(inputs["attention_mask"].shape) != (b, t):
                problems.append(
                    f"attention_mask has shape {tuple(inputs['attention_mask'].shape)}, expected {(b, t)}"
                )
        if problems:
            raise ShapeOutOfRangeError("; ".join(problems) + ".", "pass the inputs PRXPipeline passes.")
        dtype = self.dtype
        for k in ("hidden_states", "encoder_hidden_states"):
            if inputs[k].dtype != dtype:
                raise ConfigError(
                    f"{k} is {inputs[k].dtype}, the compiled transformer is {dtype}.",
                    f"pass {dtype} inputs (pipe(..., torch_dtype) or .to(dtype)).",
                )
        for k, v in inputs.items():
            if v.device.type != self._device.type or (
                self._device.index is not None and v.device.index != self._device.index
            ):
                raise ConfigError(f"{k} is on {v.device}, the compiled transformer runs on {self._device}.")

    def engine_set_for(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """The engine set a call with ``inputs`` runs: the most specific one that fits (built or not),
        or None when none fits (a call would then build one, or raise). Nothing is built here. Where
        that is a range set not built yet, the call may build a static set instead
        (``auto_specialize``)."""
        b, _, h, w = inputs["hidden_states"].shape
        t = inputs["encoder_hidden_states"].shape[1]
        fits = [be for be in self.backends if be.shapes.fits(b, h, w, t)]
        return min(fits, key=lambda be: be.shapes.volume()) if fits else None

    def _backend_for(self, inputs: dict[str, torch.Tensor]) -> Backend:
        """The most specific engine set that fits (built on first use), or a new one on a miss."""
        backend = self.engine_set_for(inputs)
        if backend is not None and not backend.is_built and not backend.shapes.is_static():
            backend = self._set_of_its_own(inputs) or backend
        if backend is None:
            b, _, h, w = inputs["hidden_states"].shape
            t = inputs["encoder_hidden_states"].shape[1]
            sets = "; ".join(be.shapes.describe() for be in self.backends)
            shape = f"batch {b}, latent {h}x{w}, text {t} tokens"
            problems = self.shapes.problems(b, h, w, t)
            if any("multiple" in p for p in problems):  # no engine set can take it
                px = self.config.patch_size * self.compile_config.vae_scale_factor
                raise ShapeOutOfRangeError(
                    f"{shape} is outside every engine set ({'; '.join(problems)}). Built for: {sets}.",
                    f"use image sizes that are multiples of {px} pixels (e.g. {px * 32}).",
                )
            if self.compile_config.on_shape_miss == "error":
                raise ShapeOutOfRangeError(
                    f"{shape} is outside every engine set ({'; '.join(problems)}). Built for: {sets}.",
                    "widen batch/aspect_bins/text_len or add the shape to specialize in the config, "
                    "or set on_shape_miss='split' or 'build'.",
                )
            t0 = time.perf_counter()
            backend = self._add_set(ShapeRange.static(b, h, w, t, self.config.patch_size))
            logger.warning(
                "built engines for %s in %.1f s: it was outside every engine set (%s). Add it to "
                "specialize (or widen the range) to build it ahead.",
                shape,
                time.perf_counter() - t0,
                sets,
            )
        if not backend.is_built:
            i = next(i for i, be in enumerate(self.backends) if be is backend)
            backend = self._build_backend(i)  # a cache hit replaces the set in self.backends
        backend.load()  # before any CUDA graph capture
        return backend

    def _add_set(self, shapes: ShapeRange) -> Backend:
        """A new engine set for ``shapes``, built now; a failed build leaves no set behind."""
        self.backends.append(make_backend(self.transformer, self.compile_config, shapes))
        try:
            return self._build_backend(len(self.backends) - 1)
        except BaseException:
            self.backends.pop()
            raise

    def _set_of_its_own(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """``auto_specialize``: a static engine set for this call's shape, built now, where the call
        would build the config's range set and fewer than ``auto_specialize`` such sets exist (the
        static sets inside a range that ``specialize`` does not name); None: the range set is built
        (also for a range ``set_expected_dynamic_shape_range`` declared: that asks for the range)."""
        cfg = self.compile_config
        b, _, h, w = inputs["hidden_states"].shape
        t = inputs["encoder_hidden_states"].shape[1]
        ranges = [be.shapes for be in self.backends if not be.shapes.is_static()]
        if cfg.static or cfg.range_shapes(self.config.patch_size) not in ranges:
            return None
        planned = set(cfg.specialized_shapes(self.config.patch_size))
        made = [
            be.shapes
            for be in self.backends
            if be.shapes.is_static()
            and be.shapes not in planned
            and any(r.fits(*be.shapes.opt_point()) for r in ranges)
        ]
        if len(made) >= cfg.auto_specialize:
            return None
        backend = self._add_set(ShapeRange.static(b, h, w, t, self.config.patch_size))
        logger.info(
            "built a static engine set for %s (auto_specialize: %d of %d; once there are %d, a new "
            "shape builds the range set)",
            backend.shapes.describe(),
            len(made) + 1,
            cfg.auto_specialize,
            cfg.auto_specialize,
        )
        return backend

    def _call(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step: on the engine set that fits, or (``on_shape_miss: split``) for a batch no set
        takes whole, in chunks along the batch that sets take; else ``_backend_for``'s miss."""
        if self.compile_config.on_shape_miss == "split" and self.engine_set_for(inputs) is None:
            sizes = self._chunks(inputs)
            if sizes is not None:
                return self._in_chunks(inputs, sizes)
        return self._run(self._backend_for(inputs), inputs)

    def _chunks(self, inputs: dict[str, torch.Tensor]) -> list[int] | None:
        """Batch sizes that add up to the call's batch, each taken by an engine set at the call's
        latent size and text length (the largest such batch first, greedily); None where there is
        no such split (another latent size or text length: a set of its own is built)."""
        b, _, h, w = inputs["hidden_states"].shape
        t = inputs["encoder_hidden_states"].shape[1]
        sizes, left = [], b
        while left:
            takes = (min(be.shapes.batch[1], left) for be in self.backends)
            n = max(
                (k for k, be in zip(takes, self.backends, strict=True) if be.shapes.fits(k, h, w, t)),
                default=0,
            )
            if n == 0:
                return None
            sizes.append(n)
            left -= n
        if (b, h, w, t) in self._split_warned:
            return sizes
        self._split_warned.add((b, h, w, t))
        sets = "; ".join(be.shapes.describe() for be in self.backends)
        logger.warning(
            "batch %d, latent %dx%d, text %d tokens is outside every engine set (%s): it runs as "
            "batches of %s through the sets that take them. Add it to specialize (or widen the batch "
            "range) for engines of its own, or set on_shape_miss='build'.",
            b,
            h,
            w,
            t,
            sets,
            " + ".join(map(str, sizes)),
        )
        return sizes

    def _in_chunks(self, inputs: dict[str, torch.Tensor], sizes: list[int]) -> torch.Tensor:
        """The step on ``inputs`` (every one batch-first) as one step per chunk of ``sizes``, each
        chunk's output copied into the result before the next step runs (an engine set may reuse
        its output memory)."""
        out, start = None, 0
        for n in sizes:
            part = {k: v[start : start + n] for k, v in inputs.items()}
            y = self._run(self._backend_for(part), part)
            if out is None:
                out = y.new_empty((sum(sizes), *y.shape[1:]))
            out[start : start + n].copy_(y)
            start += n
        return out

    def _run(self, backend: Backend, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step on ``backend``; its first one in this process is timed into ``backend.timings``
        (``first_run_s``: JIT kernels and warm-ups included; ``graph_capture_s``)."""
        if "first_run_s" in backend.timings:
            return self._step(backend, inputs)
        with progress.stage(f"first step ({backend.shapes.describe()})", backend.timings, "first_run_s"):
            out = self._step(backend, inputs)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
        runner = self._graphs.get(id(backend))
        if runner is not None and runner.capture_s is not None:
            backend.timings["graph_capture_s"] = runner.capture_s
        return out

    def _fp8_weight_versions(self) -> tuple[int, ...]:
        return tuple(m._parameters["weight"]._version for m in self._fp8)

    def _refresh_fp8(self) -> None:
        """Requantise the FP8 copies of weights edited in place outside ``load_lora`` (load_state_dict,
        copy_): one pass over the weights' version counters, the modules only when one moved."""
        versions = self._fp8_weight_versions()
        if versions != self._fp8_versions:
            for module in self._fp8:
                module.refresh()
            self._fp8_versions = versions

    def _step(self, backend: Backend, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._fp8:
            self._refresh_fp8()
        if not (self.compile_config.cuda_graphs and self._device.type == "cuda"):
            return backend(**inputs)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        runner = self._graphs.get(id(backend))
        if runner is None:
            runner = self._graphs[id(backend)] = CUDAGraphRunner(backend, pool=self._pool)
        runner.pool = self._pool  # a new pool after every graph was dropped (_drop_graphs)
        return runner(**inputs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = True,
    ):
        """PRX's forward: hidden_states (B, C, H, W), timestep (B,) or (1,), encoder_hidden_states
        (B, T, context_in_dim), attention_mask (B, T) bool or None -> (B, C, H, W) prediction."""
        if attention_kwargs:
            raise ConfigError(
                f"attention_kwargs {sorted(attention_kwargs)} are not supported by a compiled transformer.",
                "pass attention_kwargs=None.",
            )
        if getattr(self.transformer, "peft_config", None):  # layers replaced: the engines would not see them
            raise ConfigError(
                "the transformer holds PEFT adapters (diffusers' load_lora_weights), which a compiled "
                "transformer cannot apply.",
                "unload them and use prx_compile.load_lora, which updates the weights the engines read.",
            )
        with torch.no_grad():
            inputs = self._normalise(hidden_states, timestep, encoder_hidden_states, attention_mask)
            self._check(inputs)
            out = self._replay_ahead(inputs)
            if out is None:
                self._follow()
                out = self._call(inputs)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    def _replay_ahead(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The step replayed from its captured CUDA graph before the transformer is checked for
        changes, so that the check (``_stale``: tenths of a millisecond of Python for the 1.17 B PRX)
        runs while the GPU works rather than before it starts. Only where that is safe: a graph
        captured for these inputs on a set that has run, and every tensor's storage where it was
        (``ModelWatch.in_place``: the graph then reads only memory that live tensors hold). Where the
        check then finds a change, the result is dropped once the GPU is done with it and None is
        returned: the caller follows the change (``_follow``) and runs the step again."""
        if not (self._ahead and self.compile_config.cuda_graphs and self._device.type == "cuda"):
            return None
        backend = self.engine_set_for(inputs)
        runner = self._graphs.get(id(backend)) if backend is not None else None
        if runner is None or "first_run_s" not in backend.timings or not self._watch.in_place():
            return None
        out = runner.replay(inputs)
        if out is not None and self._stale():
            torch.cuda.synchronize(self._device)  # it read what is about to change: let it finish first
            self.replays_dropped += 1
            return None
        return out

    def _stale(self) -> bool:
        """Whether a call must first follow the transformer (``_follow``) or refresh FP8 copies: the
        cheap checks alone, nothing done."""
        return (
            self._watch.moved()
            or (self.needs_refit and self._watch.edited())
            or (bool(self._fp8) and self._fp8_weight_versions() != self._fp8_versions)
        )

    # -- following the transformer --------------------------------------------------------------
    def _follow(self) -> dict[str, Any]:
        """Bring the engine sets up to date with the transformer, before a call: cheap when nothing
        changed (``ModelWatch.moved``; with ``weights: engine`` also one pass over version counters).
        Returns what was done: ``rebuild`` (reasons), ``rebound``, ``refit`` (names)."""
        if self._watch.moved():
            return self._structure_changed()
        if self.needs_refit:
            names = self._watch.changed_weights()
            if names:
                return self._refit(names)
        return {}

    def _refit(self, names: list[str]) -> dict[str, Any]:
        """``weights_changed`` for edits made outside ``load_lora``; where the engines cannot take them
        (weights TensorRT folded beyond tracing), the sets are built again instead, as MTTM does."""
        try:
            self.weights_changed(names)
            return {"refit": names}
        except LoRAError:
            why = f"{len(names)} weight(s) the engines cannot refit changed ({', '.join(names[:3])})"
            self._rebuild(why, [b for b in self.backends if b.is_built])
            self._watch.synced()
            return {"rebuild": [why]}

    def _structure_changed(self) -> dict[str, Any]:
        """The module tree or a tensor's storage changed: rebuild, re-bind or refit, or refuse."""
        transformer, watch = self.transformer, self._watch
        if self._fp8:  # a swapped block linear becomes FP8 again; a cast one gets its FP8 copies back
            fp8.install(transformer)
            self._fp8 = [m for m in transformer.modules() if isinstance(m, fp8.FP8Linear)]
            self._fp8_versions = None
            for module in self._fp8:
                module.requantize()
        new = signature(transformer)
        diff = changes(watch.signature, new)
        moved = sorted(diff.devices - {self._device.type})
        if moved:
            raise ConfigError(
                f"the transformer's weights were moved to {moved[0]}; the compiled transformer runs on "
                f"{self._device}.",
                f"move them back: compiled.transformer.to({str(self._device)!r}).",
            )
        dtype = self.dtype
        if self.compile_config.backend == "tensorrt" and dtype not in DTYPES.values():
            raise ConfigError(
                f"the transformer was cast to {dtype}, which TensorRT engines cannot run.",
                "cast it to torch.bfloat16, torch.float16 or torch.float32 (pipe.to(dtype) does too).",
            )
        old_versions = watch.version_map()
        self._drop_graphs()  # storage may have moved under captured graphs
        built = [b for b in self.backends if b.is_built]
        if diff.swapped and not diff.structure:
            stuck = [b for b in built if not b.rebind()]
            if stuck:
                diff.structure.append(f"{', '.join(diff.swapped[:3])} swapped (the engines hold its weights)")
        report: dict[str, Any] = {"rebound": diff.swapped} if diff.swapped else {}
        if diff.structure:
            self._rebuild("; ".join(diff.structure), built)
            report = {"rebuild": diff.structure}
        watch.reset()
        if not diff.structure and self.needs_refit:
            versions = watch.version_map()
            names = sorted(
                set(diff.replaced) | {n for n, v in versions.items() if old_versions.get(n, v) != v}
            )
            if names:
                report.update(self._refit(names))
        return report

    def _rebuild(self, why: str, built: list[Backend]) -> None:
        """Replace every engine set by an unbuilt one over the same shapes (built again at its next call)."""
        cfg, dtype = self.compile_config, self.dtype
        if cfg.dtype is not None and cfg.torch_dtype() != dtype:
            names = {v: k for k, v in DTYPES.items()}
            self.compile_config = cfg = cfg.replace(dtype=names.get(dtype))
        self._graphs.clear()
        self._drop_graphs()
        fresh = [make_backend(self.transformer, cfg, b.shapes) for b in self.backends]
        pending = self._rebuilding  # sets changed before and not built again yet keep their reason
        self._rebuilding = {
            id(new): why if old.is_built else pending[id(old)]
            for new, old in zip(fresh, self.backends, strict=True)
            if old.is_built or id(old) in pending
        }
        self.backends = fresh
        if built:
            logger.warning(
                "the transformer changed since its engines were built (%s): %d engine set(s) are built "
                "again at their next call.",
                why,
                len(built),
            )

    def refit_gm(self) -> dict[str, Any]:
        """MTTM's ``refit_gm``: bring every engine set up to date with the transformer now, rather than
        at the next call (refit, re-bind or mark for rebuild, as a call would). Returns what was done."""
        with torch.no_grad():
            return self._follow()

    def set_expected_dynamic_shape_range(
        self, args_dynamic_shape: tuple = (), kwargs_dynamic_shape: dict | None = None
    ) -> ShapeRange:
        """MTTM's ``set_expected_dynamic_shape_range``: the range engine set covers these axes.

        Each entry maps an axis index to a ``torch.export.Dim`` (anything with int ``min``/``max``), by
        forward position in ``args_dynamic_shape`` (hidden_states, timestep, encoder_hidden_states,
        attention_mask) or by name in ``kwargs_dynamic_shape``: ``hidden_states`` 0 batch, 2 latent
        height, 3 latent width; ``encoder_hidden_states`` and ``attention_mask`` 0 batch, 1 text tokens;
        ``timestep`` 0 batch. Axes not named keep the current range. The range set is replaced (built
        at its first call); the static sets stay. Returns the new range."""
        from ..export import ACTIVATIONS

        spec = dict(zip(ACTIVATIONS, args_dynamic_shape, strict=False))
        spec.update(kwargs_dynamic_shape or {})
        axes = {
            "hidden_states": {0: "batch", 2: "height", 3: "width"},
            "timestep": {0: "batch"},
            "encoder_hidden_states": {0: "batch", 1: "text"},
            "attention_mask": {0: "batch", 1: "text"},
        }
        base = self.shapes
        bounds: dict[str, tuple[int, int]] = {}
        for arg, dims in spec.items():
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
        m = self.config.patch_size
        odd = [k for k in ("height", "width") if k in bounds and any(v % m for v in bounds[k])]
        if odd:
            raise ConfigError(
                f"set_expected_dynamic_shape_range: latent {odd[0]} {list(bounds[odd[0]])} must be "
                f"multiples of the patch size {m}."
            )
        shapes = ShapeRange(
            *(bounds.get(k, getattr(base, k)) for k in ("batch", "height", "width", "text")), multiple=m
        )
        dropped = [b for b in self.backends if not b.shapes.is_static()]
        if any(b.is_built for b in dropped):
            logger.warning("dropping the built range engine set(s) for %s", shapes.describe())
        for b in dropped:
            self._graphs.pop(id(b), None)
        self._drop_graphs([])
        self.backends = [b for b in self.backends if b.shapes.is_static()]
        self.backends.append(make_backend(self.transformer, self.compile_config, shapes))
        return shapes

    def _drop_graphs(self, runners: list[CUDAGraphRunner] | None = None) -> None:
        """Drop the CUDA graphs of ``runners`` (None: every runner's). Once no graph is left, the
        next capture gets a new memory pool: PyTorch keeps the id of a pool whose graphs are all
        gone but refuses to capture into it again (an internal assert, ``use_count > 0``), and
        that set would then run without a graph."""
        for runner in self._graphs.values() if runners is None else runners:
            runner.reset()
        if not any(runner.graphs for runner in self._graphs.values()):
            self._pool = None

    # -- weights --------------------------------------------------------------------------------
    @property
    def needs_refit(self) -> bool:
        """True when weight changes must be pushed into engines (``weights: engine``)."""
        return any(b.needs_refit and b.is_built for b in self.backends)

    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        """Bring every built engine set (and, with ``precision: fp8``, the FP8 copies of the
        weights) up to date after these parameters changed in place."""
        fp8.requantize(self.transformer, names)
        total: dict[str, Any] = {"refit_s": 0.0, "engines_refit": 0}
        for backend in self.backends:
            if not backend.is_built:
                continue
            report = backend.weights_changed(names)
            total["refit_s"] += report.get("refit_s", 0.0)
            total["engines_refit"] += report.get("engines_refit", 0)
            if not report.get("graphs_valid", True) and id(backend) in self._graphs:
                self._drop_graphs([self._graphs[id(backend)]])
        self._watch.synced(names)
        return total

    def report(self) -> dict[str, Any]:
        """Engine sets (shapes, engines (distinct) and engine calls, PyTorch segments, ops kept in
        PyTorch, build time and where a set's first call went: ``timings``), versions."""
        built = [b for b in self.backends if b.is_built]
        sets = [
            {"shapes": b.shapes.describe(), "build_s": b.build_s, "timings": dict(b.timings), **b.report()}
            if b.is_built
            else {"shapes": b.shapes.describe(), "build_s": None}
            for b in self.backends
        ]
        first = built[0].report() if built else empty_report()
        cfg = self.compile_config
        return {
            **first,
            "build_s": sum(b.build_s or 0.0 for b in built),
            "backend": cfg.backend,
            "attention": cfg.attention,
            "weights": cfg.weights,
            "precision": cfg.precision,
            "cuda_graphs": cfg.cuda_graphs and self._device.type == "cuda",
            "shapes": self.shapes.describe(),
            "engine_sets": sets,
            "builds": self.builds,
            **(built[0].versions() if built else {}),
        }

    def extra_repr(self) -> str:
        cfg = self.compile_config
        return (
            f"backend={cfg.backend}, attention={cfg.attention}, weights={cfg.weights}, "
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


def compile_prx(
    transformer: torch.nn.Module,
    *,
    config: CompileConfig | dict | str | None = None,
    backend: str | None = None,
    build: bool = False,
    **overrides: Any,
) -> CompiledTransformer:
    """Compile a PRXTransformer2DModel; the result replaces ``pipe.transformer`` as is.

    Args:
        transformer: diffusers' PRXTransformer2DModel (in its final dtype and device).
        config: a ``CompileConfig``, a dict, a YAML path or a preset name from ``configs/``.
        backend: "tensorrt" (default), "inductor" or "eager": shorthand for the ``backend=`` override.
        build: build every engine set now instead of at first use.
        **overrides: any ``CompileConfig`` key, e.g. ``attention="tensorrt"``, ``batch=[1, 4]``.

    Raises:
        ConfigError: unknown key or bad value; dtype mismatch.
        BackendUnavailableError: backend="tensorrt" without Torch-TensorRT or a GPU.
    """
    if isinstance(transformer, CompiledTransformer):
        raise ConfigError(
            "this transformer is compiled already.", "pass compiled.transformer to compile it again."
        )
    if not isinstance(transformer, torch.nn.Module) or not hasattr(transformer, "config"):
        raise ConfigError(
            f"compile_prx takes a PRXTransformer2DModel, got {type(transformer).__name__}.",
            "pass pipe.transformer.",
        )
    if backend is not None:
        overrides["backend"] = backend
    cfg = CompileConfig.resolve(config, **overrides)
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
        cfg = cfg.replace(device=str(device))
    if transformer.training:
        transformer.eval()
    compiled = CompiledTransformer(transformer, cfg)
    return compiled.build() if build else compiled
