"""``CompileConfig``: every knob of ``compile_prx`` in one dataclass, with YAML presets.

A config is built from keyword arguments, a dict, a YAML file or a preset name from ``configs/``.
Unknown keys and bad values raise ``ConfigError`` naming the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError
from .export import ShapeRange

BACKENDS = ("tensorrt", "inductor", "eager")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTENTION = ("flash", "tensorrt")
ON_SHAPE_MISS = ("error", "rebuild")
RUNTIMES = ("python", "cpp")
BIN_FAMILIES = (256, 512, 1024)
#: Settings whose change forces an engine rebuild (everything else is a refit or a runtime switch).
REBUILD_KEYS = (
    "dtype",
    "attention",
    "joint_attention",
    "fused_attention",
    "select_as_slice",
    "batch",
    "resolution",
    "aspect_bins",
    "text_len",
    "vae_scale_factor",
    "static",
    "opt_batch",
    "opt_text_len",
    "optimization_level",
    "runtime",
    "backend",
)

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"


def _aspect_bins(family: int) -> list[tuple[int, int]]:
    from diffusers.pipelines.prx.pipeline_prx import ASPECT_RATIO_BINS

    return [tuple(v) for v in ASPECT_RATIO_BINS[family].values()]


@dataclass
class CompileConfig:
    """How ``compile_prx`` builds and runs the transformer.

    backend: "tensorrt" (Torch-TensorRT MTTM engines), "inductor" (torch.compile of the lowered
        graph) or "eager" (the lowered graph as is). No silent fallback between them.
    dtype: "bf16" | "fp16" | "fp32" — must be the transformer's dtype (None: take the model's).
    attention: "flash" — attention in a flash kernel between TensorRT engines (fast, exact under
        the text mask); "tensorrt" — attention decomposed inside TensorRT (a single engine).
    cuda_graphs: replay the whole transformer step as one CUDA graph per input shape (CUDA only).
    joint_attention: with attention="flash", run PRX's text+image attention as a dense flash kernel
        over image keys plus a small masked kernel over text keys, merged exactly (log-sum-exp).
    fused_attention: with attention="flash", run each PRX attention core (QK RMSNorm, RoPE, joint
        attention) as one ``prx_compile::prx_attention`` op: a Triton pass per operand instead of
        TensorRT's norm/RoPE/layout kernels (see ``prx_compile.fusion``).
    select_as_slice: lower constant-index ``select`` to ``slice`` (avoids TensorRT gather kernels).
    batch: [min, max] transformer batch (guidance doubles the prompt batch).
    resolution: the pixel resolution the engines are tuned for (square), e.g. 1024.
    aspect_bins: PRX aspect-ratio bin families covered, e.g. [512, 1024]; [] = only ``resolution``.
    text_len: [min, max] text tokens. vae_scale_factor: pixels per latent (8 for PRX's VAE).
    static: build for the tuning point only (batch max, resolution², text max).
    opt_batch / opt_text_len: the tuning point (default: the maxima).
    on_shape_miss: "error" (raise, naming the range) or "rebuild" (build again for the wider range).
    runtime: Torch-TensorRT runtime: "python" (live engines, fast partial refit) or "cpp".
    optimization_level: TensorRT builder level 0..5 (None: Torch-TensorRT's default).
    engine_cache_dir: directory of built engines reused across processes (None: no cache).
    device: where the compiled module runs.
    """

    backend: str = "tensorrt"
    dtype: str | None = None
    attention: str = "flash"
    cuda_graphs: bool = True
    joint_attention: bool = True
    fused_attention: bool = True
    select_as_slice: bool = True
    batch: list[int] = field(default_factory=lambda: [1, 2])
    resolution: int = 1024
    aspect_bins: list[int] = field(default_factory=lambda: [1024])
    text_len: list[int] = field(default_factory=lambda: [1, 256])
    vae_scale_factor: int = 8
    static: bool = False
    opt_batch: int | None = None
    opt_text_len: int | None = None
    on_shape_miss: str = "error"
    runtime: str = "python"
    optimization_level: int | None = None
    engine_cache_dir: str | None = None
    device: str = "cuda"

    def __post_init__(self):
        def choice(key, allowed):
            v = getattr(self, key)
            if v not in allowed:
                raise ConfigError(f"{key}={v!r} is not allowed.", f"use one of {list(allowed)}.")

        choice("backend", BACKENDS)
        if self.dtype is not None:
            choice("dtype", DTYPES)
        choice("attention", ATTENTION)
        choice("on_shape_miss", ON_SHAPE_MISS)
        choice("runtime", RUNTIMES)
        for key in ("cuda_graphs", "static", "joint_attention", "fused_attention", "select_as_slice"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r} must be true or false.")
        for key in ("batch", "text_len"):
            v = getattr(self, key)
            if (
                not isinstance(v, (list, tuple))
                or len(v) != 2
                or not all(isinstance(x, int) for x in v)
                or not 1 <= v[0] <= v[1]
            ):
                raise ConfigError(
                    f"{key}={v!r} must be [min, max] with 1 <= min <= max.", f"e.g. {key}: [1, 2]"
                )
            setattr(self, key, list(v))
        for key in ("resolution", "vae_scale_factor"):
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{key}={v!r} must be a positive integer.")
        if self.resolution % self.vae_scale_factor:
            raise ConfigError(
                f"resolution={self.resolution} is not a multiple of vae_scale_factor={self.vae_scale_factor}."
            )
        if not isinstance(self.aspect_bins, (list, tuple)) or any(
            b not in BIN_FAMILIES for b in self.aspect_bins
        ):
            raise ConfigError(
                f"aspect_bins={self.aspect_bins!r}: each entry must be one of {list(BIN_FAMILIES)}.",
                "use [] for the square resolution only.",
            )
        self.aspect_bins = list(self.aspect_bins)
        for key, rng in (("opt_batch", self.batch), ("opt_text_len", self.text_len)):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, int) and rng[0] <= v <= rng[1]):
                raise ConfigError(f"{key}={v!r} must lie in {rng}.")
        if self.optimization_level is not None and self.optimization_level not in range(6):
            raise ConfigError(
                f"optimization_level={self.optimization_level!r} is not allowed.",
                "use an integer 0..5 or null.",
            )

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> CompileConfig:
        """Build from a dict, refusing unknown keys (the message lists the valid ones)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}.")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}.", f"valid keys: {names}.")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> CompileConfig:
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path} does not exist.") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        return cls.from_dict(data, source=str(path))

    @classmethod
    def resolve(
        cls, config: CompileConfig | dict | str | Path | None = None, **overrides: Any
    ) -> CompileConfig:
        """A config from an instance, dict, YAML path or preset name, with ``overrides`` applied."""
        if config is None:
            base = cls()
        elif isinstance(config, CompileConfig):
            base = config
        elif isinstance(config, dict):
            base = cls.from_dict(config)
        elif isinstance(config, (str, Path)):
            p = Path(config)
            if p.suffix in (".yaml", ".yml") or p.exists():
                base = cls.from_yaml(p)
            else:
                base = cls.from_yaml(preset_path(str(config)))
        else:
            raise ConfigError(
                f"config of type {type(config).__name__} is not supported.",
                "pass a CompileConfig, a dict, a YAML path or a preset name.",
            )
        if not overrides:
            return base
        return cls.from_dict({**base.to_dict(), **overrides}, source="overrides")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- derived --------------------------------------------------------------------------------
    def lowering(self):
        """The ``LoweringSettings`` this config asks for."""
        from .lowering import LoweringSettings

        return LoweringSettings(
            attention=self.attention,
            joint_attention=self.joint_attention,
            select_as_slice=self.select_as_slice,
        )

    def fuses_attention(self) -> bool:
        """Whether exports run PRX attention as ``prx_attention`` (``fused_attention`` with flash)."""
        return self.fused_attention and self.attention == "flash"

    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype] if self.dtype else None

    def shape_range(self, patch_size: int = 2) -> ShapeRange:
        """Latent/batch/text ranges implied by the config (in latent pixels)."""
        f = self.vae_scale_factor
        opt = self.resolution // f
        sizes = [(self.resolution, self.resolution)]
        for family in self.aspect_bins:
            sizes += _aspect_bins(family)
        hs = [h // f for h, _ in sizes]
        ws = [w // f for _, w in sizes]
        if self.static:
            b = self.opt_batch or self.batch[1]
            t = self.opt_text_len or self.text_len[1]
            return ShapeRange((b, b), (opt, opt), (opt, opt), (t, t), multiple=patch_size)
        return ShapeRange(
            tuple(self.batch),
            (min(hs), max(hs)),
            (min(ws), max(ws)),
            tuple(self.text_len),
            multiple=patch_size,
            opt_batch=self.opt_batch,
            opt_height=opt,
            opt_width=opt,
            opt_text=self.opt_text_len,
        )

    def rebuild_keys_changed(self, other: CompileConfig) -> list[str]:
        """Keys whose difference from ``other`` forces a rebuild (the rest can be switched live)."""
        a, b = self.to_dict(), other.to_dict()
        return [k for k in REBUILD_KEYS if a[k] != b[k]]


def preset_path(name: str) -> Path:
    """configs/<name>.yaml, or a ConfigError listing the presets there."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.exists():
        have = sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []
        raise ConfigError(
            f"no preset named {name!r} (looked in {PRESET_DIR}).", f"available presets: {have}."
        )
    return path


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []
