"""``CompiledTransformer``: the drop-in replacement for ``pipe.transformer``.

It keeps what PRXPipeline and users read (``.config``, ``.dtype``, ``.device``, the forward kwargs
including ``attention_mask`` and ``return_dict``) and holds one or more engine sets over the same
weights: one per ``specialize`` shape (static, the fastest) and one for the whole range. A call runs
the most specific set that fits, building it on first use; a shape outside every set gets a set of
its own (``on_shape_miss: build``, with a warning) or a ``ShapeOutOfRangeError`` (``error``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from . import fp8, progress
from .backends import Backend, make_backend
from .config import CompileConfig
from .cudagraphs import CUDAGraphRunner
from .errors import ConfigError, ShapeOutOfRangeError
from .export import ShapeRange, example_inputs

logger = logging.getLogger(__name__)


class CompiledTransformer(torch.nn.Module):
    """A compiled PRXTransformer2DModel with the same call signature.

    Attributes:
        transformer: the original module; its parameters are the one copy of the weights.
        compile_config: the ``CompileConfig`` it was built with.
        backends: one ``Backend`` per engine set (``backend.shapes`` is its ``ShapeRange``).
        builds: how many engine sets were built in this process (cache hits and loads not counted).
    """

    def __init__(
        self, transformer: torch.nn.Module, config: CompileConfig, backends: list[Backend] | None = None
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
        if backends is None:
            backends = [make_backend(transformer, config, s) for s in sets]
        self.backends: list[Backend] = backends
        self._graphs: dict[int, CUDAGraphRunner] = {}
        self._pool = None
        self._weights_at_capture: tuple | None = None
        self._slots = [
            (m, n)
            for m in transformer.modules()
            for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        ]
        self.builds = 0
        self.cache_hits: list[dict[str, Any]] = []
        self.load_s: float | None = None

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

    def to(self, *args, **kwargs):
        """Moving a compiled module is a no-op (engines live on the device they were built on)."""
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise ConfigError(
                f"cannot cast a compiled transformer to {dtype}: it was built for {self.dtype}.",
                "compile again from a transformer in that dtype.",
            )
        if device is not None and torch.device(device).type != self._device.type:
            logger.warning("ignoring .to(%s): the compiled transformer stays on %s", device, self._device)
        return self

    # -- build ----------------------------------------------------------------------------------
    def build(self, example: dict[str, torch.Tensor] | None = None) -> CompiledTransformer:
        """Build every engine set not built yet, each at its tuning point, and load every set read from
        an artifact (which otherwise loads at its first call); or, with ``example`` (PRX forward
        kwargs), only the set that call would run."""
        with torch.no_grad():
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
        example = self._example(backend.shapes)
        logger.info("building engine set %d/%d: %s", index + 1, len(self.backends), backend.shapes.describe())
        t0 = time.perf_counter()
        with progress.stage(f"engine set {index + 1}/{len(self.backends)}: {backend.shapes.describe()}"):
            if self.compile_config.engine_cache_dir:
                from .cache import build_through_cache

                backend, hit = build_through_cache(backend, example)
                self.cache_hits.append(hit)
                self.backends[index] = backend
                if hit["load_s"] is None:
                    self.builds += 1
            else:
                backend.build(example)
                self.builds += 1
        logger.info("engine set ready in %.1f s: %s", time.perf_counter() - t0, backend.shapes.describe())
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
        for k in ("hidden_states", "encoder_hidden_states"):
            if inputs[k].dtype != self.dtype:
                raise ConfigError(
                    f"{k} is {inputs[k].dtype}, the compiled transformer is {self.dtype}.",
                    f"pass {self.dtype} inputs (pipe(..., torch_dtype) or .to(dtype)).",
                )
        for k, v in inputs.items():
            if v.device.type != self._device.type or (
                self._device.index is not None and v.device.index != self._device.index
            ):
                raise ConfigError(f"{k} is on {v.device}, the compiled transformer runs on {self._device}.")

    def engine_set_for(self, inputs: dict[str, torch.Tensor]) -> Backend | None:
        """The engine set a call with ``inputs`` runs: the most specific one that fits (built or not),
        or None when none fits (a call would then build one, or raise). Nothing is built here."""
        b, _, h, w = inputs["hidden_states"].shape
        t = inputs["encoder_hidden_states"].shape[1]
        fits = [be for be in self.backends if be.shapes.fits(b, h, w, t)]
        return min(fits, key=lambda be: be.shapes.volume()) if fits else None

    def _backend_for(self, inputs: dict[str, torch.Tensor]) -> Backend:
        """The most specific engine set that fits (built on first use), or a new one on a miss."""
        backend = self.engine_set_for(inputs)
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
                    "or set on_shape_miss='build'.",
                )
            patch = self.config.patch_size
            self.backends.append(
                make_backend(self.transformer, self.compile_config, ShapeRange.static(b, h, w, t, patch))
            )
            t0 = time.perf_counter()
            try:
                backend = self._build_backend(len(self.backends) - 1)
            except BaseException:
                self.backends.pop()  # no half-made set stays behind
                raise
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

    def _step(self, backend: Backend, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        for module in self._fp8:  # weights edited in place outside load_lora (load_state_dict, copy_)
            module.refresh()
        if not (self.compile_config.cuda_graphs and self._device.type == "cuda"):
            return backend(**inputs)
        weights = tuple(getattr(m, n).data_ptr() for m, n in self._slots)
        if weights != self._weights_at_capture:  # parameters were replaced, not updated in place
            for runner in self._graphs.values():
                runner.reset()
            self._weights_at_capture = weights
        runner = self._graphs.get(id(backend))
        if runner is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            runner = self._graphs[id(backend)] = CUDAGraphRunner(backend, pool=self._pool)
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
            out = self._run(self._backend_for(inputs), inputs)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

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
                self._graphs[id(backend)].reset()
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
        first = built[0].report() if built else {"engines": 0, "torch_segments": 0, "torch_ops": {}}
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
        from .backends import trt_shim

        trt_shim.torch_tensorrt()  # BackendUnavailableError with an install hint, before anything moves
        if device.type != "cuda":
            logger.info("moving the transformer to %s for TensorRT", cfg.device)
            transformer.to(cfg.device)
    elif device.type != torch.device(cfg.device).type:  # PyTorch backends run where the model is
        cfg = cfg.replace(device=str(device))
    if transformer.training:
        transformer.eval()
    compiled = CompiledTransformer(transformer, cfg)
    return compiled.build() if build else compiled
