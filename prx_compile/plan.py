"""``Plan``: what a compiled module builds, resolved once from the config, the model's spec and the
kernel packages installed here.

    plan = Plan.resolve(config, transformer)
    plan.shape_sets()            # the engine sets the config asks for, as ShapeRanges
    plan.lowering(shapes, choice)  # the lowering settings of one engine set (its measured kernels)
    plan.kept_ops(shapes)        # the ops TensorRT leaves to PyTorch in that set

The config holds what the user asked for ("auto", "unset": the model's default); the plan holds what
that means here: the config with the model's defaults filled in and the kernel candidates the config
and the installed packages allow (``attention_candidates``, ``gate_candidates``), among which each
engine set chooses by measurement (``ops.choice``). The backends, the kernel choice and the
engine cache read the plan; nothing else probes which packages are installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .config import CompileConfig
from .errors import ConfigError
from .lowering import LoweringSettings
from .models import ModelSpec, spec_for
from .ops import cudnn_attention, flash4_attention, registry
from .ops.fp8_attention import TILES
from .shapes import ShapeRange

if TYPE_CHECKING:
    from .ops.choice import KernelChoice

#: the ``CompileConfig`` keys a model's spec may give defaults for
MODEL_DEFAULTS = ("batch", "text_len", "resolution", "vae_scale_factor", "aspect_bins")


@dataclass(frozen=True)
class Plan:
    """See the module docstring. ``config`` is the resolved config (no unset key)."""

    config: CompileConfig
    spec: ModelSpec
    model_config: Any
    #: the attention kernels an engine set chooses among, the unmeasured default first: PRX "fp8/<i>"
    #: (our FP8 kernels in tiling i of ``ops.fp8_attention.TILES``), "flash4", "cudnn", "split";
    #: FLUX (dense) "flash4", "cudnn", "sdpa"
    attention_candidates: tuple[str, ...]
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
        plan = cls(
            config=config,
            spec=spec,
            model_config=model.config,
            attention_candidates=_attention_candidates(config, spec),
            cudnn_frontend=cudnn_attention.installed(),
            gate=spec.gate_width(model) is not None,
        )
        for shapes in plan.shape_sets():  # every planned set is one the model can take
            plan.check_shapes(shapes)
        return plan

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def kernels(self) -> dict[str, Any]:
        """The kernel candidates of this plan (``report()`` before any set is built)."""
        return {
            "attention": list(self.attention_candidates),
            "gelu_gate": [True, False]
            if self.gate
            and self.cudnn_frontend
            and self.config.fuse_mlp_gate
            and self.config.precision != "fp8"
            else [False],
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
        """Whether engine sets over ``shapes`` may run the MLP gate as cuDNN's fused GEMM:
        ``fuse_mlp_gate``, a gated MLP, its linears in PyTorch, cuDNN's frontend installed and not
        ``precision: fp8`` (the set's measurement then decides)."""
        cfg = self.config
        return (
            cfg.fuse_mlp_gate
            and self.gate
            and cfg.precision != "fp8"
            and self.linears_in_torch(shapes)
            and self.cudnn_frontend
        )

    def gate_candidates(self, shapes: ShapeRange | None) -> tuple[bool, ...]:
        """The MLP gate forms engine sets over ``shapes`` choose among, the unmeasured default first."""
        return (True, False) if self.gelu_gate(shapes) else (False,)

    def lowering(
        self, shapes: ShapeRange | None = None, choice: KernelChoice | None = None
    ) -> LoweringSettings:
        """The ``LoweringSettings`` of engines over ``shapes`` (None: a PyTorch backend, which keeps
        ``aten.linear`` for its own compiler) running the kernels ``choice`` names (None: the first
        candidates)."""
        cfg = self.config
        attention = choice.attention if choice is not None else self.attention_candidates[0]
        if attention not in self.attention_candidates:
            raise ConfigError(f"attention kernel {attention!r} is not one of {self.attention_candidates}.")
        gate = choice.gelu_gate if choice is not None else self.gate_candidates(shapes)[0]
        joint = self.spec.attention == "joint"
        return LoweringSettings(
            attention="tensorrt" if cfg.attention == "tensorrt" else "flash",
            select_as_slice=cfg.select_as_slice,
            fp8_mlp=cfg.fp8_mlp,
            fp8_inputs=cfg.fp8_inputs,
            fp8_norm=cfg.fp8_norm,
            fp8_attention=joint and attention.startswith("fp8/"),
            fp8_tile=int(attention[4:]) if joint and attention.startswith("fp8/") else 0,
            padded_attention=attention if joint and attention in ("flash4", "cudnn", "cudnn_fp8") else None,
            dense_attention=attention if not joint else "sdpa",
            gelu_gate=gate and self.gelu_gate(shapes),
            linears_in_torch=self.linears_in_torch(shapes),
            linear_glue=cfg.linear_glue,
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
        config's engine settings, the lowering the plan resolved (where linears run) and the kernel
        candidates (the set's measured choice is kept with its engines)."""
        return {
            **self.config.engine_settings(),
            "lowering": dataclasses.asdict(self.lowering(shapes)),
            "candidates": {
                "attention": list(self.attention_candidates),
                "gelu_gate": list(self.gate_candidates(shapes)),
            },
        }

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


def _attention_candidates(config: CompileConfig, spec: ModelSpec) -> tuple[str, ...]:
    """The attention kernels ``config`` allows here (see ``Plan.attention_candidates``).

    ``attention_kernel``: "auto" takes every installed one-call kernel and the split path (FLUX:
    PyTorch's SDPA, and cuDNN through PyTorch, which needs no extra), "split" the split path only,
    "flash4" or "cudnn" that kernel only (a ConfigError naming the extra where its package is
    missing). With ``precision: fp8`` and fused attention, ``fp8_attention`` true makes our FP8
    kernels (each tiling) the only candidates, "auto" adds them first, false leaves them out."""
    kernel = config.attention_kernel
    packages = {"flash4": flash4_attention.installed, "cudnn": cudnn_attention.installed}
    if spec.attention == "dense":
        packages["cudnn"] = lambda: True  # cuDNN through PyTorch's SDPA: no extra
    if kernel in packages and not packages[kernel]():
        needs = {
            "flash4": "FlashAttention-4 (the flash-attn-4 package)",
            "cudnn": "cuDNN's frontend (the nvidia-cudnn-frontend package)",
        }[kernel]
        raise ConfigError(
            f"attention_kernel={kernel} needs {needs}.",
            f"pip install 'prx_compile[{kernel}]', or use attention_kernel: split.",
        )
    if spec.attention == "dense":
        if kernel == "auto":
            return (*(("flash4",) if flash4_attention.installed() else ()), "cudnn", "sdpa")
        return ("sdpa",) if kernel == "split" else (kernel,)
    if config.attention != "fused":
        return ("split",)  # the attention op of the unfused form runs the split path
    if kernel == "auto":
        bf16 = (*(k for k, installed in packages.items() if installed()), "split")
    else:
        bf16 = (kernel,) if kernel != "split" else ("split",)
    fp8 = (*(f"fp8/{i}" for i in range(len(TILES))), *(("cudnn_fp8",) if cudnn_attention.installed() else ()))
    if config.precision != "fp8" or config.fp8_attention is False:
        return bf16
    return fp8 if config.fp8_attention is True else fp8 + bf16
