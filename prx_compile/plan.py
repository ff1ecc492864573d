"""``Plan``: what a compiled module builds, resolved once from the config, the model's spec and the
kernel packages installed here.

    plan = Plan.resolve(config, transformer)
    plan.shape_sets()            # the engine sets the config asks for, as ShapeRanges
    plan.lowering(shapes)        # the lowering settings of one engine set
    plan.kept_ops(shapes)        # the ops TensorRT leaves to PyTorch in that set

The config holds what the user asked for ("auto", "unset": the model's default); the plan holds what
that means here: the config with the model's defaults filled in, the attention kernels the installed
packages allow, whether the joint attention runs in FP8. The backends, the warm-up and the engine
cache read the plan; nothing else probes which packages are installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .config import CompileConfig
from .errors import ConfigError
from .lowering import LoweringSettings
from .models import ModelSpec, spec_for
from .ops import cudnn_attention, flash4_attention, registry
from .shapes import ShapeRange

#: the ``CompileConfig`` keys a model's spec may give defaults for
MODEL_DEFAULTS = ("batch", "text_len", "resolution", "vae_scale_factor", "aspect_bins")

#: the widest head ``fp8_attention: auto`` runs on FP8: at head dimension 128 (PRXPixel) our FP8
#: attention took 1.35-1.42 ms where the bf16 split attention took 0.77-0.94 ms (H200, 24 heads,
#: 1024² and 832x1216 batch 2; benchmarks/results/attention_kernels_hd128_h200.json)
FP8_ATTENTION_AUTO_MAX_HEAD_DIM = 64


@dataclass(frozen=True)
class Plan:
    """See the module docstring. ``config`` is the resolved config (no unset key)."""

    config: CompileConfig
    spec: ModelSpec
    model_config: Any
    padded_attention: str | None  # the one-call joint attention (PRX): "flash4", "cudnn" or None
    dense_attention: str  # the dense attention's kernel (FLUX): "flash4", "cudnn" or "sdpa"
    fp8_attention: bool
    cudnn_frontend: bool  # cuDNN's frontend is installed (the MLP gate's fused GEMM)
    gate: bool  # the model has a gated MLP the gelu_gate rule fuses

    @classmethod
    def resolve(cls, config: CompileConfig, model: torch.nn.Module, spec: ModelSpec | None = None) -> Plan:
        """The plan of ``config`` for ``model`` (ConfigError for what this model or machine cannot do)."""
        spec = spec or spec_for(model)
        if config.model is not None and config.model != spec.name:
            raise ConfigError(
                f"this config is for model {config.model!r} and the transformer is a {spec.class_name} "
                f"({spec.name!r}).",
                f"use a {spec.name} preset or config, or drop its model key.",
            )
        defaults = spec.defaults_for(model.config)
        filled = {k: defaults[k] for k in MODEL_DEFAULTS if getattr(config, k) is None and k in defaults}
        config = config.replace(**filled, model=spec.name) if filled or config.model is None else config
        for family in config.aspect_bins:
            spec.aspect_sizes(family, model.config)  # a ConfigError naming the families it has
        padded = _one_call_attention(config)
        fp8_attention = False
        if config.precision == "fp8" and config.attention == "fused":
            if config.fp8_attention == "auto":
                narrow = spec.attention_dims(model)[1] <= FP8_ATTENTION_AUTO_MAX_HEAD_DIM
                fp8_attention = padded != "flash4" and narrow
            else:
                fp8_attention = bool(config.fp8_attention)
        dense = {"flash4": "flash4", "cudnn": "cudnn", None: "cudnn"}[padded]
        if config.attention_kernel == "split":
            dense = "sdpa"
        plan = cls(
            config=config,
            spec=spec,
            model_config=model.config,
            padded_attention=padded,
            dense_attention=dense,
            fp8_attention=fp8_attention,
            cudnn_frontend=cudnn_attention.installed(),
            gate=spec.gate_width(model) is not None,
        )
        for shapes in plan.shape_sets():  # every planned set is one the model can take
            plan.check_shapes(shapes)
        return plan

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def kernels(self) -> dict[str, Any]:
        """The kernels this plan chose (``report()``)."""
        if self.spec.attention == "dense":
            return {"attention": self.dense_attention}
        return {
            "attention": "fp8" if self.fp8_attention else (self.padded_attention or "split"),
            "gelu_gate": self.cudnn_frontend
            and self.gate
            and self.config.fuse_mlp_gate
            and self.config.precision != "fp8",
        }

    # -- per engine set --------------------------------------------------------------------------
    def linears_in_torch(self, shapes: ShapeRange | None) -> bool:
        """Whether TensorRT engines over ``shapes`` leave their linears to PyTorch (``range_linears``
        for a range set, ``static_linears`` for a static one)."""
        cfg = self.config
        if cfg.backend != "tensorrt" or shapes is None or cfg.weights != "inputs":
            return False
        return (cfg.static_linears if shapes.is_static() else cfg.range_linears) == "torch"

    def gelu_gate(self, shapes: ShapeRange | None) -> bool:
        """Whether engine sets over ``shapes`` run the MLP gate as cuDNN's fused GEMM: ``fuse_mlp_gate``,
        a gated MLP, its linears in PyTorch, cuDNN's frontend installed and not ``precision: fp8``."""
        cfg = self.config
        return (
            cfg.fuse_mlp_gate
            and self.gate
            and cfg.precision != "fp8"
            and self.linears_in_torch(shapes)
            and self.cudnn_frontend
        )

    def lowering(self, shapes: ShapeRange | None = None) -> LoweringSettings:
        """The ``LoweringSettings`` of TensorRT engines over ``shapes`` (None: for a PyTorch backend,
        which keeps ``aten.linear`` for its own compiler)."""
        cfg = self.config
        return LoweringSettings(
            attention="tensorrt" if cfg.attention == "tensorrt" else "flash",
            select_as_slice=cfg.select_as_slice,
            fp8_mlp=cfg.fp8_mlp,
            fp8_attention=self.fp8_attention,
            padded_attention=self.padded_attention if cfg.attention == "fused" else None,
            dense_attention=self.dense_attention,
            gelu_gate=self.gelu_gate(shapes),
            linears_in_torch=self.linears_in_torch(shapes),
        )

    def kept_ops(self, shapes: ShapeRange) -> set:
        """The ops TensorRT leaves to PyTorch in engine sets over ``shapes`` (``ops.registry`` roles)."""
        roles = set()
        if self.config.attention != "tensorrt":
            roles.add("attention")
        if self.config.precision == "fp8":
            roles.add("fp8")
        if self.linears_in_torch(shapes):
            roles.add("linear")
        return registry.kept(roles)

    def engine_key(self, shapes: ShapeRange) -> dict[str, Any]:
        """What the engines of a set over ``shapes`` depend on besides the model and its shapes: the
        config's engine settings and the lowering the plan resolved (the kernels, where linears run)."""
        return {**self.config.engine_settings(), "lowering": dataclasses.asdict(self.lowering(shapes))}

    # -- shapes ----------------------------------------------------------------------------------
    def static(self, batch: int, height: int, width: int, text: int) -> ShapeRange:
        """The static ``ShapeRange`` of one step point (the spec's units)."""
        m = self.spec.multiple(self.model_config)
        return ShapeRange.static(batch, height, width, text, multiple=m, tokens=self.spec.tokens)

    def check_shapes(self, shapes: ShapeRange) -> None:
        """ConfigError unless the model can take every point of ``shapes``."""
        m = self.spec.multiple(self.model_config)
        odd = [k for k in ("height", "width") if any(v % m for v in getattr(shapes, k))]
        if odd and not self.spec.tokens:
            px = m * self.config.vae_scale_factor
            raise ConfigError(
                f"engine set {shapes.describe()}: latent sizes must be multiples of the patch size {m}.",
                f"use pixel sizes that are multiples of {px}.",
            )

    def range_shapes(self) -> ShapeRange:
        """The whole range (every aspect bin, batch and text length), in the spec's units."""
        cfg, spec = self.config, self.spec
        sizes = [(cfg.resolution, cfg.resolution)]
        for family in cfg.aspect_bins:
            sizes += spec.aspect_sizes(family, self.model_config)
        points = [spec.point_of_pixels(h, w, cfg.vae_scale_factor, self.model_config) for h, w in sizes]
        opt = spec.point_of_pixels(cfg.resolution, cfg.resolution, cfg.vae_scale_factor, self.model_config)
        hs, ws = [p[0] for p in points], [p[1] for p in points]
        return ShapeRange(
            tuple(cfg.batch),
            (min(hs), max(hs)),
            (min(ws), max(ws)),
            tuple(cfg.text_len),
            multiple=spec.multiple(self.model_config),
            opt_batch=cfg.opt_batch,
            opt_height=opt[0],
            opt_width=opt[1],
            opt_text=cfg.opt_text_len,
            tokens=spec.tokens,
        )

    def specialized_shapes(self) -> list[ShapeRange]:
        """One static ``ShapeRange`` per ``specialize`` entry (default: resolution² at max and min batch)."""
        cfg = self.config
        r, t = cfg.resolution, cfg.opt_text_len or cfg.text_len[1]
        entries = cfg.specialize
        if entries is None:
            entries = [[r, r, cfg.opt_batch or cfg.batch[1]]]
            if [r, r, cfg.batch[0]] not in entries:
                entries.append([r, r, cfg.batch[0]])
        out = []
        for h, w, b in entries:
            shapes = self.static(
                b, *self.spec.point_of_pixels(h, w, cfg.vae_scale_factor, self.model_config), t
            )
            if shapes not in out:  # two pixel sizes of one token count are one FLUX set
                out.append(shapes)
        return out

    def shape_sets(self) -> list[ShapeRange]:
        """Every engine set this config plans: the specialised shapes first, then the range."""
        sets = self.specialized_shapes()
        if not self.config.static:
            sets.append(self.range_shapes())
        return sets


def _one_call_attention(config: CompileConfig) -> str | None:
    """The one-call attention ``attention_kernel`` asks for: "flash4", "cudnn" or None (the split
    path). "auto" takes the first whose package is installed; "flash4" or "cudnn" without its package
    is a ConfigError that names the extra."""
    if config.attention_kernel == "split":
        return None
    packages = {"flash4": flash4_attention.installed, "cudnn": cudnn_attention.installed}
    if config.attention_kernel == "auto":
        return next((kind for kind, installed in packages.items() if installed()), None)
    if packages[config.attention_kernel]():
        return config.attention_kernel
    needs = {
        "flash4": "FlashAttention-4 (the flash-attn-4 package)",
        "cudnn": "cuDNN's frontend (the nvidia-cudnn-frontend package)",
    }[config.attention_kernel]
    raise ConfigError(
        f"attention_kernel={config.attention_kernel} needs {needs}.",
        f"pip install 'prx_compile[{config.attention_kernel}]', or use attention_kernel: split.",
    )
