"""What the issues ask to measure on the GPU, in phases; every phase appends to JSON files in --out.

    python benchmarks/run_device.py --out $OUT --phases perf lora artifact

Phases (full-size PRX, 1.17 B, bf16, non-degenerate weights; pipeline text mask):
  perf        eager, torch.compile and compile_prx (default config and the static preset) at
              1024² b2, 1024² b1, 832x1216 b2; the bins preset at 512² b2; for each --weights mode.
              -> perf_<mode>.json
  peers       torch.compile(mode="max-autotune") at 1024² b2 with eager and compile_prx -> peers.json
  modes       the static preset with weights "inputs" and "engine" at 1024² b2, with eager
              -> modes_1024_b2.json
  lora        rank-64 LoRA over the 96 attention and MLP linears: load, switch, unload seconds, step
              time before and after, output against eager with the same LoRA -> lora_artifact.json
  artifact    save (size, seconds), load in a new process (seconds to a finished first step),
              bit-identical outputs; GPU memory with one engine set and with three -> lora_artifact.json
Each speedup in a file is a ratio of numbers from the same process and run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from prx_compile import compile_prx, load_lora, save_compiled, set_lora, unload_lora
from prx_compile.bench import Case, compile_path, environment, rel_err, run_bench, table, time_cuda
from prx_compile.lora import make_random_lora
from prx_compile.testing import FULL_PRX, make_prx

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.0f} s] {msg}", flush=True)


def full_model():
    return make_prx(FULL_PRX, dtype=torch.bfloat16, device="cuda")


def perf(out: Path, modes: list[str], peers: bool) -> None:
    model = full_model()
    shapes = [Case((1024, 1024), 2), Case((1024, 1024), 1), Case((832, 1216), 2)]
    for mode in modes:
        cache = tempfile.mkdtemp()  # the static preset's set is the default's 1024² b2 set: built once
        paths = {} if not peers else {"eager": lambda m: m, "torch.compile": lambda m: torch.compile(m)}
        paths[f"compile_prx[default,{mode}]"] = compile_path(None, weights=mode, engine_cache_dir=cache)
        res = run_bench(shapes, paths, model=model, out_json=out / f"perf_{mode}.json")
        static = run_bench(
            shapes[:1],
            {
                f"compile_prx[static,{mode}]": compile_path(
                    "prx-1024-bf16-static", weights=mode, engine_cache_dir=cache
                )
            },
            model=model,
        )
        small = [Case((512, 512), 2)]
        small_paths = {} if not peers else {"eager": lambda m: m, "torch.compile": lambda m: torch.compile(m)}
        small_paths[f"compile_prx[prx-bins-bf16,{mode}]"] = compile_path("prx-bins-bf16", weights=mode)
        bins = run_bench(small, small_paths, model=model)
        res["records"] += static["records"] + bins["records"]
        (out / f"perf_{mode}.json").write_text(json.dumps(res, indent=1, default=str))
        print(table(res), flush=True)
        peers = False  # eager and torch.compile once per run


def modes(out: Path) -> None:
    """Both weights modes at 1024² b2 with the static preset, against eager, in one process."""
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "compile_prx[static,inputs]": compile_path("prx-1024-bf16-static", weights="inputs"),
            "compile_prx[static,engine]": compile_path("prx-1024-bf16-static", weights="engine"),
        },
        model=full_model(),
        out_json=out / "modes_1024_b2.json",
    )
    print(table(res), flush=True)


def max_autotune(out: Path) -> None:
    model = full_model()
    res = run_bench(
        [Case((1024, 1024), 2)],
        {
            "eager": lambda m: m,
            "compile_prx[default,inputs]": compile_path(None),
            "torch.compile-max-autotune": lambda m: torch.compile(m, mode="max-autotune"),
        },
        model=model,
        out_json=out / "peers.json",
    )
    print(table(res), flush=True)


def lora_and_artifact(out: Path, phases: list[str]) -> None:
    model = full_model()
    case = Case((1024, 1024), 2)
    kw = case.inputs(model.config, torch.bfloat16, "cuda")
    result: dict = {"env": environment(), "records": []}
    path_file = out / "lora_artifact.json"

    def save():
        path_file.write_text(json.dumps(result, indent=1, default=str))

    ct = compile_prx(model)  # the default: weights as inputs
    t0 = time.perf_counter()
    base = ct(**kw, return_dict=False)[0].clone()
    build_s = time.perf_counter() - t0
    step = lambda: ct(**kw, return_dict=False)  # noqa: E731
    if "lora" in phases:
        before = time_cuda(step)["ms"]
        a = make_random_lora(model, 64, seed=1, std=0.02)
        b = make_random_lora(model, 64, seed=2, std=0.02)
        timings = {}
        for label, fn in (
            ("load_s", lambda: load_lora(ct, a, "a")),
            ("load_b_s", lambda: load_lora(ct, b, "b", scale=0.0)),
            ("switch_s", lambda: set_lora(ct, "b")),
            ("switch_back_s", lambda: set_lora(ct, "a")),
        ):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = fn()
            torch.cuda.synchronize()
            timings[label] = time.perf_counter() - t0
            timings[label + "_layers"] = rep.get("changed")
        out_a = ct(**kw, return_dict=False)[0].clone()
        with torch.no_grad():
            ref_a = model(**kw, return_dict=False)[0]
        after = time_cuda(step)["ms"]
        set_lora(ct, "b")
        set_lora(ct, "a")
        a_again = torch.equal(ct(**kw, return_dict=False)[0], out_a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        unload_lora(ct)
        torch.cuda.synchronize()
        timings["unload_s"] = time.perf_counter() - t0
        result["records"].append(
            {
                "path": "lora",
                "weights": "inputs",
                "rank": 64,
                "linears": len([k for k in a if k.endswith("lora_A.weight")]),
                **timings,
                "ms_per_step_before": before,
                "ms_per_step_after": after,
                "rel_err_vs_eager_with_lora": rel_err(out_a, ref_a),
                "lora_effect_rel": rel_err(out_a, base),
                "a_b_a_bitexact": a_again,
                "unload_bitexact": torch.equal(ct(**kw, return_dict=False)[0], base),
                "builds": ct.builds,
            }
        )
        save()
        log(f"lora: {result['records'][-1]}")
    if "artifact" in phases:
        mem_one = torch.cuda.mem_get_info()
        load_lora(ct, make_random_lora(model, 64, seed=3, std=0.02), "c", 0.7)
        expected = ct(**kw, return_dict=False)[0].clone()
        tmp = Path(tempfile.mkdtemp())
        t0 = time.perf_counter()
        save_compiled(ct, tmp / "art")  # builds the other two engine sets first
        save_s = time.perf_counter() - t0
        build_all_s = sum(b.build_s or 0 for b in ct.backends)
        mem_three = torch.cuda.mem_get_info()
        size = sum(p.stat().st_size for p in (tmp / "art").rglob("*") if p.is_file())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        torch.save({k: v.cpu() for k, v in kw.items()}, tmp / "kw.pt")
        torch.save(expected.cpu(), tmp / "expected.pt")
        code = f"""
import json, time, torch
t_import = time.perf_counter()
import prx_compile
from prx_compile import load_compiled
t_import = time.perf_counter() - t_import
t0 = time.perf_counter()
ct = load_compiled({str(tmp / "art")!r})
load_s = time.perf_counter() - t0
kw = {{k: v.cuda() for k, v in torch.load({str(tmp / "kw.pt")!r}).items()}}
out = ct(**kw, return_dict=False)[0]
torch.cuda.synchronize()
first = time.perf_counter() - t0
want = torch.load({str(tmp / "expected.pt")!r}).cuda()
print(json.dumps({{"import_s": t_import, "load_s": load_s, "load_to_first_step_s": first,
                  "bitexact": bool(torch.equal(out, want)), "builds": ct.builds}}))
"""
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        loaded = (
            json.loads(p.stdout.strip().splitlines()[-1])
            if p.returncode == 0
            else {"error": p.stderr[-3000:]}
        )
        result["records"].append(
            {
                "path": "artifact",
                "weights": "inputs",
                "size_gb": size / 1e9,
                "weights_gb": weights / 1e9,
                "save_s": save_s,
                "engine_sets": len(ct.backends),
                "build_s_all_sets": build_all_s,
                "first_set_build_s": build_s,
                "gpu_mem_used_gb_one_set": (mem_one[1] - mem_one[0]) / 2**30,
                "gpu_mem_used_gb_three_sets": (mem_three[1] - mem_three[0]) / 2**30,
                **{
                    k: loaded.get(k)
                    for k in ("import_s", "load_s", "load_to_first_step_s", "bitexact", "builds", "error")
                },
                "first_step_s": (loaded["load_to_first_step_s"] - loaded["load_s"])
                if "load_s" in loaded
                else None,
            }
        )
        save()
        log(f"artifact: {result['records'][-1]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", nargs="+", default=["perf"])
    ap.add_argument("--weights", nargs="+", default=["inputs", "engine"])
    ap.add_argument("--no-peers", action="store_true", help="perf without eager and torch.compile")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = {
        "perf": lambda: perf(args.out, args.weights, not args.no_peers),
        "peers": lambda: max_autotune(args.out),
        "modes": lambda: modes(args.out),
        "lora": lambda: lora_and_artifact(args.out, args.phases),
    }
    if "artifact" in args.phases and "lora" not in args.phases:
        jobs["artifact"] = lambda: lora_and_artifact(args.out, args.phases)
    for phase in args.phases:
        if phase not in jobs:
            continue
        log(f"phase {phase}")
        try:
            jobs[phase]()
        except Exception:
            traceback.print_exc()
            (args.out / f"error_{phase}.txt").write_text(traceback.format_exc())
        torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
