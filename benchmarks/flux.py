"""FLUX.1 against its peers, in one process and one run: ms per step, first call, memory, error.

    python benchmarks/flux.py OUT.json --parts bf16 lora pipeline     # one process
    python benchmarks/flux.py OUT.json --parts fp8                     # another

The FLUX.1-dev configuration (``FluxTransformer2DModel(guidance_embeds=True)``, diffusers' defaults
otherwise: 19 double and 38 single blocks, 11.9 B parameters) with random non-degenerate weights
(``--weights``: "constructed", the default since 0.31, as diffusers' constructor leaves them;
"scaled", 0.17-0.30's ``init_random_``; ``common.WEIGHTS``), bf16, 1024² (4096 image tokens),
batch 1, 512 text tokens, guidance 3.5. ``--config tiny`` runs the
same on the tiny FLUX (a dry run, on a CPU with ``--backend eager``). Parts:

  bf16      eager; ``compile_transformer`` with ``flux-1024-bf16``; diffusers' regional compilation
            (``compile_repeated_blocks(fullgraph=True)``, on a copy)
  fp8       ``flux-1024-fp8`` (on a copy: FP8 is installed in place), once per ``--fp8-masters``
            setting ("device", the default; "host": the exact weights in pinned CPU memory)
  fp8_lora  with fp8: the lora part's switch on each fp8 module
  torchao   with fp8: torchao float8 (``Float8DynamicActivationFloat8WeightConfig(PerRow())`` on the
            block linears, a copy), then regional compilation (its first call is minutes)
  lora      on the bf16 compiled module: a rank-32 LoRA over every block linear, loaded, switched
            A -> B -> A (seconds, and whether A's output comes back bit for bit)
  pipeline  a 28-step FluxPipeline (random tiny text encoders, no VAE decode) with the eager, the
            compiled and the regional transformer: seconds per image, the final latents' error (the
            device kit's diffusers has PRX's pipelines only: unpack diffusers' ``pipelines/flux``
            from its wheel into the kit's ``diffusers/pipelines`` first)
  saveload  save_compiled of the bf16 module, then load_compiled + the first step in a new process,
            twice (the second under cProfile)
  profile   one step's kernels by category (CUDA graphs off): ours in bf16 and the regional peer
            (unless only ``fp8`` is asked for), ours in fp8 with ``fp8``, the torchao peer with ``torchao``
  timeline  ours in bf16 (and fp8 with ``fp8``) as it runs, CUDA graphs on: per step the span of its
            kernels, the time some kernel ran, the idle rest and its longest gaps (``step_timeline``)

Each path: first call (seconds, cold: builds and compiles included), ms/step back to back (as a
pipeline runs its steps) and synchronised per call, device memory added (counted once the path's
own copy of the model exists: what the method adds over eager's weights), relative L2 error against
eager bf16, NaN. ``profile`` with ``fp8`` and ``torchao`` also profiles the torchao peer.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import (  # noqa: E402
    WEIGHTS,
    first_call,
    free,
    host_gb,
    kernel_profile,
    made_model,
    memory_gb,
    rel_err,
    speed,
    step_timeline,
)

from prx_compile import compile_transformer, load_lora, save_compiled, set_lora
from prx_compile.lora import make_random_lora
from prx_compile.models import SPECS
from prx_compile.models.flux import DEV, TINY

SPEC = SPECS["flux"]


def log(msg: str) -> None:
    print(f"[flux {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_model(
    config: dict, device: str, dtype: torch.dtype, weights: str = "constructed"
) -> torch.nn.Module:
    """The model of ``config`` on ``device`` with random non-degenerate weights (``common.WEIGHTS``;
    made on the device: no CPU copy of 12 B parameters)."""
    return made_model(SPEC, config, weights, device, dtype)


def record(label: str, fn, kw: dict, ref: torch.Tensor | None, base_gb: float, iters: int) -> dict:
    log(f"{label}: first call ...")
    out, first_s = first_call(fn, kw)
    rec = {"path": label, "first_call_s": round(first_s, 2)}
    rec.update(speed(fn, kw, iters=iters))
    rec["memory_added_gb"] = round(memory_gb() - base_gb, 3)
    rec["host_gb"] = round(host_gb(), 2)
    rec["rel_err"] = rel_err(out, ref) if ref is not None else 0.0
    rec["nan"] = bool(torch.isnan(out).any())
    if hasattr(fn, "report"):
        r = fn.report()
        rec["report"] = {
            k: r[k] for k in ("engines", "engine_calls", "torch_segments", "torch_ops", "kernels")
        }
        rec["report"]["timings"] = r["engine_sets"][0].get("timings")
        rec["report"]["slowest_engines"] = r["engine_sets"][0].get("slowest_engines")
    log(f"{label}: {json.dumps({k: v for k, v in rec.items() if k != 'report'})}")
    return rec


def model_copy(model):
    """(a copy of ``model``, the device memory in use with it): what a record adds is counted from
    there, so a peer's or our copy of the 24 GB of weights is not counted as the method's memory."""
    m = copy.deepcopy(model)
    return m, (memory_gb() if torch.cuda.is_available() else 0.0)


def regional(m):
    """diffusers' regional compilation of ``m`` (a copy): each repeated block compiled, full graph."""
    m.compile_repeated_blocks(fullgraph=True)
    return m


def regional_torchao(m):
    """torchao float8 on the block linears of ``m`` (a copy; the ones ``precision: fp8`` quantises),
    then regional compilation: the strongest FP8 peer a well-informed user runs."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(
        m,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and bool(SPEC.block_linears.match(fqn)),
    )
    m.compile_repeated_blocks(fullgraph=True)
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["bf16"],
        choices=["bf16", "fp8", "torchao", "lora", "fp8_lora", "pipeline", "saveload", "profile", "timeline"],
    )
    ap.add_argument(
        "--fp8-masters",
        nargs="+",
        default=["device"],
        choices=["device", "host"],
        help="the fp8 part's fp8_masters settings, one record each (fp8_lora: a LoRA switch on each)",
    )
    for flag, what in (
        ("--fp8-inputs", "the fp8 part's fp8_inputs settings (off: one quantisation per FP8 linear, 0.29)"),
        ("--fp8-norm", "the fp8 part's fp8_norm settings (on: norms made in the quantisation; default off)"),
        ("--linear-glue", "the bf16 part's linear_glue settings (off: 0.29's graph, GELUs and concatenations "
         "in engines); the lora, pipeline, saveload and profile parts take the first"),
    ):  # fmt: skip
        ap.add_argument(
            flag, nargs="+", default=["off" if flag == "--fp8-norm" else "on"], choices=["on", "off"],
            help=f"{what}: one record each (fp8: for every other fp8 setting); the timeline takes the first",
        )  # fmt: skip
    ap.add_argument("--weights", choices=list(WEIGHTS), default="constructed", help="see common.WEIGHTS")
    ap.add_argument("--config", choices=["dev", "tiny"], default="dev")
    ap.add_argument("--backend", default="tensorrt")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--steps", type=int, default=28)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    dev = args.config == "dev"
    size, text = (1024, 512) if dev else (16, 8)
    vae = 8 if dev else 1
    tokens = (size // (2 * vae)) ** 2
    result: dict = {"what": "FLUX.1 against its peers", "config": args.config, "parts": args.parts}
    result["model_weights"] = args.weights
    result["env"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None}
    try:
        from prx_compile.backends.tensorrt import shim

        result["env"].update(shim.versions())
    except Exception as e:
        result["env"]["torch_tensorrt"] = f"unavailable ({type(e).__name__})"
    records: list[dict] = []
    result["records"] = records

    def save():
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    base_gb = memory_gb() if cuda else 0.0
    t0 = time.perf_counter()
    model = make_model(DEV if dev else TINY, device, dtype, args.weights)
    free()  # the fp32 init's cached blocks: else the first "memory added" is negative (0.17's run)
    result["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
    result["model_gb"] = round(memory_gb() - base_gb, 2) if cuda else None
    log(f"model: {result['params_b']} B parameters in {time.perf_counter() - t0:.1f} s")
    kw = SPEC.example_inputs(model, 1, tokens, 1, text, dtype=dtype, device=device, seed=0)
    kw["timestep"] = torch.full((1,), 0.5, device=device)
    overrides = (
        {}
        if dev
        else dict(resolution=size, vae_scale_factor=vae, text_len=[text, text], specialize=[[size, size, 1]])
    )
    overrides["backend"] = args.backend
    if not cuda:  # a dry run: fp32 on a CPU
        overrides.update(device="cpu", dtype=None)
    base_gb = memory_gb() if cuda else 0.0
    ref = record("eager", model, kw, None, base_gb, args.iters)
    ref_out = first_call(model, kw)[0]
    records.append(ref)
    save()

    compiled = None
    if any(p in args.parts for p in ("bf16", "lora", "pipeline", "saveload", "timeline")):
        base_gb = memory_gb() if cuda else 0.0
        glue = args.linear_glue[0] == "on"
        compiled = compile_transformer(model, config="flux-1024-bf16", linear_glue=glue, **overrides)
        label = "compile_transformer[flux-1024-bf16]" + ("" if glue else " linear_glue=off")
        records.append(record(label, compiled, kw, ref_out, base_gb, args.iters))
        save()
        for other in args.linear_glue[1:]:
            base_gb = memory_gb() if cuda else 0.0
            ct = compile_transformer(model, config="flux-1024-bf16", linear_glue=other == "on", **overrides)
            label = "compile_transformer[flux-1024-bf16]" + ("" if other == "on" else " linear_glue=off")
            records.append(record(label, ct, kw, ref_out, base_gb, args.iters))
            del ct
            free()
            save()
    if "timeline" in args.parts and compiled is not None:
        result["timeline_bf16"] = step_timeline(compiled, kw)
        log(f"timeline bf16: {json.dumps({k: v for k, v in result['timeline_bf16'].items() if k != 'gaps'})}")
        save()
    if "lora" in args.parts:
        result["lora"] = lora_switch(compiled, model, kw)
        save()
    if "profile" in args.parts and cuda and ("bf16" in args.parts or "fp8" not in args.parts):
        glue = args.linear_glue[0] == "on"
        ct = compile_transformer(
            model, config="flux-1024-bf16", cuda_graphs=False, linear_glue=glue, **overrides
        )
        first_s = first_call(ct, kw)[1]
        result["profile_bf16"] = kernel_profile(ct, kw)
        r = ct.report()
        result["profile_bf16"]["first_call_s"] = round(first_s, 2)
        keys = ("engines", "engine_calls", "torch_ops", "kernels")
        result["profile_bf16"]["report"] = {k: r[k] for k in keys}
        result["profile_bf16"]["report"]["timings"] = r["engine_sets"][0].get("timings")
        log(f"profile bf16: {result['profile_bf16']['by_category']}")
        del ct
        free()
        peer = regional(model_copy(model)[0])
        first_call(peer, kw)
        result["profile_regional"] = kernel_profile(peer, kw)
        log(f"profile regional: {result['profile_regional']['by_category']}")
        del peer
        free()
        save()
    if "saveload" in args.parts:
        result["saveload"] = save_and_load(compiled, kw, ref_out)
        save()
    if "pipeline" in args.parts:
        result["pipeline"] = {"eager": pipeline_run(model, args.steps, size, text, vae, None, device, dtype)}
        result["pipeline"]["compile_transformer"] = pipeline_run(
            compiled, args.steps, size, text, vae, result["pipeline"]["eager"]["latents"], device, dtype
        )
        save()
    if "bf16" in args.parts and cuda:
        compiled = None
        free()
        m, base_gb = model_copy(model)
        peer = regional(m)
        records.append(record("compile_repeated_blocks", peer, kw, ref_out, base_gb, args.iters))
        save()
        if "pipeline" in args.parts:
            result["pipeline"]["compile_repeated_blocks"] = pipeline_run(
                peer, args.steps, size, text, vae, result["pipeline"]["eager"]["latents"], device, dtype
            )
        del peer
        free()
    if "pipeline" in result:
        for v in result["pipeline"].values():
            v.pop("latents", None)
    variants = (
        [(m, i, nm) for m in args.fp8_masters for i in args.fp8_inputs for nm in args.fp8_norm]
        if "fp8" in args.parts
        else []
    )
    for n, (masters, inputs, norm) in enumerate(variants):
        compiled = None
        free()
        m, base_gb = model_copy(model)
        label = "compile_transformer[flux-1024-fp8]" + (
            "" if masters == "device" else f" fp8_masters={masters}"
        )
        label += ("" if inputs == "on" else " fp8_inputs=off") + ("" if norm == "off" else " fp8_norm=on")
        fp8 = dict(fp8_masters=masters, fp8_inputs=inputs == "on", fp8_norm=norm == "on")
        ours = compile_transformer(m, config="flux-1024-fp8", **fp8, **overrides)
        records.append(record(label, ours, kw, ref_out, base_gb, args.iters))
        save()
        if "fp8_lora" in args.parts:
            key = (
                f"lora_fp8_{masters}"
                + ("" if inputs == "on" else "_inputs_off")
                + ("" if norm == "on" else "_norm_off")
            )
            result[key] = lora_switch(ours, m, kw)
            save()
        if "timeline" in args.parts and n == 0:
            result["timeline_fp8"] = step_timeline(ours, kw)
            summary = {k: v for k, v in result["timeline_fp8"].items() if k != "gaps"}
            log(f"timeline fp8: {json.dumps(summary)}")
            save()
        if "profile" in args.parts and cuda and n == 0:
            ct = compile_transformer(
                copy.deepcopy(model), config="flux-1024-fp8", cuda_graphs=False, **fp8, **overrides
            )
            ct(**kw, return_dict=False)
            result["profile_fp8"] = kernel_profile(ct, kw)
            log(f"profile fp8: {result['profile_fp8']['by_category']}")
            del ct
        del ours, m
        free()
        if cuda and "torchao" in args.parts and n == len(variants) - 1:
            m, base_gb = model_copy(model)
            peer = regional_torchao(m)
            records.append(
                record("compile_repeated_blocks+torchao float8", peer, kw, ref_out, base_gb, args.iters)
            )
            if "profile" in args.parts:
                result["profile_torchao"] = kernel_profile(peer, kw)
                log(f"profile torchao: {result['profile_torchao']['by_category']}")
            del peer, m
            free()
    save()
    log("done")


def lora_switch(compiled, model, kw) -> dict:
    """A rank-32 LoRA over every block linear: load A, load B, switch to A; seconds and exactness."""
    out = {}
    a = make_random_lora(model, rank=32, seed=1, std=0.01)
    b = make_random_lora(model, rank=32, seed=2, std=0.01)
    out["layers"] = len(a) // 2
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return round(time.perf_counter() - t0, 4)

    base = compiled(**kw, return_dict=False)[0].clone()
    out["load_a_s"] = timed(lambda: load_lora(compiled, a, "a"))
    with_a = compiled(**kw, return_dict=False)[0].clone()
    out["load_b_s"] = timed(lambda: load_lora(compiled, b, "b"))
    out["switch_to_b_s"] = timed(lambda: set_lora(compiled, "b"))
    with_b = compiled(**kw, return_dict=False)[0].clone()
    out["switch_to_a_s"] = timed(lambda: set_lora(compiled, "a"))
    again = compiled(**kw, return_dict=False)[0]
    out["a_changes_output_rel"] = rel_err(with_a, base)
    out["b_differs_from_a_rel"] = rel_err(with_b, with_a)
    out["a_b_a_exact"] = bool(torch.equal(again, with_a))
    from prx_compile import unload_lora

    out["unload_s"] = timed(lambda: unload_lora(compiled))
    out["unload_exact"] = bool(torch.equal(compiled(**kw, return_dict=False)[0], base))
    log(f"lora: {out}")
    return out


def pipeline_run(transformer, steps: int, size: int, text: int, vae: int, ref, device, dtype) -> dict:
    """A FluxPipeline of ``steps`` steps at ``size``² with ``transformer`` (random tiny text encoders,
    latents out): seconds per image (the second of two runs), the final latents' error against ``ref``."""
    from prx_compile.tools.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(transformer, text_len=text, vae_scale=vae)
    pipe.text_encoder.to(device, dtype)
    pipe.text_encoder_2.to(device, dtype)
    pipe.vae.to(device, dtype)
    args = dict(
        prompt="a photo of a cat",
        height=size,
        width=size,
        guidance_scale=3.5,
        max_sequence_length=text,
        output_type="latent",
    )
    times = []
    for _ in range(2):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        latents = pipe(
            **args, num_inference_steps=steps, generator=torch.Generator(device).manual_seed(0)
        ).images
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {
        "s_per_image": round(times[-1], 3),
        "s_first": round(times[0], 3),
        "latents": latents.float().cpu(),
    }
    if ref is not None:
        out["latents_rel_err"] = rel_err(latents.float().cpu(), ref)
        out["nan"] = bool(torch.isnan(latents).any())
    log(f"pipeline: { ({k: v for k, v in out.items() if k != 'latents'}) }")
    return out


def save_and_load(compiled, kw, ref_out) -> dict:
    """save_compiled, then in a new process: imports, load_compiled, first step (seconds each)."""
    path = Path("/tmp/flux.art")
    t0 = time.perf_counter()
    save_compiled(compiled, path)
    out = {"save_s": round(time.perf_counter() - t0, 2)}
    torch.save({k: v.cpu() for k, v in kw.items()}, "/tmp/flux_inputs.pt")
    torch.save(ref_out.cpu(), "/tmp/flux_ref.pt")
    child = "\n".join(
        [
            "import time, json, torch",
            "t0 = time.perf_counter()",
            "import prx_compile, diffusers",
            "t1 = time.perf_counter()",
            "ct = prx_compile.load_compiled('/tmp/flux.art')",
            "t2 = time.perf_counter()",
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'",
            "kw = {k: v.to(dev) for k, v in torch.load('/tmp/flux_inputs.pt').items()}",
            "out = ct(**kw, return_dict=False)[0]",
            "torch.cuda.synchronize() if dev == 'cuda' else None; t3 = time.perf_counter()",
            "ref = torch.load('/tmp/flux_ref.pt').to(dev).float()",
            "err = float((out.float() - ref).norm() / ref.norm())",
            "r = {'imports_s': t1 - t0, 'load_compiled_s': t2 - t1, 'first_step_s': t3 - t2, 'rel_err': err}",
            "print('RESULT', json.dumps(r))",
        ]
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    out.update(json.loads(line[7:]) if line else {"error": r.stderr[-1500:]})
    log(f"saveload: {out}")
    # the same again under cProfile: where load_compiled and the first step spend their time
    profiled = child.replace(
        "ct = prx_compile.load_compiled('/tmp/flux.art')",
        "import cProfile, pstats, io; pr = cProfile.Profile(); pr.enable()\n"
        "ct = prx_compile.load_compiled('/tmp/flux.art')",
    ).replace(
        "print('RESULT'",
        "pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('cumulative')"
        ".print_stats(40); r['profile'] = s.getvalue()[-12000:]\nprint('RESULT'",
    )
    r = subprocess.run([sys.executable, "-c", profiled], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    out["profiled"] = json.loads(line[7:]) if line else {"error": r.stderr[-1500:]}
    log(f"saveload profiled: {str(out['profiled'].get('profile', out['profiled']))[:6000]}")
    return out


if __name__ == "__main__":
    main()
