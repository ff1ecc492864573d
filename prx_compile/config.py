"""``CompileConfig``: every knob of ``compile_transformer`` in one dataclass, with YAML presets.

A config is built from keyword arguments, a dict, a YAML file or a preset name from ``configs/``
(shipped inside the wheel as ``prx_compile/configs``). Unknown keys and bad values raise
``ConfigError`` naming the key and the allowed values; nothing is silently corrected. A config is
what the user asked for: what it means for one model on this machine (the model's default shapes, the
attention kernels installed) is resolved by ``prx_compile.plan.Plan``. This module imports no stage.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, excerpt, one_line

BACKENDS = ("tensorrt", "inductor", "eager")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTENTION = ("fused", "flash", "tensorrt")
WEIGHTS = ("inputs", "engine")
PRECISIONS = ("dtype", "fp8")
FP8_MASTERS = ("device", "host")
ON_SHAPE_MISS = ("build", "split", "error")
ATTENTION_KERNELS = ("auto", "flash4", "cudnn", "split")
RANGE_LINEARS = ("torch", "tensorrt")
#: The most ``specialize`` entries (each is an engine set of its own).
MAX_SPECIALIZE = 256
#: Torch-TensorRT / MutableTorchTensorRTModule settings and the CompileConfig key that covers each
#: (``optimization_level`` and ``device`` have the same names and are accepted as they are).
MTTM_SETTINGS = {
    "min_block_size": "attention and range_linears (which ops run in PyTorch between engines)",
    "torch_executed_ops": "attention and range_linears (which ops run in PyTorch between engines)",
    "require_full_compilation": "attention='tensorrt' with range_linears='tensorrt' (the fewest PyTorch ops)",
    "use_python_runtime": "cuda_graphs (always the Python runtime, for refit and the runtime cache)",
    "immutable_weights": "weights ('inputs': engines read the parameters; 'engine': refittable engines)",
    "enabled_precisions": "dtype and precision ('fp8' for the block linears)",
    "use_explicit_typing": "dtype and precision (always explicit typing)",
    "truncate_double": "dtype (float64 is always truncated)",
    "timing_cache_path": "engine_cache_dir (built engine sets, reused across processes)",
    "cache_built_engines": "engine_cache_dir (built engine sets, reused across processes)",
    "reuse_cached_engines": "engine_cache_dir (built engine sets, reused across processes)",
    "hardware_compatible": "device (artifacts record their GPU; load_compiled(rebuild=True) on another)",
    "version_compatible": "device (artifacts record their GPU; load_compiled(rebuild=True) on another)",
}

#: Settings an engine depends on (besides the model and its shapes): a change means new engines, and
#: the engine cache and artifacts key on them. Everything else is a runtime switch.
ENGINE_KEYS = (
    "backend",
    "dtype",
    "precision",
    "attention",
    "select_as_slice",
    "fp8_mlp",
    "fp8_inputs",
    "fp8_norm",
    "fp8_attention",
    "attention_kernel",
    "fuse_mlp_gate",
    "linear_glue",
    "share_engines",
    "weights",
    "optimization_level",
    "model",
)

_PACKAGED = Path(__file__).resolve().parent / "configs"  # in a wheel
_CHECKOUT = Path(__file__).resolve().parent.parent / "configs"  # in a source checkout (editable install)
PRESET_DIR = _PACKAGED if _PACKAGED.is_dir() else _CHECKOUT
_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class CompileConfig:
    """How ``compile_transformer`` builds and runs the transformer.

    backend: "tensorrt" (Torch-TensorRT engines), "inductor" (torch.compile of the lowered graph) or
        "eager" (the lowered graph as is). No silent fallback between them.
    dtype: "bf16" | "fp16" | "fp32": must be the transformer's dtype (None: take the model's).
    precision: "dtype": every GEMM in ``dtype``; "fp8": the transformer blocks' linears (attention
        projections and MLP) run FP8 GEMMs (``prx_compile.quant.fp8``: per-output-channel weight scales,
        per-token dynamic activation scales), everything else stays in ``dtype``. It quantises the
        transformer's block linears in place, as torchao's ``quantize_`` does; their exact weights
        stay, so a LoRA re-quantises the layers it changes. Needs ``weights: inputs``.
    fp8_masters: with ``precision: fp8``, where those exact weights (the block linears' ``weight``
        parameters, which the step never reads) are kept: "device" (the default) beside their FP8
        copies; "host", in pinned CPU memory, so the device holds the FP8 copies only (FLUX.1: 5.6
        GB less than eager bf16 instead of 10.2 GB more). A LoRA then merges on the GPU beside the FP8
        copy, re-quantises it there and copies the merged weight into the master (FLUX.1: a switch
        0.75 s instead of 0.13 s, ``flux_v25_fp8_lora_h200.json``; host memory about twice the
        masters' bytes; docs/fp8.md).
    attention: "fused": each PRX attention core (QK RMSNorm, RoPE, joint text+image attention) is one
        ``prx_compile::prx_attention`` op between engines (Triton + cuDNN on the GPU);
        "flash": the lowering rule's ``joint_attention`` op between engines (TensorRT does norm/RoPE);
        "tensorrt": attention decomposed inside TensorRT (fewest engines, slowest attention).
    weights: "inputs": the engines read the transformer's own parameters (one copy of the weights; a
        LoRA is an in-place update, nothing is refit); "engine": weights baked into each engine
        (refit after a LoRA, one copy per engine set).
    cuda_graphs: replay the whole transformer step as one CUDA graph per input shape (CUDA only).
    select_as_slice: lower constant-index ``select`` to ``slice`` (avoids TensorRT gather kernels).
    fp8_mlp: with ``precision: fp8``, run each block's MLP as one ``fp8_gated_mlp`` op (three FP8
        GEMMs, the input quantised once, GELU * up quantised in one pass) instead of three FP8 linears
        with an engine for GELU * up between them.
    fp8_inputs: with ``precision: fp8``, the FP8 linears that read one input quantise it once, and a
        concatenation or tanh GELU that makes it runs in that quantising pass (one ``fp8_linears``
        op; FLUX.1's q/k/v projections, its feed-forward's second linear, its single blocks' output
        projection) instead of a quantisation per linear and an engine writing the bf16 input.
    fp8_norm: with ``precision: fp8``, an FP8 input made by a modulated layer norm (``norm(x) * (1 +
        scale) + shift``: PRX's and FLUX.1's blocks) is made in the quantising pass that reads it,
        instead of by an engine writing it in bf16. Off by default: on an H100 it saved 0.33 ms of
        89.8 (the 7B), and its e4m3 codes differ from torch's composition in about 4 % of places:
        compiled, it behaves as if its multiply and add fused and rounded once where torch rounds
        twice (as exact or more, ``docs/fp8.md``).
    fp8_attention: with ``precision: fp8`` and ``attention: fused``, whether PRX's joint attention may
        run on FP8 tensor cores (``prx_attention_fp8``: Q, K, V and the probabilities in e4m3, one
        scale per block of tokens and head, computed on the device; with the ``cudnn`` extra also
        ``prx_attention_cudnn_fp8``, cuDNN's FP8 SDPA with one scale per tensor): true, FP8 kernels
        only (each engine set measures them and keeps the fastest); false, bf16 only
        (``attention_kernel``); "auto" (the default), both kinds are candidates and each engine set
        keeps the fastest within its error bound (``ops.choice``). At 7B (heads of 128) cuDNN's FP8
        SDPA won (0.633 ms, against 0.701 for the bf16 FlashAttention-4 call and 0.874 for the best
        of our tilings, ``peers_v23_pixel_fp8_h200.json``).
    attention_kernel: with ``attention: fused``, how the bf16 attention runs: "flash4", one
        FlashAttention-4 call per block over a key-padding layout (``prx_attention_flash4``; the
        ``flash4`` extra, ``pip install 'prx_compile[flash4]'``; measured on Hopper, elsewhere it
        runs the cuDNN call); "cudnn", the same layout as one cuDNN call through cuDNN's frontend
        (``prx_attention_cudnn``; the ``cudnn`` extra); "split", a dense cuDNN call over the image
        keys, a masked one over the text keys and an exact merge (PyTorch's SDPA kernels, no
        extra); "auto" (the default), every installed one and "split" are candidates: each engine
        set runs them at its own shape and keeps the fastest (``ops.choice``; ``report()`` shows
        the timings). FLUX's dense attention: "flash4", "cudnn" (cuDNN's fused attention through
        torch, no extra), "split" (PyTorch's SDPA), "auto" all of them installed. All are exact.
    fuse_mlp_gate: where an engine set runs its linears in PyTorch (``static_linears`` /
        ``range_linears: torch``) and cuDNN's frontend is installed (the ``cudnn`` extra), the MLP
        gate ``gelu_tanh(gate_proj(x)) * up_proj(x)`` may run as one cuDNN GEMM with the GELU and the
        product in its epilogue (``gelu_gate``): each engine set times it against a cuBLAS GEMM and
        the product, and keeps the faster. False: never fused. Not with ``precision: fp8``
        (``fp8_mlp`` fuses its MLP).
    linear_glue: where an engine set runs its linears in PyTorch (cuBLAS), a tanh GELU between two
        linears runs in the first GEMM's epilogue (``linear_gelu``, with a bias) and a linear over a
        two-part concatenation runs as two GEMMs over its weight's column blocks (``linear_cat``),
        so neither is written in bf16 between engines (FLUX.1's feed-forward and single blocks).
    range_linears: where the engine sets for a range of shapes run their linears: "torch" (cuBLAS,
        between engines; TensorRT-RTX runs dynamic-shape GEMMs with slower Ampere kernels on
        Hopper) or "tensorrt". Only with ``weights: inputs``; with ``weights: engine`` the engines
        own the weights and keep them.
    static_linears: the same choice for the static engine sets (``specialize``, ``static``):
        "torch" (the default: cuBLAS ran the 1024² b2 step 2.1 ms faster on the H200) or "tensorrt"
        (GEMMs fused with their neighbours in fewer engines).
    share_engines: with ``weights: inputs``, partitions that compute the same thing (the
        transformer blocks) run one engine, built once, with each block's weights bound at its call
        (``backends.tensorrt.repeats``); false builds an engine per partition, as 0.5 did. With
        ``weights: engine`` every engine holds its own block's weights, so none is shared.
    build_workers: how many distinct engines are converted at once (threads, at most the machine's
        cores) while a set is built, with ``share_engines``; 1 converts them one after another.
        The engines are the same either way.
    share_context_memory: the execution contexts of one engine set run on one block of device
        memory, the largest context's size, instead of one block each (they never run at once).
    batch: [min, max] transformer batch (guidance doubles the prompt batch).
    resolution: the square pixel resolution the range is tuned for, e.g. 1024.
    aspect_bins: the model's aspect-ratio bin families the range covers, e.g. [512, 1024] for PRX;
        [] = only ``resolution``.
    text_len: [min, max] text tokens. vae_scale_factor: pixels per latent (8 for PRX's and FLUX's
        VAEs, 1 for PRXPixel, which has none).
        These five, left unset (null), take the model's defaults (``ModelSpec.defaults``; PRX: batch
        [1, 2], 1024 px, bins [1024], text [1, 256], 8; FLUX: batch [1, 1], 1024 px, no bins, text
        [512, 512], 8; PRXPixel: as PRX with vae_scale_factor 1 and its own bins).
    specialize: serving shapes that get engines of their own, as [height, width, batch] in pixels
        (text length: the maximum). None: ``resolution``² at the largest and smallest batch.
        A call picks the most specific engine set that fits.
    static: build only the ``specialize`` shapes, no engine set for the whole range.
    auto_specialize: while the range set is not built, the first this many shapes that a call
        brings inside the range and that ``specialize`` does not name get static sets of their own,
        built at that call (a static set is built in about half the range set's time and runs
        faster); the next new shape builds the range set, which then serves every shape no static
        set takes. 0: the range set is built at the first such shape.
    opt_batch / opt_text_len: the range's tuning point (default: the maxima).
    on_shape_miss: what a shape outside every engine set gets. "split" (the default): where only
        its batch is too large, it runs in batch chunks that the sets take (no build, no memory
        added; a warning once per shape), else as "build"; "build": engines of its own (with a
        warning); "error": raise, naming the ranges.
    optimization_level: TensorRT builder level 0..5 (None: Torch-TensorRT's default).
    engine_cache_dir: directory of built engines reused across processes (None: no cache).
    device: where the compiled module runs ("cuda", "cuda:N" or "cpu").
    model: the model family this config is for ("prx", "flux"; null: any). A preset names its model,
        so a FLUX preset is refused for a PRX transformer with one line, before any work.
    """

    backend: str = "tensorrt"
    dtype: str | None = None
    precision: str = "dtype"
    attention: str = "fused"
    weights: str = "inputs"
    cuda_graphs: bool = True
    select_as_slice: bool = True
    fp8_mlp: bool = True
    fp8_inputs: bool = True
    fp8_norm: bool = False
    fp8_attention: bool | str = "auto"
    fp8_masters: str = "device"
    attention_kernel: str = "auto"
    fuse_mlp_gate: bool = True
    linear_glue: bool = True
    range_linears: str = "torch"
    static_linears: str = "torch"
    share_engines: bool = True
    build_workers: int = 8
    share_context_memory: bool = True
    batch: list[int] | None = None
    resolution: int | None = None
    aspect_bins: list[int] | None = None
    text_len: list[int] | None = None
    vae_scale_factor: int | None = None
    specialize: list[list[int]] | None = None
    static: bool = False
    auto_specialize: int = 2
    opt_batch: int | None = None
    opt_text_len: int | None = None
    on_shape_miss: str = "split"
    optimization_level: int | None = None
    engine_cache_dir: str | None = None
    device: str = "cuda"
    model: str | None = None

    def __post_init__(self):
        def choice(key, allowed):
            v = getattr(self, key)
            if not isinstance(v, str) or v not in allowed:
                raise ConfigError(f"{key}={excerpt(v)} is not allowed.", f"use one of {list(allowed)}.")

        choice("backend", BACKENDS)
        if self.dtype is not None:
            choice("dtype", DTYPES)
        choice("attention", ATTENTION)
        choice("weights", WEIGHTS)
        choice("precision", PRECISIONS)
        if self.precision == "fp8" and self.weights != "inputs":
            raise ConfigError(
                "precision=fp8 needs weights=inputs.",
                "the FP8 weights are engine inputs, re-quantised in place by a LoRA; drop weights: engine.",
            )
        choice("fp8_masters", FP8_MASTERS)
        if self.fp8_masters != "device" and self.precision != "fp8":
            raise ConfigError(
                f"fp8_masters={self.fp8_masters!r} needs precision=fp8 (only FP8 linears keep masters).",
                "set precision: fp8, or drop fp8_masters.",
            )
        choice("on_shape_miss", ON_SHAPE_MISS)
        choice("range_linears", RANGE_LINEARS)
        choice("attention_kernel", ATTENTION_KERNELS)
        choice("static_linears", RANGE_LINEARS)
        bools = (
            "cuda_graphs",
            "static",
            "select_as_slice",
            "fp8_mlp",
            "fp8_inputs",
            "fp8_norm",
            "fuse_mlp_gate",
            "linear_glue",
            "share_engines",
        )
        if not (isinstance(self.fp8_attention, bool) or self.fp8_attention == "auto"):
            raise ConfigError(f"fp8_attention={excerpt(self.fp8_attention)} must be true, false or auto.")
        for key in (*bools, "share_context_memory"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={excerpt(getattr(self, key))} must be true or false.")
        if not _is_int(self.build_workers) or not 1 <= self.build_workers <= 64:
            raise ConfigError(
                f"build_workers={excerpt(self.build_workers)} must be an integer from 1 to 64.",
                "e.g. build_workers: 8 (1 builds one engine at a time)",
            )
        if not _is_int(self.auto_specialize) or not 0 <= self.auto_specialize <= MAX_SPECIALIZE:
            raise ConfigError(
                f"auto_specialize={excerpt(self.auto_specialize)} must be an integer from 0 to "
                f"{MAX_SPECIALIZE}.",
                "e.g. auto_specialize: 2 (0: the range set at the first shape specialize does not name)",
            )
        if self.model is not None and not (
            isinstance(self.model, str) and _PRESET_NAME.fullmatch(self.model)
        ):
            raise ConfigError(f"model={excerpt(self.model)} must be a model name such as 'prx' or 'flux'.")
        for key, top in (("batch", 256), ("text_len", 4096)):  # what an artifact may declare (export)
            v = getattr(self, key)
            if v is None:
                continue
            if (
                not isinstance(v, (list, tuple))
                or len(v) != 2
                or not all(_is_int(x) for x in v)
                or not 1 <= v[0] <= v[1] <= top
            ):
                raise ConfigError(
                    f"{key}={excerpt(v)} must be [min, max] integers with 1 <= min <= max <= {top}.",
                    f"e.g. {key}: [1, 2]",
                )
            setattr(self, key, list(v))
        for key in ("resolution", "vae_scale_factor"):
            v = getattr(self, key)
            if v is not None and (not _is_int(v) or not 0 < v <= 1 << 16):
                raise ConfigError(f"{key}={excerpt(v)} must be a positive integer.")
        if self.resolution is not None and self.vae_scale_factor and self.resolution % self.vae_scale_factor:
            raise ConfigError(
                f"resolution={self.resolution} is not a multiple of vae_scale_factor={self.vae_scale_factor}."
            )
        if self.aspect_bins is not None:
            if (
                not isinstance(self.aspect_bins, (list, tuple))
                or len(self.aspect_bins) > 8
                or any(not _is_int(b) or not 0 < b <= 1 << 16 for b in self.aspect_bins)
            ):
                raise ConfigError(
                    f"aspect_bins={excerpt(self.aspect_bins)} must be a list of bin families, e.g. [1024].",
                    "use [] for the square resolution only.",
                )
            self.aspect_bins = list(self.aspect_bins)
        if self.specialize is not None:
            self.specialize = self._check_specialize(self.specialize)
        if self.static and self.specialize == []:
            raise ConfigError("static=true with specialize=[] leaves no engines to build.")
        for key, rng in (("opt_batch", self.batch), ("opt_text_len", self.text_len)):
            v = getattr(self, key)
            if v is not None and not (_is_int(v) and (rng is None or rng[0] <= v <= rng[1])):
                raise ConfigError(f"{key}={excerpt(v)} must be an integer in {rng}.")
        if self.optimization_level is not None and (
            not _is_int(self.optimization_level) or self.optimization_level not in range(6)
        ):
            raise ConfigError(
                f"optimization_level={excerpt(self.optimization_level)} is not allowed.",
                "use an integer 0..5 or null.",
            )
        if self.engine_cache_dir is not None and (
            not isinstance(self.engine_cache_dir, str)
            or not self.engine_cache_dir
            or "\0" in self.engine_cache_dir
        ):
            raise ConfigError(
                f"engine_cache_dir={excerpt(self.engine_cache_dir)} must be a directory path or null."
            )
        self.device = self._check_device(self.device)

    def _check_specialize(self, shapes: Any) -> list[list[int]]:
        hint = "e.g. specialize: [[1024, 1024, 2], [1024, 1024, 1]] (height, width, batch in pixels)."
        if not isinstance(shapes, (list, tuple)):
            raise ConfigError(f"specialize={excerpt(shapes)} must be a list of [height, width, batch].", hint)
        if len(shapes) > MAX_SPECIALIZE:
            raise ConfigError(
                f"specialize has {len(shapes)} entries, more than {MAX_SPECIALIZE}.",
                "each entry is an engine set of its own (about a minute to build); list the serving shapes.",
            )
        out = []
        for s in shapes:
            if not isinstance(s, (list, tuple)) or len(s) != 3 or not all(_is_int(x) and x > 0 for x in s):
                raise ConfigError(
                    f"specialize entry {excerpt(s)} must be [height, width, batch] integers.", hint
                )
            h, w, b = s
            f = self.vae_scale_factor or 1
            if h % f or w % f or max(h, w) > 1 << 16 or b > 1 << 16:
                raise ConfigError(
                    f"specialize entry {excerpt(list(s))}: height and width must be multiples of "
                    f"vae_scale_factor={f}.",
                    hint,
                )
            if [h, w, b] not in out:
                out.append([h, w, b])
        return out

    @staticmethod
    def _check_device(device: Any) -> str:
        try:
            d = torch.device(device) if isinstance(device, (str, torch.device)) else None
        except (RuntimeError, ValueError):
            d = None
        if d is None or d.type not in ("cuda", "cpu"):
            raise ConfigError(f"device={excerpt(device)} is not a device.", "use 'cuda', 'cuda:N' or 'cpu'.")
        return str(d)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> CompileConfig:
        """Build from a dict, refusing unknown keys (the message lists the valid ones)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}.")
        names = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in names]
        mttm = [k for k in unknown if isinstance(k, str) and k in MTTM_SETTINGS]
        if mttm:
            raise ConfigError(
                f"{source}: {mttm[0]} is a Torch-TensorRT (MTTM) setting, which compile_prx does not take.",
                f"the CompileConfig key that covers it: {MTTM_SETTINGS[mttm[0]]}.",
            )
        if unknown:
            shown = ", ".join(sorted(excerpt(k, 40) for k in unknown[:10]))
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            guesses = {
                k: difflib.get_close_matches(k, names, n=1) for k in unknown[:10] if isinstance(k, str)
            }
            hint = "".join(f" {excerpt(k, 40)}: did you mean {g[0]!r}?" for k, g in guesses.items() if g)
            raise ConfigError(f"{source}: unknown key(s) [{shown}]{more}.{hint}", f"valid keys: {names}.")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> CompileConfig:
        """Read a YAML config (at most ``MAX_YAML_BYTES``, no anchors or aliases, see ``load_yaml``);
        every error names the file."""
        path = Path(path)
        data = load_yaml(path)
        if data is None:  # an empty file is a mistake more often than "all defaults" (1024 px, minutes)
            raise ConfigError(
                f"config file {path} is empty: it sets no key.",
                "set the keys you want (see help(CompileConfig)), or leave the config out for the defaults.",
            )
        try:
            return cls.from_dict(data, source=str(path))
        except ConfigError as e:
            if e.message.startswith(str(path)):
                raise
            raise ConfigError(f"{path}: {e.message}", e.hint) from e

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
            if p.suffix in (".yaml", ".yml") or p.is_file() or p.is_dir():
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

    def replace(self, **changes: Any) -> CompileConfig:
        """A validated copy with ``changes``."""
        return CompileConfig.from_dict({**self.to_dict(), **changes}, source="replace")

    # -- derived --------------------------------------------------------------------------------
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype] if self.dtype else None

    def engine_settings(self) -> dict[str, Any]:
        """The settings engines depend on (``ENGINE_KEYS``; the ``fp8_*`` switches only with
        ``precision: fp8``)."""
        d = self.to_dict()
        return {k: d[k] for k in ENGINE_KEYS if not k.startswith("fp8_") or self.precision == "fp8"}


#: The largest YAML config read (a config is a few hundred bytes; this bounds the parser's time).
MAX_YAML_BYTES = 1 << 16


#: The longest integer a YAML config may spell (digits, signs, "_" and ":" included).
MAX_YAML_INT_CHARS = 32


@functools.lru_cache(maxsize=1)
def _safe_loader():
    """A ``yaml.SafeLoader`` that refuses anchors and aliases and long integers. An alias is a
    reference, and nested ones ("billion laughs") make a 451-byte file a structure of 10**9 items; a
    config never needs one (merge keys ``<<`` then only merge mappings written out in full, which
    expands nothing). A long integer costs quadratic time to build (YAML 1.1's base 60,
    ``1:59:59:...``) or raises a raw ValueError (more than 4300 digits); a long base-60 float
    overflows (OverflowError). A key given twice is refused (YAML's own rule; PyYAML keeps the last)."""
    import yaml

    class NoAliasSafeLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise yaml.composer.ComposerError(
                    None, None, "anchors and aliases (&name, *name) are not allowed", event.start_mark
                )
            return super().compose_node(parent, index)

        def construct_yaml_int(self, node):
            if len(node.value) > MAX_YAML_INT_CHARS:
                raise yaml.constructor.ConstructorError(
                    None, None, f"an integer of {len(node.value)} characters is too long", node.start_mark
                )
            return super().construct_yaml_int(node)

        def construct_mapping(self, node, deep=False):  # a key written twice: refused, not last-wins
            _no_duplicate_keys(node)
            return super().construct_mapping(node, deep)

        def construct_yaml_float(self, node):  # base 60 again: ``1:1:...:1.5`` overflows a float
            if len(node.value) > MAX_YAML_INT_CHARS:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a number of {len(node.value)} characters is too long", node.start_mark
                )
            return super().construct_yaml_float(node)

    NoAliasSafeLoader.add_constructor("tag:yaml.org,2002:int", NoAliasSafeLoader.construct_yaml_int)
    NoAliasSafeLoader.add_constructor("tag:yaml.org,2002:float", NoAliasSafeLoader.construct_yaml_float)
    return NoAliasSafeLoader


def _no_duplicate_keys(node) -> None:
    """A ConstructorError where a mapping node gives one key twice (the same tag and text), in it or
    in a mapping it merges (``<<``), which PyYAML would otherwise resolve silently."""
    import yaml

    if not isinstance(node, yaml.MappingNode):  # "!!map [1]": a mapping tag on another node
        raise yaml.constructor.ConstructorError(
            None, None, f"a {node.id} tagged as a mapping", node.start_mark
        )
    seen = set()
    for key_node, value_node in node.value:
        key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        if key is not None and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {str(key_node.value)[:40]!r} is given twice", key_node.start_mark
            )
        seen.add(key)
        if key_node.tag == "tag:yaml.org,2002:merge":
            merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for sub in merged:
                if isinstance(sub, yaml.MappingNode):
                    _no_duplicate_keys(sub)


def load_yaml(path: Path) -> Any:
    """The YAML document of ``path`` as plain data, read in bounded time and memory: a regular file
    of at most ``MAX_YAML_BYTES``, UTF-8, without anchors or aliases. A ConfigError naming the file
    otherwise."""
    import yaml

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ConfigError(f"config file {path} does not exist.") from e
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise ConfigError(f"config file {path} cannot be read ({type(e).__name__}).") from e
    try:  # examined before it is wrapped: a directory opens, but ``fdopen`` would raise on it
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(
                f"config file {path} is a directory, not a YAML file.",
                f"pass a YAML file or a preset name ({', '.join(list_presets())}).",
            )
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"config file {path} is not a regular file.")
        if st.st_size > MAX_YAML_BYTES:
            raise ConfigError(
                f"config file {path} is {st.st_size} bytes, more than {MAX_YAML_BYTES}.",
                "a config is a few lines of YAML; pass the right file.",
            )
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(MAX_YAML_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read ({type(e).__name__}).") from e
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"config file {path} is more than {MAX_YAML_BYTES} bytes.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}).") from e
    try:
        return yaml.load(text, Loader=_safe_loader())  # noqa: S506 - a SafeLoader subclass
    # PyYAML's own constructors raise these on a bad scalar (a date 2001-13-45, "!!int abc", "!!bool x")
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise ConfigError(f"{path} is not valid YAML: {type(e).__name__}: {one_line(e)}") from e


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``, or a ConfigError listing the presets."""
    if not _PRESET_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{excerpt(name)} is neither a YAML file nor a preset name.",
            f"available presets: {list_presets()}; a file must end in .yaml.",
        )
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no preset named {excerpt(name)}.", f"available presets: {list_presets()}.")
    return path


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []
