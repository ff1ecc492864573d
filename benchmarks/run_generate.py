"""Issue 14 on the device: `prx-compile generate` on 1 GPU and on 2, the same 16 prompts, one engine cache.

    source .device-kit/env.sh && python benchmarks/run_generate.py --out $OUT

Full-size PRX (1.17 B, random non-degenerate weights, bf16; ``--random-full``: a small random text
encoder with 256 tokens and an 8x VAE), 1024², 28 steps, guidance 4, the ``prx-1024-bf16-static``
preset (its one engine set: 1024² at batch 2, which guidance needs). Three runs of
``python -m prx_compile generate`` over one engine cache that starts empty:

  1. 2 GPUs, cold cache: one process builds the engine set, the other waits for it and loads it
     (the build count per rank shows "one build per host, not one per process");
  2. 1 GPU (``--num-processes 1``): loads the set; the reference PNGs;
  3. 2 GPUs, warm cache: the 2-GPU speed.

Every PNG of the 2-GPU runs is compared with the 1-GPU run's byte by byte. Writes
``generate_h200x2.json`` to --out: one record per run, ``{"path": "generate", "gpus": N, "images": 16,
"images_per_s": ..., "identical_to_1gpu": ...}`` plus engine builds and loads per rank and seconds.
``images_per_s`` is the summary's: images / (last rank's end - first rank's start of generation),
with the ranks starting together once all are loaded; process start, model load, engine builds and
loads and the warm-up step are outside it. ``command_s`` is the whole command's wall time.

``--tiny`` runs the same script with the tiny model (eager backend, 2 steps, 32²; a CPU is enough)
to check it; it writes ``generate_tiny.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "a red car on the moon at night",
    "an astronaut riding a horse",
    "a cat in a city at night",
    "a blue robot in a forest",
    "a castle on a mountain at sunset",
    "a painting of the ocean",
    "a portrait of a dog",
    "a green river in a forest",
    "a city at night, painting",
    "a robot riding a horse on the moon",
    "a sunset over the sky",
    "a red castle by the river",
    "a photo of a blue car",
    "a mountain forest at night",
    "an ocean sunset painting",
    "a cat and a dog on a red car",
]


def log(msg: str) -> None:
    print(f"[run_generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate(label: str, gpus: int, model: list[str], work: Path, out: Path) -> dict:
    """One `generate` run; its summary (or the error) and the command's wall time."""
    images = work / f"images-{label}"
    summary_path = work / f"summary-{label}.json"
    cmd = [sys.executable, "-m", "prx_compile", "generate", *model]
    cmd += ["--prompts-file", str(work / "prompts.txt"), "--out-dir", str(images)]
    cmd += ["--num-processes", str(gpus), "--summary", str(summary_path)]
    env = {**os.environ, "PRX_COMPILE_CACHE": str(work / "engines")}
    log(f"{label}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    command_s = time.perf_counter() - t0
    (out / f"generate_{label}.log").write_text(
        f"$ {' '.join(cmd)}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    )
    log(f"{label}: exit {r.returncode} in {command_s:.1f} s\n{r.stdout.strip()}")
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return {"images_dir": images, "summary": summary, "exit_code": r.returncode, "command_s": command_s}


def record(label: str, gpus: int, cache: str, run: dict, reference: dict | None) -> dict:
    """The results record of one run (the issue's layout first)."""
    s = run["summary"] or {}
    ranks = s.get("ranks", [])
    pngs = {p.name: p.read_bytes() for p in sorted(run["images_dir"].glob("*.png"))}
    identical = reference is not None and bool(pngs) and pngs == reference
    return {
        "path": "generate",
        "gpus": gpus,
        "images": s.get("images", 0),
        "images_per_s": s.get("images_per_s"),
        "identical_to_1gpu": identical,
        "run": label,
        "engine_cache": cache,
        "engine_builds": [r.get("engine_builds") for r in ranks],
        "engine_cache_loads": [r.get("engine_cache_loads") for r in ranks],
        "generate_s": s.get("generate_s"),
        "images_per_s_sum_of_ranks": s.get("images_per_s_sum_of_ranks"),
        "ranks": [
            {
                k: r.get(k)
                for k in (
                    "rank",
                    "device",
                    "status",
                    "setup_s",
                    "generate_s",
                    "images_per_s",
                    "written",
                    "failed",
                )
            }
            for r in ranks
        ],
        "missing": s.get("missing"),
        "exit_code": run["exit_code"],
        "command_s": round(run["command_s"], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the results JSON and the logs")
    p.add_argument("--work", help="folder for the PNGs and the engine cache (default: a temporary one)")
    p.add_argument("--tiny", action="store_true", help="the tiny model, 2 steps, 32² (checks the script)")
    p.add_argument("--gpus", type=int, default=2, help="the processes of the multi-GPU runs")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="prx-generate-"))
    if (work / "engines").exists():
        shutil.rmtree(work / "engines")  # the first run must start from an empty cache
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    if args.tiny:
        model = ["--tiny", "--steps", "2"]
        name = "generate_tiny.json"
    else:
        model = ["--random-full", "--config", "prx-1024-bf16-static", "--steps", "28"]
        model += ["--height", "1024", "--width", "1024", "--guidance", "4.0"]
        name = "generate_h200x2.json"
    n = args.gpus
    cold = generate(f"{n}gpu-cold", n, model, work, out)
    one = generate("1gpu", 1, model, work, out)
    warm = generate(f"{n}gpu-warm", n, model, work, out)
    reference = {p.name: p.read_bytes() for p in sorted(one["images_dir"].glob("*.png"))}
    records = [
        record(f"{n}gpu-cold", n, "empty at start", cold, reference),
        record("1gpu", 1, "filled by the cold run", one, reference),
        record(f"{n}gpu-warm", n, "filled by the cold run", warm, reference),
    ]
    one_rate, warm_rate = records[1]["images_per_s"], records[2]["images_per_s"]
    result = {
        "issue": 14,
        "model": "tiny PRX, eager" if args.tiny else "PRX 1.17 B random weights, bf16, --random-full",
        "command": " ".join(["python -m prx_compile generate", *model, "--num-processes N"]),
        "prompts": len(PROMPTS),
        "timing": "images_per_s: images / (last rank's end - first rank's start of generation), ranks "
        "start together once all are loaded; process start, model load, engine build/load and the "
        "warm-up step are outside it. command_s: the whole command.",
        "speedup_warm_over_1gpu": round(warm_rate / one_rate, 3) if one_rate and warm_rate else None,
        "goal_speedup": 1.9,
        "engine_builds_cold_run": sum(b or 0 for b in records[0]["engine_builds"]),
        "host": platform.node(),
        "records": records,
    }
    try:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        result["torch"] = torch.__version__
    except Exception as e:  # the numbers above stand without it
        result["gpu"] = f"unknown ({type(e).__name__})"
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out / name}")
    for rec in records:
        log(
            f"{rec['run']:>10}: {rec['images']} images, {rec['images_per_s']} images/s, identical to 1 GPU: "
            f"{rec['identical_to_1gpu']}, engine builds per rank {rec['engine_builds']}, loads "
            f"{rec['engine_cache_loads']}, command {rec['command_s']} s"
        )
    log(
        f"speedup {n} GPUs (warm) / 1 GPU: {result['speedup_warm_over_1gpu']} (goal {result['goal_speedup']})"
    )
    ok = all(rec["exit_code"] == 0 and rec["identical_to_1gpu"] for rec in records)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
