"""The ``prx-compile`` command: demo, build, generate, bench, inspect.

Every subcommand has ``--help``. Long steps show progress bars unless ``--quiet``. Errors print one
line with a hint and exit non-zero; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter
from pathlib import Path

from .errors import PRXCompileError

EXIT_USAGE, EXIT_ERROR = 2, 1


class CLIError(PRXCompileError):
    """A bad argument or a missing file, reported as one line."""


# -- helpers -----------------------------------------------------------------------------------
def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _load_pipeline(args):
    """(pipeline, height, width) from --checkpoint DIR or --tiny; nothing is downloaded."""
    import torch

    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        if not (ckpt / "model_index.json").is_file():
            raise CLIError(
                f"{ckpt} is not a diffusers PRX checkpoint folder: model_index.json is missing.",
                "pass the folder that holds model_index.json, transformer/, text_encoder/, ...; "
                "or --tiny for the built-in random demo model.",
            )
        from diffusers import PRXPipeline

        device = "cuda" if torch.cuda.is_available() else "cpu"
        pipe = PRXPipeline.from_pretrained(str(ckpt), torch_dtype=_dtype(args.dtype), local_files_only=True)
        return pipe.to(device), args.height or 1024, args.width or 1024
    from .testing import tiny_pipeline

    return tiny_pipeline(), args.height or 32, args.width or 32


def _model_for_build(args):
    import torch

    from .testing import FULL_PRX, make_prx

    if args.checkpoint:
        from diffusers import PRXTransformer2DModel

        sub = Path(args.checkpoint) / "transformer"
        if not (sub / "config.json").is_file():
            raise CLIError(
                f"{sub} has no config.json: not a diffusers PRX checkpoint folder.",
                "pass the folder that holds transformer/config.json, or --tiny.",
            )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return PRXTransformer2DModel.from_pretrained(
            str(sub), torch_dtype=_dtype(args.dtype), local_files_only=True
        ).to(device)
    device = "cuda" if torch.cuda.is_available() and args.backend == "tensorrt" else "cpu"
    dtype = _dtype(args.dtype) if device == "cuda" else __import__("torch").float32
    return make_prx(FULL_PRX if args.random_full else None, dtype=dtype, device=device)


def _compile_kwargs(args) -> dict:
    kw = {}
    if args.backend:
        kw["backend"] = args.backend
    if getattr(args, "attention", None):
        kw["attention"] = args.attention
    return kw


# -- subcommands -------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    """Tiny non-degenerate PRX: export, lower, run; print what was rewritten and the error vs eager."""
    import torch

    from . import compile_prx
    from .bench import max_abs_err, rel_err
    from .export import example_inputs, export_prx
    from .lowering import lower
    from .testing import TINY_PRX, make_prx

    backend = args.backend or ("tensorrt" if torch.cuda.is_available() else "eager")
    model = make_prx(patchify=args.patchify, device="cuda" if backend == "tensorrt" else "cpu")
    cfg = dict(batch=[1, 2], text_len=[1, 16], resolution=16, aspect_bins=[], vae_scale_factor=1)
    print(
        f"prx-compile demo: tiny PRX (depth {TINY_PRX['depth']}, hidden {TINY_PRX['hidden_size']}), "
        f"patchify={args.patchify}, backend={backend}, attention={args.attention}"
    )
    kw = example_inputs(model.config, 2, 16, 16, 12, masked_tokens=5, device=next(model.parameters()).device)
    ep = export_prx(model, kw)
    before = Counter(str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function")
    from .config import CompileConfig

    gm = lower(ep.module(), CompileConfig.resolve(None, attention=args.attention, backend="eager").lowering())
    after = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    print("rewritten by the lowering rules:")
    for op in sorted(set(before) | set(after)):
        if before[op] != after[op] and (
            "attention" in op or "im2col" in op or "col2im" in op or "select" in op
        ):
            print(f"  {op:45s} {before[op]:3d} -> {after[op]:3d}")
    ct = compile_prx(
        model, backend=backend, attention=args.attention, device=str(kw["hidden_states"].device), **cfg
    )
    print("error against eager (fp32):")
    for masked, label in ((0, "no text token hidden"), (5, "5 of 12 hidden"), (12, "all 12 hidden")):
        kw = example_inputs(
            model.config, 2, 16, 16, 12, masked_tokens=masked, seed=masked, device=kw["hidden_states"].device
        )
        with torch.no_grad():
            ref = model(**kw, return_dict=False)[0]
        out = ct(**kw, return_dict=False)[0]
        print(f"  {label:22s} max abs {max_abs_err(out, ref):.2e}   rel L2 {rel_err(out, ref):.2e}")
    rep = ct.report()
    print(
        f"compiled: backend {rep['backend']}, engines {rep['engines']}, "
        f"PyTorch segments {rep['torch_segments']}, "
        f"kept in PyTorch {rep['torch_ops'] or '{}'}"
    )
    return 0


def cmd_build(args) -> int:
    """Compile a PRX transformer and write an artifact (engines, weights, manifest)."""
    from . import compile_prx
    from .serialization import save_compiled

    model = _model_for_build(args)
    ct = compile_prx(model, config=args.config, **_compile_kwargs(args))
    ct.build()
    path = save_compiled(ct, args.out)
    rep = ct.report()
    print(f"wrote {path} ({rep['backend']}, {rep['engines']} engine(s), built in {rep['build_s']:.1f} s)")
    return 0


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        f = Path(args.prompts_file)
        if not f.is_file():
            raise CLIError(f"prompts file {f} does not exist.")
        prompts += [line.strip() for line in f.read_text().splitlines() if line.strip()]
    if not prompts:
        raise CLIError("no prompt given.", "pass --prompt TEXT (repeatable) or --prompts-file FILE.")
    return prompts


def cmd_generate(args) -> int:
    """Prompts to PNG files, with a compiled transformer (fresh, or loaded from --artifact)."""
    import torch

    from . import compile_prx
    from .serialization import load_compiled

    prompts = _prompts(args)
    pipe, height, width = _load_pipeline(args)
    pipe.set_progress_bar_config(disable=args.quiet)
    if args.artifact:
        pipe.transformer = load_compiled(args.artifact)
    elif not args.no_compile:
        kw = _compile_kwargs(args)
        if not args.checkpoint and "backend" not in kw:
            kw["backend"] = "tensorrt" if torch.cuda.is_available() else "eager"
        if not args.checkpoint and args.config is None:  # the tiny demo model: latent == pixels
            kw.update(
                batch=[1, 2],
                text_len=[1, 16],
                resolution=max(height, width),
                aspect_bins=[],
                vae_scale_factor=1,
                device=str(pipe.device),
            )
        pipe.transformer = compile_prx(pipe.transformer, config=args.config, **kw)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for i, prompt in enumerate(prompts):
        gen = torch.Generator(device="cpu").manual_seed(args.seed + i)
        image = pipe(
            prompt=prompt,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            height=height,
            width=width,
            generator=gen,
            use_resolution_binning=bool(args.checkpoint),
        ).images[0]
        slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40] or "image"
        path = out_dir / f"{i:03d}-{slug}.png"
        image.save(path)
        written.append(str(path))
    print("\n".join(written))
    return 0


def cmd_bench(args) -> int:
    """Per-step latency, build time, memory and accuracy of eager, torch.compile, MTTM, compile_prx."""
    from .bench import Case, plot, run_bench

    if args.plot:
        result = json.loads(Path(args.plot).read_text())
        plot(result, args.png or Path(args.plot).with_suffix(".png"))
        print(f"wrote {args.png or Path(args.plot).with_suffix('.png')}")
        return 0
    res = args.resolution or [256 if args.model == "tiny" else 1024]
    cases = [Case((r, r), b, args.mask, args.text_len) for r in res for b in args.batch]
    prx = {
        "resolution": max(res),
        "aspect_bins": [],
        "batch": [1, max(args.batch)],
        "text_len": [1, args.text_len],
    }
    model_config = None if args.model == "tiny" else {}
    run_bench(
        cases,
        args.paths,
        model_config=model_config,
        dtype=_dtype(args.dtype),
        patchify=args.patchify,
        prx_config=prx,
        iters=args.iters,
        out_json=args.out,
        out_png=args.png,
        progress=not args.quiet,
    )
    return 0


def cmd_inspect(args) -> int:
    """Print an artifact's manifest (versions, GPU, config, shapes, engines, file hashes)."""
    from .serialization import inspect_artifact

    print(json.dumps(inspect_artifact(args.path), indent=1, default=str))
    return 0


# -- parser ------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prx-compile",
        description="Compile diffusers' PRX transformer with "
        "Torch-TensorRT (or the eager/inductor backends) and use it.",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, backend=True):  # also accepted after the subcommand; SUPPRESS keeps a flag given before it
        sp.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
        sp.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs"
        )
        if backend:
            sp.add_argument(
                "--backend",
                choices=["tensorrt", "inductor", "eager"],
                help="default: tensorrt on a GPU, eager otherwise",
            )

    d = sub.add_parser("demo", help="tiny PRX: lower, run, print rewrites and error against eager")
    common(d)
    d.add_argument("--attention", choices=["flash", "tensorrt"], default="flash")
    d.add_argument(
        "--patchify",
        choices=["fold", "reshape"],
        default="fold",
        help="fold: diffusers 0.36's F.unfold/F.fold patchify (every rule fires); reshape: >= 0.37",
    )
    d.set_defaults(func=cmd_demo)

    def model_args(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--checkpoint", help="local diffusers PRX checkpoint folder (nothing is downloaded)")
        g.add_argument("--tiny", action="store_true", help="the built-in tiny random PRX (default)")
        sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
        sp.add_argument("--config", help="preset name from configs/ or a YAML file")
        sp.add_argument("--attention", choices=["flash", "tensorrt"])

    b = sub.add_parser("build", help="compile and write an artifact")
    common(b)
    model_args(b)
    b.add_argument(
        "--random-full", action="store_true", help="the 1.17 B PRX with random weights (benchmarks)"
    )
    b.add_argument("--out", required=True, help="artifact directory to write")
    b.set_defaults(func=cmd_build)

    g = sub.add_parser("generate", help="prompts to PNG files")
    common(g)
    model_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help="a text file with one prompt per line")
    g.add_argument("--artifact", help="use a saved artifact instead of compiling")
    g.add_argument("--no-compile", action="store_true", help="run the eager transformer")
    g.add_argument("--out-dir", default="prx-images")
    g.add_argument("--steps", type=int, default=28)
    g.add_argument("--guidance", type=float, default=4.0)
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)

    be = sub.add_parser("bench", help="benchmark paths in one process; table, JSON and PNG chart")
    common(be, backend=False)
    be.add_argument("--model", choices=["tiny", "full"], default="tiny", help="full: the 1.17 B PRX (GPU)")
    be.add_argument(
        "--paths",
        nargs="+",
        default=["eager", "compile_prx"],
        help="eager torch.compile plain_mttm compile_prx 'compile_prx[key=value,...]'",
    )
    be.add_argument(
        "--resolution", type=int, action="append", help="square pixel size, repeatable (256 tiny, 1024 full)"
    )
    be.add_argument("--batch", type=int, nargs="+", default=[2])
    be.add_argument(
        "--mask",
        choices=["pipeline", "none", "full"],
        default="pipeline",
        help="pipeline: rows keep 1 and 40 text tokens, as PRXPipeline with guidance",
    )
    be.add_argument("--text-len", type=int, default=256)
    be.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    be.add_argument("--patchify", choices=["reshape", "fold"], default="reshape")
    be.add_argument("--iters", type=int, default=10)
    be.add_argument("--out", help="results JSON")
    be.add_argument("--png", help="chart PNG")
    be.add_argument("--plot", help="only re-draw the chart of an existing results JSON")
    be.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="print an artifact's manifest")
    common(i, backend=False)
    i.add_argument("path")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(name)s: %(message)s"
    )
    if not args.debug:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        for noisy in ("torch", "torch_tensorrt", "py.warnings"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        import warnings

        warnings.filterwarnings("ignore")
    from . import progress

    try:
        with progress.reporting(not args.quiet):
            return args.func(args)
    except PRXCompileError as e:
        if args.debug:
            raise
        print(f"prx-compile: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(
            f"prx-compile: error: {type(e).__name__}: {e} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
