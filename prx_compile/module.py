"""``CompiledTransformer``: the drop-in replacement for ``pipe.transformer``.

It keeps what PRXPipeline and users read (``.config``, ``.dtype``, ``.device``, the forward kwargs
including ``attention_mask`` and ``return_dict``), checks every call against the compiled shape
range, and runs the step through its backend — optionally replayed from a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .backends import Backend, make_backend
from .config import CompileConfig
from .cudagraphs import CUDAGraphRunner
from .errors import ConfigError, ShapeOutOfRangeError
from .export import ShapeRange, example_inputs

logger = logging.getLogger(__name__)


class CompiledTransformer(torch.nn.Module):
    """A compiled PRXTransformer2DModel with the same call signature.

    Attributes:
        transformer: the original module (its parameters are the source of truth for LoRA/refit).
        compile_config: the ``CompileConfig`` it was built with.
        shapes: the ``ShapeRange`` one build covers.
        backend: the ``Backend`` running the step.
    """

    def __init__(self, transformer: torch.nn.Module, config: CompileConfig, backend: Backend | None = None):
        super().__init__()
        object.__setattr__(self, "transformer", transformer)  # not a submodule: no duplicate params
        self.compile_config = config
        self.shapes: ShapeRange = config.shape_range(patch_size=transformer.config.patch_size)
        self._device = torch.device(config.device)
        self.backend: Backend = backend or make_backend(transformer, config, self.shapes)
        self._graphs: CUDAGraphRunner | None = None
        self.builds = 0
        self.load_s: float | None = None
        if self.is_built:
            self._after_build()

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
        """Compile now, for ``example`` inputs (default: the tuning point of the shape range)."""
        if example is None:
            b, h, w, t = self.shapes.opt_point()
            example = example_inputs(self.config, b, h, w, t, dtype=self.dtype, device=self._device)
        example = self._normalise(**example)
        if self.compile_config.engine_cache_dir:
            from .serialization import build_through_cache

            self.backend = build_through_cache(self, example)
        else:
            self.backend.build(example)
        self.builds += 1
        self._after_build()
        return self

    def _after_build(self) -> None:
        if self.compile_config.cuda_graphs and self._device.type == "cuda":
            self._graphs = CUDAGraphRunner(self.backend)
        elif self.compile_config.cuda_graphs:
            logger.info("cuda_graphs=True has no effect on %s", self._device)

    @property
    def is_built(self) -> bool:
        return self.backend.build_s is not None

    # -- the step -------------------------------------------------------------------------------
    def _normalise(self, hidden_states, timestep, encoder_hidden_states, attention_mask=None):
        b = hidden_states.shape[0]
        timestep = torch.as_tensor(timestep, device=hidden_states.device).float().reshape(-1)
        if timestep.numel() == 1 and b > 1:
            timestep = timestep.expand(b).contiguous()
        if attention_mask is None:  # all-True mask == no mask, exactly; keeps one build for both
            attention_mask = torch.ones(
                encoder_hidden_states.shape[:2], dtype=torch.bool, device=encoder_hidden_states.device
            )
        return {
            "hidden_states": hidden_states,
            "timestep": timestep,
            "encoder_hidden_states": encoder_hidden_states,
            "attention_mask": attention_mask.bool(),
        }

    def _check(self, inputs: dict[str, torch.Tensor]) -> None:
        problems = self.shapes.problems(inputs["hidden_states"], inputs["encoder_hidden_states"])
        b, t = inputs["hidden_states"].shape[0], inputs["encoder_hidden_states"].shape[1]
        if inputs["timestep"].shape != (b,):
            problems.append(f"timestep has shape {tuple(inputs['timestep'].shape)}, expected ({b},) or (1,)")
        if tuple(inputs["attention_mask"].shape) != (b, t):
            problems.append(
                f"attention_mask has shape {tuple(inputs['attention_mask'].shape)}, expected {(b, t)}"
            )
        for k in ("hidden_states", "encoder_hidden_states"):
            if inputs[k].dtype != self.dtype:
                problems.append(f"{k} is {inputs[k].dtype}, the compiled transformer is {self.dtype}")
        if problems:
            raise ShapeOutOfRangeError(
                "input outside what this compiled transformer was built for: "
                + "; ".join(problems)
                + f". Built for {self.shapes.describe()}.",
                "widen batch/aspect_bins/text_len in the config, or set on_shape_miss='rebuild'.",
            )

    def _rebuild_for(self, inputs: dict[str, torch.Tensor]) -> None:
        b, _, h, w = inputs["hidden_states"].shape
        t = inputs["encoder_hidden_states"].shape[1]
        s = self.shapes

        def widen(r: tuple[int, int], v: int) -> tuple[int, int]:
            return min(r[0], v), max(r[1], v)

        self.shapes = dataclasses.replace(
            s,
            batch=widen(s.batch, b),
            height=widen(s.height, h),
            width=widen(s.width, w),
            text=widen(s.text, t),
        )
        logger.warning(
            "rebuilding the compiled transformer for %s (on_shape_miss='rebuild')", self.shapes.describe()
        )
        self.backend = make_backend(self.transformer, self.compile_config, self.shapes)
        self._graphs = None
        self.build()

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
        inputs = self._normalise(hidden_states, timestep, encoder_hidden_states, attention_mask)
        try:
            self._check(inputs)
        except ShapeOutOfRangeError:
            if self.compile_config.on_shape_miss != "rebuild":
                raise
            self._rebuild_for(inputs)
        if not self.is_built:
            self.build()  # at the tuning point: sizes 1 would be specialised by torch.export
        with torch.no_grad():
            out = self._graphs(**inputs) if self._graphs is not None else self.backend(**inputs)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)

    # -- weights --------------------------------------------------------------------------------
    def weights_changed(self, names: list[str]) -> dict[str, Any]:
        """Bring the compiled form up to date after these parameters changed in place (refit)."""
        if not self.is_built:
            return {"refit_s": 0.0, "rebuilt": False}
        report = self.backend.weights_changed(names)
        if self._graphs is not None:
            self._graphs.reset()
        return report

    def report(self) -> dict[str, Any]:
        """Engines, PyTorch segments and ops kept in PyTorch, build time, versions."""
        return {
            **self.backend.report(),
            "build_s": self.backend.build_s,
            "backend": self.compile_config.backend,
            "attention": self.compile_config.attention,
            "cuda_graphs": self._graphs is not None,
            "shapes": self.shapes.describe(),
            **self.backend.versions(),
        }

    def extra_repr(self) -> str:
        cfg = self.compile_config
        return f"backend={cfg.backend}, attention={cfg.attention}, {self.shapes.describe()}"


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
        transformer: diffusers' PRXTransformer2DModel (in eval mode, in its final dtype and device).
        config: a ``CompileConfig``, a dict, a YAML path or a preset name from ``configs/``.
        backend: "tensorrt" (default), "inductor" or "eager" — shorthand for ``backend=`` override.
        build: compile now at the tuning point instead of at the first call.
        **overrides: any ``CompileConfig`` key, e.g. ``attention="tensorrt"``, ``batch=[1, 4]``.

    Raises:
        ConfigError: unknown key or bad value; dtype or device mismatch.
        BackendUnavailableError: backend="tensorrt" without Torch-TensorRT or a GPU.
    """
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
        cfg = CompileConfig.resolve(cfg, device=str(device))
    if transformer.training:
        transformer.eval()
    compiled = CompiledTransformer(transformer, cfg)
    return compiled.build() if build else compiled
