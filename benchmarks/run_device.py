"""Everything the issues ask to measure on the GPU, in phases; each phase writes JSON into --out.

    python benchmarks/run_device.py --out $OUT --phases bench
    python benchmarks/run_device.py --out $OUT --phases forms lora pipeline

Phases:
  bench     eager, compile_prx, plain MTTM, torch.compile at 1024² b2 / 1024² b1 / 832x1216 b2 / 512² b2
            with the pipeline's text mask (one process, one run) + switches that need no rebuild.
  forms     both attention forms (+ fused attention) with reshape patchify (diffusers 0.42).
  forms_fold  both attention forms with fold patchify (diffusers 0.36).
  perf      static builds at 1024² b2 (with and without fused attention), 1024² b1 and 512² b2,
            each against eager and torch.compile.
  lora      rank-64 LoRA over every attention/MLP linear: refit time, A->B->A, latency after refit;
            engine cache miss then hit; save, then load in a new process.
  pipeline  a full PRXPipeline (real-size transformer, small random text encoder, latents out):
            final latents of compiled vs eager; 28-step wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from prx_compile import compile_prx
from prx_compile.bench import Case, environment, rel_err, run_bench, time_cuda
from prx_compile.testing import make_prx

T0 = time.time()
FULL: dict = {}  # diffusers' default PRX: 1.17 B parameters
DEFAULT = {"aspect_bins": [512, 1024], "batch": [1, 2], "text_len": [1, 256]}


def bench(out: Path) -> None:
    cases = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2), Case((512, 512), 2)]
    run_bench(
        cases,
        ["eager", "compile_prx", "plain_mttm", "torch.compile"],
        model_config=FULL,
        prx_config=DEFAULT,
        out_json=out / "bench_prx_h200.json",
        out_png=out / "bench_prx_h200.png",
        runtime_ablation=True,
    )


STATIC = "static=true,opt_batch={b},text_len=[256,256]"


def forms(out: Path) -> None:
    """Issue 2's forms: the lowering rules' flash form (fused_attention off), the TensorRT form,
    and issue 7's fused attention, against eager and torch.compile."""
    case = [Case((1024, 1024), 2)]
    static = STATIC.format(b=2)
    rules_flash = f"compile_prx[fused_attention=false,{static}]"
    run_bench(
        case,
        [
            "eager",
            rules_flash,
            f"compile_prx[{static}]",
            "torch.compile",
            f"compile_prx[attention=tensorrt,{static}]",
        ],
        model_config=FULL,
        out_json=out / "forms_static_diffusers042.json",
    )


def forms_fold(out: Path) -> None:
    """The same forms on the fold variant (diffusers 0.36's F.unfold/F.fold patchify)."""
    static = STATIC.format(b=2)
    rules_flash = f"compile_prx[fused_attention=false,{static}]"
    trt_form = f"compile_prx[attention=tensorrt,{static}]"
    run_bench(
        [Case((1024, 1024), 2)],
        ["eager", rules_flash, trt_form],
        model_config=FULL,
        patchify="fold",
        out_json=out / "forms_fold_diffusers036.json",
    )


def perf(out: Path) -> None:
    """Issue 7, static builds, each file one process and one run against eager and torch.compile:
    1024² batch 2 (with the fused-attention ablation), 1024² batch 1 (the distilled model, no
    guidance) and 512² batch 2."""
    for res, batch in ((1024, 2), (1024, 1), (512, 2)):
        static = STATIC.format(b=batch) + f",resolution={res}"
        paths = ["eager", f"compile_prx[{static}]", "torch.compile"]
        if (res, batch) == (1024, 2):
            paths.insert(2, f"compile_prx[fused_attention=false,{static}]")
        run_bench(
            [Case((res, res), batch)],
            paths,
            model_config=FULL,
            out_json=out / f"perf_static_{res}_b{batch}_h200.json",
        )


def _load_in_new_process(art: Path, inputs: Path, expected: Path) -> dict:
    code = f"""
import json, time, torch
t0 = time.perf_counter()
from prx_compile.serialization import load_compiled
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
ct = load_compiled({str(art)!r})
load_s = time.perf_counter() - t0
from safetensors.torch import load_file
kw = load_file({str(inputs)!r}, device="cuda")
want = load_file({str(expected)!r}, device="cuda")["out"]
t0 = time.perf_counter()
got = ct(**kw, return_dict=False)[0]
torch.cuda.synchronize()
first = time.perf_counter() - t0
print("RESULT" + json.dumps({{"import_s": t_import, "load_s": load_s, "first_call_s": first,
      "equal": bool(torch.equal(got, want)), "max_abs_diff": float((got.float() - want.float()).abs().max()),
      "engines": ct.report()["engines"]}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    return json.loads(line[0][6:])


def _step(res: dict, key: str, fn):
    """Run one measured step; record its result or its error, never stop the phase."""
    try:
        res[key] = fn()
    except Exception as e:
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:]}
    return res[key]


def lora(out: Path) -> None:
    from safetensors.torch import save_file

    from prx_compile.lora import load_lora, make_random_lora, set_lora, unload_lora
    from prx_compile.serialization import cache_key, save_compiled

    res: dict = {"env": environment()}
    path = out / "lora_refit_saveload_h200.json"

    def dump():
        path.write_text(json.dumps(res, indent=1, default=str))

    tmp = Path(tempfile.mkdtemp(prefix="prx-art-"))
    model = make_prx(FULL, dtype=torch.bfloat16, device="cuda")
    kw = Case((1024, 1024), 2).inputs(model.config, torch.bfloat16, "cuda")
    t0 = time.perf_counter()
    ct = compile_prx(model, **DEFAULT).build(kw)
    res["build_s"] = time.perf_counter() - t0
    globals()["_COMPILED"] = (model, ct)
    base = ct(**kw, return_dict=False)[0].clone()
    res["engines_before"] = ct.report()["engines"]
    res["ms_before"] = time_cuda(lambda: ct(**kw, return_dict=False))["ms"]
    a = make_random_lora(model, 64, seed=1, std=0.02)
    b = make_random_lora(model, 64, seed=2, std=0.02)
    res["lora"] = {
        "rank": 64,
        "layers": len(a) // 2,
        "targets": "img_qkv_proj txt_kv_proj to_out.0 gate/up/down_proj",
    }
    out_a = None

    def load_a():
        nonlocal out_a
        rep = load_lora(ct, a, "a")
        out_a = ct(**kw, return_dict=False)[0].clone()
        with torch.no_grad():
            ref_a = model(**kw, return_dict=False)[0]
        return {
            **rep.get("refit", {}),
            "rel_err_vs_eager_with_lora": rel_err(out_a, ref_a),
            "lora_effect_rel": rel_err(out_a, base),
        }

    _step(res, "load_a", load_a)
    _step(res, "ms_after_refit", lambda: time_cuda(lambda: ct(**kw, return_dict=False))["ms"])
    _step(res, "load_b", lambda: load_lora(ct, b, "b", 0.7).get("refit"))
    _step(res, "switch_to_b", lambda: set_lora(ct, "b").get("refit"))
    _step(res, "switch_back_to_a", lambda: set_lora(ct, "a").get("refit"))
    _step(res, "a_b_a_output_equal", lambda: bool(torch.equal(ct(**kw, return_dict=False)[0], out_a)))
    res["engines_after"], res["builds"] = ct.report()["engines"], ct.builds
    dump()

    def save():
        t0 = time.perf_counter()
        save_compiled(ct, tmp / "art")
        save_s = time.perf_counter() - t0
        save_file({k: v.contiguous() for k, v in kw.items()}, str(tmp / "inputs.safetensors"))
        save_file({"out": out_a.contiguous()}, str(tmp / "expected.safetensors"))
        gb = sum(f.stat().st_size for f in (tmp / "art").rglob("*") if f.is_file()) / 2**30
        return {"save_s": save_s, "artifact_gb": gb, "holds_lora_weights": True}

    _step(res, "save_after_lora", save)
    dump()
    _step(
        res,
        "load_in_new_process",
        lambda: _load_in_new_process(tmp / "art", tmp / "inputs.safetensors", tmp / "expected.safetensors"),
    )
    _step(res, "unload", lambda: unload_lora(ct).get("refit"))
    _step(res, "unload_output_equal_base", lambda: bool(torch.equal(ct(**kw, return_dict=False)[0], base)))
    dump()

    def cache():  # store the original-weight engines under their cache key, then compile_prx hits it
        cache_dir = tmp / "cache"
        probe = compile_prx(model, engine_cache_dir=str(cache_dir), **DEFAULT)
        example = probe._normalise(**kw)
        key = cache_key(probe, example)
        save_compiled(ct, cache_dir / key)
        t0 = time.perf_counter()
        probe.build(kw)
        hit_s = time.perf_counter() - t0
        out = probe(**kw, return_dict=False)[0]
        return {
            "hit_build_s": hit_s,
            "cache_hit": getattr(probe, "cache_hit", None),
            "output_equal": bool(torch.equal(out, base)),
            "compare_miss_build_s": res["build_s"],
        }

    _step(res, "engine_cache", cache)
    dump()
    print(json.dumps(res, indent=1, default=str)[:4000])


def pipeline(out: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline

    from prx_compile.testing import tiny_text_encoder, tiny_tokenizer

    model, ct = globals().get("_COMPILED") or (None, None)
    if model is None:  # the pipeline pads prompts to 256 tokens and doubles the batch for guidance
        model = make_prx(FULL, dtype=torch.bfloat16, device="cuda")
        ct = compile_prx(model, static=True, opt_batch=2, text_len=[256, 256])
    tok = tiny_tokenizer(256)
    enc = tiny_text_encoder(len(tok), model.config.context_in_dim).to("cuda", torch.bfloat16)
    pipe = PRXPipeline(
        transformer=model,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=enc,
        tokenizer=tok,
        vae=None,
    )
    args = dict(
        prompt="a red car on the moon at night",
        height=1024,
        width=1024,
        guidance_scale=4.0,
        output_type="latent",
        use_resolution_binning=False,
    )
    res: dict = {
        "env": environment(),
        "steps": 28,
        "note": "transformer 1.17 B bf16; text encoder small random",
    }

    def run(transformer, steps=28):
        pipe.transformer = transformer
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lat = pipe(**args, num_inference_steps=steps, generator=torch.Generator("cuda").manual_seed(0)).images
        torch.cuda.synchronize()
        return lat, time.perf_counter() - t0

    pipe.set_progress_bar_config(disable=True)
    run(model, 2)
    ref, res["eager_s"] = run(model)
    run(ct, 2)
    got, res["compile_prx_s"] = run(ct)
    res["compiled"] = {k: v for k, v in ct.report().items() if k != "torch_ops"}
    res["compile_config"] = {k: v for k, v in ct.compile_config.to_dict().items() if k != "device"}
    res["final_latents_rel_err"] = rel_err(got, ref)
    res["speedup_vs_eager"] = res["eager_s"] / res["compile_prx_s"]
    if time.time() - T0 < 240:
        tc = torch.compile(model)
        run(tc, 2)
        _, res["torch_compile_s"] = run(tc)
        res["speedup_vs_torch_compile"] = res["torch_compile_s"] / res["compile_prx_s"]
    kind = "static" if ct.compile_config.static else "dynamic"
    (out / f"pipeline_e2e_{kind}_h200.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--phases", nargs="+", default=["bench"])
    a = ap.parse_args()
    out = Path(a.out)
    for phase in a.phases:
        print(f"\n##### {phase} (t={time.time() - T0:.0f}s)", flush=True)
        try:
            globals()[phase](out)
        except Exception:
            traceback.print_exc()
    print(f"done in {time.time() - T0:.0f}s; files: {os.listdir(out)}")
