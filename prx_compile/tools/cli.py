"""The ``prx-compile`` command (also ``python -m prx_compile``): demo, build, generate, bench, inspect.

``--model`` picks the family: ``prx`` (the default), ``prx-pixel`` (PRXPixel: the same class in pixel
space, its own pipeline) or ``flux`` (FLUX.1).

Every subcommand has ``--help`` with defaults. Long steps report progress on stderr unless ``--quiet``
(bars in a terminal, one line per finished step in a log). A user error prints one line with a hint
and exits with 2; anything unexpected prints one line and exits with 1; ``--debug`` shows the
traceback instead. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import stat
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import PRXCompileError, excerpt, one_line

EXIT_USAGE, EXIT_ERROR = 2, 1
LORA_HELP = (
    "a LoRA file (diffusers'/PEFT's or kohya's .safetensors, or a PEFT folder), active at SCALE "
    "(default 1.0); repeatable: all active, mixed"
)
#: The largest integer argument (--steps, --height, ...): larger ones are typing errors.
MAX_INT_ARG = 1 << 31
#: The longest error line printed (an offending value is shown as a bounded ``excerpt``; this is
#: the last bound, whatever a message holds).
MAX_ERROR_CHARS = 1000
DTYPES = ("bf16", "fp16", "fp32")
#: The tiny demo models' engine sets: their VAE is 1x (PRXPixel has none); the text is 16 tokens (8 for
#: FLUX, whose pipeline pads to max_sequence_length).
TINY = {
    "prx": dict(
        batch=[1, 2],
        text_len=[1, 16],
        resolution=32,
        aspect_bins=[],
        vae_scale_factor=1,
        specialize=[[32, 32, 2]],
    ),
    "prx-pixel": dict(
        batch=[1, 2],
        text_len=[1, 16],
        resolution=64,
        aspect_bins=[],
        vae_scale_factor=1,
        specialize=[[64, 64, 2]],
    ),
    "flux": dict(
        batch=[1, 1],
        text_len=[8, 8],
        resolution=32,
        aspect_bins=[],
        vae_scale_factor=1,
        specialize=[[32, 32, 1]],
    ),
}
#: --model -> the spec's name, the tiny and the full-size random configs (constructor arguments)
MODELS = ("prx", "prx-pixel", "flux")
#: the largest image a command takes, per side in pixels, and the most image tokens one step may have
#: (checked before anything is loaded; a 2048² PRX step at batch 2 has 32768)
MAX_PIXELS = 8192
MAX_STEP_TOKENS = 1 << 17


class CLIError(PRXCompileError):
    """A bad argument or a missing file, reported as one line."""


# -- helpers -----------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _device() -> str:
    return "cuda" if _cuda() else "cpu"


def _backend(args) -> str:
    """--backend, else tensorrt on a GPU, eager otherwise (as the help says)."""
    return args.backend or ("tensorrt" if _cuda() else "eager")


def _torch_dtype(args, config=None):
    """--dtype, else the config's dtype, else bf16 on a GPU and fp32 on a CPU."""
    import torch

    name = getattr(args, "dtype", None) or (config.dtype if config is not None else None)
    name = name or ("bf16" if _cuda() else "fp32")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _config(args, backend: str, device: str | None = None):
    """The CompileConfig of --config (or the tiny model's defaults) with --backend and the device
    (``device``, else cuda when there is a GPU)."""
    from ..config import CompileConfig

    overrides = {"backend": backend, "device": _device() if backend == "tensorrt" else "cpu"}
    if backend != "tensorrt" and _cuda():
        overrides["device"] = "cuda"
    if device is not None:
        overrides["device"] = device
    if getattr(args, "attention", None):
        overrides["attention"] = args.attention
    if getattr(args, "weights", None):
        overrides["weights"] = args.weights
    if getattr(args, "precision", None):
        overrides["precision"] = args.precision
    if getattr(args, "fp8_masters", None):
        overrides["fp8_masters"] = args.fp8_masters
    tiny = not getattr(args, "checkpoint", None) and not getattr(args, "random_full", False)
    base = args.config if args.config is not None else (TINY[args.model] if tiny else None)
    return CompileConfig.resolve(base, **overrides)


def _family(args) -> str:
    return {"prx-pixel": "prx"}.get(args.model, args.model)


def _check_size(args, config) -> None:
    """--height/--width: at most MAX_PIXELS, multiples of what the model takes, and a step of at most
    MAX_STEP_TOKENS image tokens; one line before anything is loaded."""
    h, w = getattr(args, "height", None), getattr(args, "width", None)
    if h is None and w is None:
        return
    f = config.vae_scale_factor or 1
    if args.checkpoint:  # its patch size is in a file read later: the pipeline checks the rest
        multiple = f
    elif args.model == "flux":
        multiple = 2 * f  # latents packed 2x2
    else:
        from types import SimpleNamespace

        from ..models import SPECS

        spec = SPECS[_family(args)]
        model = (
            _full_config(args) if getattr(args, "random_full", False) else _tiny_config(args)
        ) or spec.tiny
        multiple = spec.multiple(SimpleNamespace(**{**spec.constructor_defaults(), **model})) * f
    h, w = h or w, w or h
    for name, v in (("--height", h), ("--width", w)):
        if v > MAX_PIXELS or v % multiple:
            raise CLIError(
                f"{name} {v}: must be a multiple of {multiple} pixels and at most {MAX_PIXELS}.",
                f"e.g. {name} {multiple * 16}.",
            )
    tokens = (h // multiple) * (w // multiple)
    if tokens > MAX_STEP_TOKENS:
        raise CLIError(
            f"{h}x{w} pixels is {tokens} image tokens a step, more than {MAX_STEP_TOKENS}.",
            "choose a smaller image.",
        )


def _full_config(args) -> dict:
    from ..models.flux import DEV
    from .testing import FULL_PRX, PIXEL_PRX

    return {"prx": FULL_PRX, "prx-pixel": PIXEL_PRX, "flux": DEV}[args.model]


def _tiny_config(args) -> dict | None:
    from .testing import TINY_PIXEL_PRX

    return {"prx": None, "prx-pixel": TINY_PIXEL_PRX, "flux": None}[args.model]


def _transformer(args, config):
    """The transformer to compile: --checkpoint's, the full-size random one of --model, or the tiny one."""
    from ..models import SPECS

    dtype = _torch_dtype(args, config)
    spec = SPECS[_family(args)]
    if args.checkpoint:
        sub = Path(args.checkpoint) / "transformer"
        if not (sub / "config.json").is_file():
            raise CLIError(
                f"{sub} has no config.json: not a diffusers pipeline folder.",
                "pass the folder that holds transformer/config.json, or --tiny.",
            )
        model = spec.model_class().from_pretrained(
            str(sub), torch_dtype=dtype, local_files_only=True, use_safetensors=True
        )
        return model.to(config.device)
    from .testing import make_model

    full = getattr(args, "random_full", False)
    return make_model(
        _family(args), _full_config(args) if full else _tiny_config(args), dtype=dtype, device=config.device
    )


def _pipeline(args, config, dtype):
    """The pipeline of --model in ``dtype``: from --checkpoint; with --random-full the full-size random
    transformer with small random text encoders (and an 8x VAE where the model has one); else the tiny
    random one, with the VAE scale the config plans (1x for the tiny configs, a preset's 8x)."""
    from . import testing

    model = args.model
    if args.checkpoint:
        from .pipeline import load_pipeline

        pipe = load_pipeline(args.checkpoint, torch_dtype=dtype)
    elif getattr(args, "random_full", False):
        transformer = testing.make_model(_family(args), _full_config(args), dtype=dtype, device=config.device)
        make = {"prx": testing.tiny_pipeline, "prx-pixel": testing.tiny_pixel_pipeline}.get(model)
        if model == "flux":
            pipe = testing.tiny_flux_pipeline(transformer, text_len=512, vae_scale=8)
        elif model == "prx":
            pipe = make(transformer, text_len=256, vae_scale=8)
        else:
            pipe = make(transformer, text_len=256)
        pipe = pipe.to(dtype=dtype)
    else:  # a VAE and text as the config plans them (a preset's 8x VAE: its image sizes)
        from ..models import SPECS

        defaults = SPECS[_family(args)].defaults
        f = config.vae_scale_factor or defaults["vae_scale_factor"]
        text = (config.text_len or defaults["text_len"])[1]
        if model == "flux":
            pipe = testing.tiny_flux_pipeline(text_len=text, vae_scale=f)
        elif model == "prx":
            pipe = testing.tiny_pipeline(vae_scale=f)
        else:
            pipe = testing.tiny_pixel_pipeline()
        pipe = pipe.to(dtype=dtype)
    pipe.to(config.device)
    return pipe


def _summary_line(ct) -> str:
    rep = ct.report()
    sets = len(ct.backends)
    return (
        f"backend {rep['backend']}, attention {rep['attention']}, weights {rep['weights']}, "
        f"precision {rep['precision']}, "
        f"{sets} engine set(s), {rep['engines']} engine(s) and {rep['torch_segments']} PyTorch segment(s) "
        f"per set, kept in PyTorch {rep['torch_ops'] or '{}'}"
    )


# -- subcommands -------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    """Tiny non-degenerate PRX: what the pipeline rewrites, the error against eager, warm timings."""
    import torch

    from .. import compile_prx
    from ..export import example_inputs, export_step
    from .bench import max_abs_err, rel_err, time_cuda
    from .testing import make_prx

    backend = _backend(args)
    device = _device() if backend == "tensorrt" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make_prx(patchify=args.patchify, device=device, dtype=dtype)
    cfg = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)
    ct = compile_prx(
        model,
        backend=backend,
        attention=args.attention,
        device=device,
        static=True,
        **cfg,
        specialize=[[16, 16, 2]],
    )
    kw = example_inputs(model, 2, 16, 16, 16, masked_tokens=5, dtype=dtype, device=device)
    out = ct(**kw, return_dict=False)[0]  # builds
    print(
        f"prx-compile demo: tiny PRX ({len(model.blocks)} blocks, {ct.spec.width(model)} wide), "
        f"patchify={args.patchify}, {_summary_line(ct)}, on {device} ({str(dtype).split('.')[-1]})"
    )
    plain, _ = export_step(model, kw)
    before = Counter(str(n.target) for n in plain.graph.nodes if n.op == "call_function")
    if backend == "tensorrt":
        after = Counter(ct.report()["torch_ops"])
        print("ops kept in PyTorch between the TensorRT engines:")
        for op, n in sorted(after.items()):
            print(f"  {op:45s} {n:3d}")
    else:
        graph = ct.backends[0].graph_module.graph
        after = Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
        print("rewritten by compile_prx (plain export -> what runs):")
        for op in sorted(set(before) | set(after)):
            if before[op] != after[op] and any(k in op for k in ("attention", "im2col", "col2im", "select")):
                print(f"  {op:45s} {before[op]:3d} -> {after[op]:3d}")
    print(f"error against eager ({str(dtype).split('.')[-1]}):")
    for masked, label in ((0, "no text token hidden"), (5, "5 of 16 hidden"), (16, "all 16 hidden")):
        kw = example_inputs(
            model, 2, 16, 16, 16, masked_tokens=masked, seed=masked, dtype=dtype, device=device
        )
        with torch.no_grad():
            ref = model(**kw, return_dict=False)[0]
        out = ct(**kw, return_dict=False)[0]
        print(f"  {label:22s} max abs {max_abs_err(out, ref):.2e}   rel L2 {rel_err(out, ref):.2e}")

    def eager_step():
        with torch.no_grad():
            return model(**kw, return_dict=False)

    t_eager = time_cuda(eager_step, warmup=3, iters=20)
    t_comp = time_cuda(lambda: ct(**kw, return_dict=False), warmup=3, iters=20)

    def show(t):
        return f"{t['ms']:.2f} ms (min {t['min']:.2f}, max {t['max']:.2f})"

    print(
        f"warm step time on {device} (median of 20 after 3 warm-up calls): eager {show(t_eager)}, "
        f"compiled ({backend}) {show(t_comp)}"
        + (
            "  [a tiny model on a CPU: Python overheads, not a speed result; the ratio varies run to run]"
            if device == "cpu"
            else ""
        )
    )
    return 0


def cmd_build(args) -> int:
    """Compile the transformer of --model and write an artifact (weights, engine sets, manifest)."""
    from .. import compile_transformer, save_compiled
    from ..io.artifact import check_target

    check_target(Path(args.out), "artifact")  # before minutes of building: is the output usable?
    backend = _backend(args)
    config = _config(args, backend)
    model = _transformer(args, config)
    t0 = time.perf_counter()
    _lora_record(args.lora)  # a missing file: one line, before minutes of building
    ct = compile_transformer(model, config=config)
    _apply_loras(ct, args.lora)  # saved with the artifact, active
    ct.build()
    path = save_compiled(ct, args.out)
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    print(f"wrote {path} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s: {_summary_line(ct)}")
    from ..io.saving import artifact_digest

    print(f"  digest: {artifact_digest(path)}  (publish it; load with --digest or digest=)")
    for b in ct.backends:
        print(f"  engine set: {b.shapes.describe()}")
    return 0


#: The largest prompts file read (a million prompts of 60 characters is 60 MB).
MAX_PROMPTS_BYTES = 256 << 20


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a UTF-8 text file, one a line: split on "\\n" (and "\\r\\n") alone, not
    ``str.splitlines()``, so a form feed, \\x1c, \\x85 or U+2028 inside a line stays inside its
    prompt and every later image keeps its index; blank lines are skipped, ends stripped."""
    f = Path(path)
    if not f.is_file():
        what = "is not a regular file" if os.path.lexists(f) else "does not exist"  # a FIFO, a device
        raise CLIError(f"prompts file {f} {what}.")
    if f.stat().st_size > MAX_PROMPTS_BYTES:
        raise CLIError(f"prompts file {f} is more than {MAX_PROMPTS_BYTES >> 20} MiB.")
    try:
        text = f.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        bad = excerpt(e.object[e.start : e.start + 4])
        raise CLIError(
            f"prompts file {f} is not UTF-8 text (byte {e.start}: {bad}).", "save it as UTF-8."
        ) from e
    except OSError as e:
        raise CLIError(f"prompts file {f} cannot be read ({e.strerror}).") from e
    lines = (line[:-1] if line.endswith("\r") else line for line in text.split("\n"))
    return [line.strip() for line in lines if line.strip()]


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        raise CLIError("no prompt given.", "pass --prompt TEXT (repeatable) or --prompts-file FILE.")
    return prompts


def _check_outputs(out_dir: Path, summary: str | None) -> None:
    """CLIError unless the PNG folder and the summary file can be written (checked before any work)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CLIError(f"--out-dir {out_dir} exists and is not a directory.", "choose another --out-dir.")
    if summary is not None:
        path = Path(summary)
        if path.is_dir():
            raise CLIError(f"--summary {path} is a directory.", "name a file, e.g. --summary run.json.")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise CLIError(f"--summary {path}: {parent} is not a directory.", "choose another --summary.")
    from .generate import is_summary

    path = Path(summary) if summary is not None else out_dir / "summary.json"
    if path.is_file() and not is_summary(path):  # an earlier run's summary is replaced, nothing else
        raise CLIError(
            f"{path} exists and is not a generate summary: the run would overwrite it.",
            "move it, or choose another --summary / --out-dir.",
        )
    folder = next((p for p in path.parents if p.is_dir()), None)
    try:  # a file made and removed where the summary goes: found now, not after the images
        fd, probe = tempfile.mkstemp(prefix=".prx-compile-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CLIError(f"the summary {path} cannot be written in {folder} ({e.strerror}).") from e


def _binning(args) -> bool:
    """Resolution binning (PRXPipeline's default) for a real checkpoint, unless --no-binning."""
    return bool(args.checkpoint) and args.binning


def _warm_up(pipe, height: int, width: int, guidance: float, binning: bool) -> None:
    """Build (or load from the engine cache) the engine set these images run on and, on a GPU, run it
    once (CUDA graph capture, first-call kernel set-up), so that generation starts warm."""
    import torch

    from ..export import example_inputs

    if binning:  # the pipeline maps the size to its closest aspect bin first
        bins = pipe.transformer.spec.aspect_sizes(pipe.default_sample_size, pipe.transformer.config)
        ratios = {str(round(h / w, 2)): [h, w] for h, w in bins}
        binned = pipe.image_processor.classify_height_width_bin(height, width, ratios=ratios)
        if binned != (height, width):  # never a silent jump to another size (and engine set)
            print(
                f"prx-compile: resolution binning makes {height}x{width} images at {binned[0]}x{binned[1]}, "
                f"the nearest of the pipeline's {pipe.default_sample_size}-px aspect bins; "
                f"--no-binning keeps {height}x{width}.",
                file=sys.stderr,
                flush=True,
            )
        height, width = binned
    ct = pipe.transformer
    spec, f = ct.spec, pipe.vae_scale_factor
    if spec.name == "flux":  # no guidance batch; the text is padded to max_sequence_length
        batch, text = 1, ct.compile_config.text_len[1]
    else:
        batch, text = (2 if guidance > 1 else 1), _text_tokens(pipe)
    h, w = spec.point_of_pixels(height, width, f, ct.config)
    kw = example_inputs(ct.transformer, batch, h, w, text, dtype=ct.dtype, device=ct.device)
    ct.build(kw)
    if ct.device.type == "cuda":
        with torch.no_grad():
            ct(**kw, return_dict=False)
        torch.cuda.synchronize(ct.device)


def _text_tokens(pipe) -> int:
    """The text tokens a PRX pipeline passes: PRXPixel pads to ``prompt_max_tokens``, PRX to its
    tokenizer's length."""
    return getattr(pipe.config, "prompt_max_tokens", None) or pipe.tokenizer.model_max_length


def _settings(model) -> str:
    """A model's constructor settings, comparable (lists and tuples alike)."""
    return json.dumps({k: v for k, v in dict(model.config).items() if not k.startswith("_")}, sort_keys=True)


def _pipeline_factory(args):
    """``factory(device) -> PRXPipeline`` for generate_images: the model of the arguments, compiled
    (or --artifact's) for ``device``, its engine set for the images' shape built and warm. Several
    processes share one engine cache: the config's engine_cache_dir, else $PRX_COMPILE_CACHE, else
    (only in a run of several processes) ~/.cache/prx_compile/engines."""

    def factory(device):
        from accelerate import PartialState

        from .. import compile_transformer, load_compiled
        from .generate import CACHE_ENV, default_engine_cache, default_size

        backend = _backend(args)
        config = _config(args, backend, device=str(device))
        several = PartialState().num_processes > 1  # generate_images has set it up
        if not args.artifact and config.engine_cache_dir is None and (several or os.environ.get(CACHE_ENV)):
            config = config.replace(engine_cache_dir=default_engine_cache())
        loaded = None
        if args.artifact:  # the pipeline takes the artifact's dtype
            loaded = load_compiled(
                args.artifact, device=config.device, backend=args.backend, digest=args.digest
            )
        if loaded is None:
            pipe = _pipeline(args, config, _torch_dtype(args, config))
        else:  # the artifact's VAE scale and text length
            pipe = _pipeline(args, loaded.compile_config, loaded.dtype)
        if loaded is not None:
            if type(loaded.transformer) is not type(pipe.transformer) or _settings(loaded) != _settings(
                pipe.transformer
            ):
                raise CLIError(
                    f"the artifact's transformer ({loaded.spec.name}) does not fit this pipeline "
                    f"(--model {args.model}: another class, or another configuration)."
                )
            pipe.transformer = loaded
        elif not args.no_compile:
            pipe.transformer = compile_transformer(pipe.transformer, config=config)
        _apply_loras(pipe, args.lora)
        if not args.no_compile:
            size = default_size(pipe)
            height, width = args.height or size[0], args.width or size[1]
            _warm_up(pipe, height, width, args.guidance, binning=_binning(args))
        return pipe

    return factory


def _flux_text(args) -> int:
    """The text length FLUX pads every prompt to: the artifact's sets' (--artifact), else the config's."""
    if args.artifact:
        from ..io.saving import inspect_artifact

        t = inspect_artifact(args.artifact, verify=False).get("text_len")  # load_compiled checks the rest
        if isinstance(t, list) and len(t) == 2 and all(type(v) is int and 0 < v <= 1 << 16 for v in t):
            return t[1]
    return _config(args, _backend(args)).text_len[1]


def cmd_generate(args) -> int:
    """Prompts to PNG files, with a compiled transformer (fresh, or loaded from --artifact), in this
    process or, split by prompt index, in --num-processes processes (or under accelerate launch)."""
    from .generate import RUN_ENV, check_job, format_summary, generate_images, launch, made_record

    prompts = check_job(_prompts(args), args.steps, args.seed)  # long prompts, seeds out of range
    n = args.num_processes
    if n is not None and n < 1:
        raise CLIError(f"--num-processes {n}: must be 1 or more.", "use 1 per GPU, e.g. --num-processes 2.")
    if n is not None and n > 1 and not _cuda() and n > (os.cpu_count() or 1):
        raise CLIError(
            f"--num-processes {n}: this machine has {os.cpu_count()} CPU cores and no GPU.",
            "use at most one process per core, or a GPU each.",
        )
    if n is not None:
        n = min(n, len(prompts))  # a process without a prompt would only load the model
    # what every process would refuse alike is refused here, once, as one line
    _check_size(args, _config(args, _backend(args)))
    if args.checkpoint and not (Path(args.checkpoint) / "model_index.json").is_file():
        raise CLIError(f"{args.checkpoint} is not a diffusers pipeline folder: model_index.json is missing.")
    if args.artifact and not Path(args.artifact).is_dir():
        raise CLIError(f"--artifact {args.artifact}: no such directory.")
    if args.digest and not args.artifact:
        raise CLIError("--digest pins an artifact: pass --artifact too.")
    _check_outputs(Path(args.out_dir), args.summary)  # before minutes of loading and building
    worker = bool(os.environ.get(RUN_ENV))  # one of the processes --num-processes started
    under_accelerate = int(os.environ.get("WORLD_SIZE") or 1) > 1 and not worker
    if n is not None and n > 1 and under_accelerate:
        raise CLIError(
            "--num-processes starts processes itself, and this is already one of "
            f"{os.environ['WORLD_SIZE']} (accelerate launch or torchrun).",
            "leave --num-processes out under accelerate launch.",
        )
    lora = _lora_record(args.lora)  # a missing file: one line, before any model loads
    # what decides the images, as every process computes it: a resume holds the folder to it
    # without compiling there is no engine set to take the size from: the tiny model's, else 1024
    tiny = TINY[args.model]["resolution"]
    eager_size = (1024 if args.checkpoint or args.random_full else tiny) if args.no_compile else None
    job = dict(
        steps=args.steps,
        guidance=args.guidance,
        height=args.height or eager_size,
        width=args.width or eager_size,
        seed=args.seed,
        pipeline_kwargs=(
            {"max_sequence_length": _flux_text(args)}
            if args.model == "flux"
            else {"use_resolution_binning": _binning(args)}
        ),
        # the model family and the config (its default size): where the weights come from (a
        # checkpoint, --tiny, an artifact built from them) is not recorded
        made_with={"model": args.model, "config": args.config, **({"lora": lora} if lora else {})},
    )
    if n is not None and n > 1 and not worker:
        if _cuda():
            import torch

            if n > torch.cuda.device_count():
                raise CLIError(
                    f"--num-processes {n}: this machine has {torch.cuda.device_count()} GPU(s).",
                    "use one process per GPU; for several machines use accelerate launch (README).",
                )
        # the workers' progress: rank 0's engine builds, in lines naming it (--quiet: none)
        command = [sys.executable, "-m", "prx_compile", *args.argv]
        settings = {"seed": args.seed, "steps": args.steps, "guidance": args.guidance}
        summary = launch(
            command,
            n,
            prompts,
            args.out_dir,
            resume=args.resume,
            summary_path=args.summary,
            settings=settings,
            show_progress=not args.quiet,
            made=made_record(prompts, **job),
        )
    else:
        summary = generate_images(
            _pipeline_factory(args),
            prompts,
            args.out_dir,
            resume=args.resume,
            summary_path=args.summary,
            **job,
        )
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # this process is done with its group
            dist.destroy_process_group()
        if summary["kind"] != "summary":  # one rank of several: rank 0 (or the launcher) reports
            return 0
    print(format_summary(summary), flush=True)
    if summary["missing"]:
        print(
            f"prx-compile: error: {len(summary['missing'])} of {summary['prompts']} images are missing "
            f"(listed above and in {summary['summary_path']}); run the same command again to make them.",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return 0


#: the largest bench results file --plot reads
MAX_RESULTS_BYTES = 64 << 20


def _bench_results(path: Path) -> dict:
    """A bench results JSON (``{"records": [...]}``): a regular file of at most ``MAX_RESULTS_BYTES``
    (a FIFO or a device is refused, not read), or a CLIError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CLIError(f"--plot {path} cannot be read ({e.strerror}).") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RESULTS_BYTES:
            raise CLIError(f"--plot {path} is not a results file (a regular file of at most 64 MiB).")
        data = json.loads(os.read(fd, MAX_RESULTS_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise CLIError(f"--plot {path} is not valid JSON ({type(e).__name__}).") from e
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise CLIError(f"--plot {path} is not a bench results file (no list of records).")
    return data


def cmd_bench(args) -> int:
    """Per-step latency, build time, memory and accuracy of the chosen paths, in one process."""
    from .bench import PATHS, Case, compile_path, failures, plot, run_bench, table
    from .testing import FULL_PRX, make_prx

    if args.plot:
        result = _bench_results(Path(args.plot))
        png = args.png or Path(args.plot).with_suffix(".png")
        try:
            plot(result, png)
        except (KeyError, TypeError, ValueError) as e:
            raise CLIError(
                f"{args.plot} is not a bench results file ({type(e).__name__}: {one_line(e, 100)})."
            ) from e
        print(f"wrote {png}")
        return 0
    if args.model != "prx":
        raise CLIError(
            f"bench times PRX only (its cases carry PRXPipeline's text mask); --model {args.model} is not "
            "supported here.",
            "for FLUX use benchmarks/flux.py (README, Performance).",
        )
    full = args.size == "full"
    if full and not _cuda():
        raise CLIError(
            "--size full benchmarks the 1.17 B PRX and needs a CUDA GPU; torch sees none.",
            "use --size tiny (the default) on this machine.",
        )
    device = _device()
    dtype = _torch_dtype(args)
    model = make_prx(FULL_PRX if full else None, dtype=dtype, device=device)
    res = args.resolution or [1024 if full else 32]
    vsf = 8 if full else 1
    text_len = args.text_len or (256 if full else 16)
    cases = [Case((r, r), b, args.mask, text_len, vsf) for r in res for b in args.batch]
    paths = {p: PATHS[p] for p in args.paths if p != "compile_prx"}
    if "compile_prx" in args.paths:
        if args.config:
            overrides = {"backend": _backend(args), "device": device}
        else:  # a range around the benchmarked shapes
            overrides = dict(
                backend=_backend(args),
                device=device,
                resolution=max(res),
                aspect_bins=[],
                vae_scale_factor=vsf,
                batch=[1, max(args.batch)],
                text_len=[1, text_len],
                specialize=[[r, r, b] for r in res for b in args.batch],
            )
        if args.weights:
            overrides["weights"] = args.weights
        if args.precision:
            overrides["precision"] = args.precision
        paths["compile_prx"] = compile_path(args.config, **overrides)
    result = run_bench(
        cases,
        paths,
        model=model,
        iters=args.iters,
        out_json=args.out,
        out_png=args.png,
        progress=not args.quiet,
    )
    print(table(result))
    failed = failures(result)
    if failed:
        print("prx-compile: error: these paths failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return EXIT_ERROR
    return 0


def cmd_inspect(args) -> int:
    """A summary of an artifact (versions, GPU, engine sets, LoRA, files, hashes verified)."""
    from ..io.artifact import open_artifact
    from ..io.saving import KIND, inspect_artifact

    if args.json:
        print(json.dumps(open_artifact(args.path, kind=KIND, verify=not args.no_verify).manifest, indent=1))
        return 0
    info = inspect_artifact(args.path, verify=not args.no_verify)
    v = info["versions"] or {}
    gpu = info["gpu"] or {}
    lines = [
        f"artifact {info['path']} (format {info['format_version']}, created {info['created']})",
        f"  digest       {info['digest']}" + ("" if not args.no_verify else " (files not verified)"),
        f"  model        {info['model']}, {info['dtype']}",
        f"  backend      {info['backend']}, attention {info['attention']}, weights {info['weights']}, "
        f"precision {info['precision']}",
        f"  built with   torch {v.get('torch')}, diffusers {v.get('diffusers')}, "
        f"prx_compile {v.get('prx_compile')}"
        + (
            f", Torch-TensorRT {v.get('torch_tensorrt')} ({v.get('tensorrt_package')} {v.get('tensorrt')})"
            if v.get("tensorrt")
            else ""
        ),
        f"  GPU          {gpu.get('name', 'none')} {gpu.get('capability', '')}".rstrip(),
    ]
    for s in info["engine_sets"]:
        lines.append(f"  engine set   {s['shapes']}: {s['engines']} engine(s)")
    lora = info["lora"]
    lines.append(
        f"  LoRA         {'none' if not lora else 'active ' + json.dumps(lora.get('active'), default=str)}"
    )
    lines.append(
        f"  files        {info['files']} + manifest, {info['bytes'] / 1e6:.1f} MB, "
        + ("sizes and sha256 verified" if info["verified"] else "not verified (--no-verify)")
    )
    print("\n".join(lines))
    return 0


# -- parser ------------------------------------------------------------------------------------
def _integer(text: str) -> int:
    """An integer argument of at most 19 digits (argparse's ``type=int`` echoes a bad value whole)."""
    try:
        return int(text) if len(text) <= 20 else int("x")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not an integer of at most 19 digits") from None


def _positive(text: str) -> int:
    try:
        v = int(text) if len(text) <= 20 else 0
    except ValueError:
        v = 0
    if not 1 <= v <= MAX_INT_ARG:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a positive integer up to {MAX_INT_ARG}")
    return v


def _lora(text: str) -> tuple[str, float]:
    """``--lora FILE`` or ``FILE:SCALE``: (a LoRA file or folder, its scale, -100..100)."""
    path, _, tail = text.rpartition(":")
    try:
        scale = float(tail) if path and len(tail) <= 32 else None
    except ValueError:
        scale = None
    if scale is None:
        path, scale = text, 1.0
    if not -100.0 <= scale <= 100.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{excerpt(text)}: the LoRA scale must be a number from -100 to 100")
    if not path:
        raise argparse.ArgumentTypeError("--lora needs a file: FILE or FILE:SCALE")
    return path, scale


def _apply_loras(target: Any, loras: list[tuple[str, float]] | None) -> None:
    """Load each --lora into ``target`` (a pipeline or a compiled transformer), active at its scale,
    named after its file (a number appended where two files share a name)."""
    from .. import load_lora
    from ..lora.adapters import loaded

    for path, scale in loras or []:
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem)[:56] or "lora"
        taken = loaded(target)
        name = next(n for n in (stem, *(f"{stem}_{i}" for i in range(1, len(taken) + 2))) if n not in taken)
        load_lora(target, path, name, scale=scale)


def _lora_record(loras: list[tuple[str, float]] | None) -> list[list[Any]]:
    """What decides the images of each --lora: its content (sha256 of the file, or of a folder's LoRA
    file) and scale; a missing file is one line, before any model loads."""
    from ..lora.adapters import lora_file

    out = []
    for path, scale in loras or []:
        try:
            f = lora_file(Path(path))
        except PRXCompileError as e:
            raise CLIError(f"--lora {excerpt(path)}: {e}") from e
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        out.append([h.hexdigest(), scale])
    return out


#: the largest guidance scale the CLI takes (pipelines use 1-10; beyond, images saturate)
MAX_GUIDANCE = 100.0


def _guidance(text: str) -> float:
    try:
        v = float(text) if len(text) <= 32 else math.nan
    except ValueError:
        v = math.nan
    if not 0.0 <= v <= MAX_GUIDANCE:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"{excerpt(text)} is not a guidance scale from 0 to {MAX_GUIDANCE:g}"
        )
    return v


class _Parser(argparse.ArgumentParser):
    """No abbreviations (``--step 2`` is not silently ``--steps``), and an unknown option gets the
    closest known ones as a suggestion."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def options(self) -> list[str]:
        """Every option string of this parser and of its subcommands."""
        out = [o for a in self._actions for o in a.option_strings]
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                out += [o for sp in a.choices.values() for o in sp.options()]
        return out

    def error(self, message: str):
        import difflib
        import re

        unknown = re.findall(
            r"(?<![\w-])(--?[A-Za-z][\w-]*)", message.partition("unrecognized arguments:")[2]
        )
        known = sorted(set(self.options()))
        hints = [
            f"{u}: did you mean {' or '.join(close)}?"
            for u in unknown
            if (close := difflib.get_close_matches(u, known, n=2, cutoff=0.6))
        ]
        super().error(message + ("; " + "; ".join(hints) if hints else ""))


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options that have a real default (not None / False)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    fmt = _Help
    p = _Parser(
        prog="prx-compile",
        description="Compile diffusers' PRX and FLUX.1 transformers with Torch-TensorRT (or the "
        "eager/inductor backends) and use them.",
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"prx-compile {__version__}")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def common(sp, backend=True):  # also accepted after the subcommand; SUPPRESS keeps a flag given before it
        sp.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress output")
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        if backend:
            sp.add_argument(
                "--backend",
                choices=["tensorrt", "inductor", "eager"],
                help="default: tensorrt on a GPU, eager otherwise",
            )

    d = sub.add_parser(
        "demo",
        help="tiny PRX: what compile_prx rewrites, error against eager, warm timings",
        formatter_class=fmt,
    )
    common(d)
    d.add_argument(
        "--attention",
        choices=["fused", "flash", "tensorrt"],
        default="fused",
        help="how attention runs (see CompileConfig.attention)",
    )
    d.add_argument(
        "--patchify",
        choices=["fold", "reshape"],
        default="fold",
        help="fold: diffusers 0.36's F.unfold/F.fold patchify (every rule fires); reshape: >= 0.37",
    )
    d.set_defaults(func=cmd_demo)

    def model_args(sp):
        sp.add_argument(
            "--model",
            choices=MODELS,
            default="prx",
            help="the model family: prx, prx-pixel (PRXPixel, pixel space) or flux (FLUX.1)",
        )
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--checkpoint", help="a local diffusers pipeline folder (nothing is downloaded)")
        g.add_argument(
            "--tiny", action="store_true", help="the built-in tiny random model (used when no --checkpoint)"
        )
        sp.add_argument(
            "--dtype",
            choices=DTYPES,
            help="default: the config's dtype, else bf16 on a GPU and fp32 on a CPU",
        )
        sp.add_argument(
            "--config",
            help="a preset name (prx-1024-bf16, ...) or a YAML file; "
            "default: compile_prx's defaults (the tiny model's own range with --tiny)",
        )
        sp.add_argument(
            "--attention", choices=["fused", "flash", "tensorrt"], help="override the config's attention"
        )
        sp.add_argument("--weights", choices=["inputs", "engine"], help="override the config's weights mode")
        sp.add_argument(
            "--precision", choices=["dtype", "fp8"], help="override the config's precision (fp8: FP8 GEMMs)"
        )
        sp.add_argument(
            "--fp8-masters",
            choices=["device", "host"],
            help="with fp8: where the exact bf16 weights wait (host: pinned CPU memory, less GPU memory)",
        )

    b = sub.add_parser("build", help="compile and write an artifact", formatter_class=fmt)
    common(b)
    model_args(b)
    b.add_argument(
        "--random-full",
        action="store_true",
        help="the full-size model of --model with random weights (PRX 1.17 B, PRXPixel 7B, FLUX.1 12 B)",
    )
    b.add_argument(
        "--out", required=True, help="artifact directory to write (an existing artifact is replaced)"
    )
    b.add_argument("--lora", action="append", type=_lora, metavar="FILE[:SCALE]", help=LORA_HELP)
    b.set_defaults(func=cmd_build)

    g = sub.add_parser(
        "generate",
        help="prompts to PNG files, on one GPU or several",
        description="Prompts to PNG files. Image i (the prompt's index) uses seed + i and is written as "
        "OUT_DIR/<i>-<slug>.png, so one process and N write the same files. --num-processes N splits "
        "the prompts over N processes of this machine; `accelerate launch -m prx_compile generate ...` "
        "does the same over accelerate's processes (several machines too). Existing PNGs are kept "
        "(--resume); missing ones are listed and make the exit code 1.",
        formatter_class=fmt,
    )
    common(g)
    model_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help="a text file with one prompt per line")
    g.add_argument("--artifact", help="use a saved artifact instead of compiling")
    g.add_argument(
        "--digest",
        help="with --artifact: the sha256:... its publisher printed; another artifact is refused",
    )
    g.add_argument("--no-compile", action="store_true", help="run the eager transformer")
    g.add_argument("--lora", action="append", type=_lora, metavar="FILE[:SCALE]", help=LORA_HELP)
    g.add_argument(
        "--out-dir", default="prx-images", help="where the PNGs go (NNN-slug.png, NNN the prompt's index)"
    )
    g.add_argument("--steps", type=_positive, default=28, help="denoising steps")
    g.add_argument("--guidance", type=_guidance, default=4.0, help="guidance scale (> 1 doubles the batch)")
    g.add_argument("--height", type=_positive, help="pixels; default: the first engine set's size")
    g.add_argument("--width", type=_positive, help="pixels; default: the first engine set's size")
    g.add_argument(
        "--random-full",
        action="store_true",
        help="the full-size model of --model with random weights and small random text encoders (benchmarks)",
    )
    g.add_argument(
        "--seed",
        type=_integer,
        default=0,
        help="image i (the prompt's index) uses seed + i, whatever the process count or the other "
        "prompts; default 0",
    )
    g.add_argument(
        "--num-processes",
        type=_integer,
        metavar="N",
        help="split the prompts over N processes of this machine, one GPU each (default: this process "
        "only; under accelerate launch, its processes)",
    )
    g.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the PNGs that exist (each is written atomically) and make only the others",
    )
    g.add_argument("--summary", metavar="FILE", help="the run's summary JSON (default: OUT_DIR/summary.json)")
    g.add_argument(
        "--binning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --checkpoint, PRXPipeline's resolution binning: a size is made at the nearest aspect "
        "bin of the pipeline's sample size (a notice names it when it differs); --no-binning keeps "
        "--height/--width as given",
    )
    g.set_defaults(func=cmd_generate)

    be = sub.add_parser(
        "bench", help="benchmark paths in one process: table, JSON and PNG chart", formatter_class=fmt
    )
    common(be)
    be.add_argument("--model", choices=["prx"], default="prx", help="the model family (PRX only)")
    be.add_argument(
        "--size", choices=["tiny", "full"], default="tiny", help="full: the 1.17 B PRX (GPU only)"
    )
    be.add_argument(
        "--paths",
        nargs="+",
        choices=[
            "eager",
            "torch.compile",
            "torch.compile-max-autotune",
            "torch.compile+torchao",
            "plain_mttm",
            "compile_prx",
        ],
        default=["eager", "compile_prx"],
        help="what to time",
    )
    be.add_argument("--config", help="compile_prx's preset or YAML (default: a range around the cases)")
    be.add_argument("--weights", choices=["inputs", "engine"], help="compile_prx's weights mode")
    be.add_argument("--precision", choices=["dtype", "fp8"], help="compile_prx's precision")
    be.add_argument(
        "--resolution",
        type=_positive,
        action="append",
        help="square pixel size, repeatable (default: 32 tiny, 1024 full)",
    )
    be.add_argument("--batch", type=_positive, nargs="+", default=[2], help="transformer batch sizes")
    be.add_argument(
        "--mask",
        choices=["pipeline", "none", "full"],
        default="pipeline",
        help="pipeline: rows keep 1 and 40 text tokens, as PRXPipeline with guidance",
    )
    be.add_argument("--text-len", type=_positive, help="text tokens (default: 16 tiny, 256 full)")
    be.add_argument("--dtype", choices=DTYPES, help="default: bf16 on a GPU, fp32 on a CPU")
    be.add_argument(
        "--iters", type=_positive, default=10, help="timed calls per case (after 3 warm-up calls)"
    )
    be.add_argument("--out", help="results JSON")
    be.add_argument("--png", help="chart PNG")
    be.add_argument("--plot", help="only re-draw the chart of an existing results JSON")
    be.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="summarise (and verify) an artifact", formatter_class=fmt)
    common(i, backend=False)
    i.add_argument("path", help="the artifact directory")
    i.add_argument("--json", action="store_true", help="print the raw manifest instead of a summary")
    i.add_argument("--no-verify", action="store_true", help="skip checking the files' sizes and sha256")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv  # generate --num-processes starts workers with the same arguments
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(name)s: %(message)s"
    )
    if not args.debug:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        for noisy in ("torch", "torch_tensorrt", "py.warnings", "transformers"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        import warnings

        warnings.filterwarnings("ignore")
    from .. import progress

    try:
        with progress.reporting(not args.quiet):
            return args.func(args)
    except PRXCompileError as e:
        if args.debug:
            raise
        print(f"prx-compile: error: {one_line(e, MAX_ERROR_CHARS)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("prx-compile: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        text = str(e)[:2000].strip()
        first = one_line(text.splitlines()[0], 300) if text else ""
        print(
            f"prx-compile: error: {type(e).__name__}: {first} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
