"""generate over several processes (gloo on a CPU, the tiny model, the eager backend): the same PNGs
as one process, a killed rank reported as missing prompts and filled in by a rerun, a failing prompt
that does not stop the others, and one-line errors for bad input."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prx_compile import ConfigError
from prx_compile.tools.generate import generate_images, image_name, shares

from ._cli import run_cli

#: a folder whose sitecustomize.py kills the worker of rank $PRX_TEST_KILL_RANK (see the file)
KILL_RANK = str(Path(__file__).parent / "kill_rank")

# words of the tiny tokenizer's vocabulary; 7 prompts: 2 ranks take 4 and 3
PROMPTS = [
    "a red car on the moon",
    "a cat",
    "an astronaut riding a horse",
    "a blue robot",
    "a castle at night",
    "a green forest river",
    "a dog",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate")
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def generate_args(work, *args):
    return ["generate", "--prompts-file", str(work / "prompts.txt"), "--steps", "2", *args]


def run(work, *args, env=None):
    """prx-compile generate on the tiny model (2 steps), sharing one engine cache in ``work``: main() in
    this process (``--num-processes`` starts its workers as real processes all the same)."""
    return run_cli(
        *generate_args(work, *args), env={"PRX_COMPILE_CACHE": str(work / "engines"), **(env or {})}
    )


def pngs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


@pytest.fixture(scope="module")
def reference(work):
    """The PNGs one process writes."""
    r = run(work, "--out-dir", str(work / "one"))
    assert r.returncode == 0, r.stderr
    images = pngs(work / "one")
    assert list(images) == [image_name(i, p) for i, p in enumerate(PROMPTS)]
    assert len(set(images.values())) == len(PROMPTS)  # seed + index: every image differs
    return images


def test_two_processes_write_the_same_pngs_as_one(work, reference, capfd):
    """The launcher in this process, its two workers real processes (python -m prx_compile, their
    stderr this process's fd 2); the reference is one process's PNGs."""
    out = work / "two"
    fresh_cache = {"PRX_COMPILE_CACHE": str(work / "engines-two")}
    r = run(work, "--num-processes", "2", "--out-dir", str(out), env=fresh_cache)
    workers = capfd.readouterr().err
    assert r.returncode == 0, r.stderr + workers
    assert "Traceback" not in r.stderr + workers
    assert pngs(out) == reference  # byte for byte
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["processes"], summary["images"], summary["written"], summary["missing"]) == (2, 7, 7, [])
    ranks = summary["ranks"]
    assert [(r["rank"], r["share"], r["written"]) for r in ranks] == [
        (0, [0, 4], [0, 1, 2, 3]),
        (1, [4, 7], [4, 5, 6]),
    ]
    assert len({r["pid"] for r in ranks}) == 2 and all(r["images_per_s"] > 0 for r in ranks)
    # the cores one process would use, shared out: images/s of 1 and N processes compare alike
    if "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // 2)
        assert {r["torch_threads"] for r in ranks} == {share} and summary["torch_threads"] == [share]
        assert f"{os.cpu_count()} CPU cores with {share} torch thread(s) each" in summary["timing"]
    # one engine cache on the host: whichever rank came first built the engine set, the other loaded it
    assert sorted((r["engine_builds"], r["engine_cache_loads"]) for r in ranks) == [(0, 1), (1, 0)]
    # one progress bar for the job (the coordinator's); rank 0's engine builds in lines naming it
    # (0.27's workers were quiet: minutes of builds showed nothing), nothing from rank 1; the
    # summary on stdout
    assert not [line for line in workers.splitlines() if line.startswith("prx-compile: ")], workers
    assert "prx-compile [rank 0]: engine set 1/" in workers and "[rank 1]" not in workers, workers
    progress_lines = [line for line in r.stderr.splitlines() if line.startswith("prx-compile: ")]
    assert progress_lines, r.stderr
    assert all(line.startswith("prx-compile: generate: ") for line in progress_lines), r.stderr
    assert progress_lines[-1].startswith("prx-compile: generate: 7/7 images")
    assert "7/7 images in" in r.stdout and "rank 1 (" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted([*reference, ".prx-generate", "summary.json"])
    assert [p.name for p in (out / ".prx-generate").iterdir()] == [
        "made.json"
    ]  # what made them; no leftovers


def test_a_rank_that_dies_before_joining_stops_the_others_at_once(work, capfd):
    """0.26 let the others wait for it in the rendezvous for 10 minutes, then fail."""
    out = work / "early"
    t0 = time.monotonic()
    path = os.pathsep.join(p for p in (KILL_RANK, os.environ.get("PYTHONPATH")) if p)
    kill = {"PRX_TEST_KILL_RANK": "1", "PRX_TEST_KILL_EARLY": "1", "PYTHONPATH": path}
    r = run(work, "--num-processes", "2", "--out-dir", str(out), env=kill)
    assert time.monotonic() - t0 < 120, r.stderr  # not START_TIMEOUT_S
    capfd.readouterr()
    assert r.returncode == 1, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"][1]["status"] == "killed by SIGKILL"
    assert "ended before the processes could start together" in summary["ranks"][0]["status"]
    assert len(summary["missing"]) == 7


def test_a_killed_rank_is_reported_and_a_rerun_fills_it_in(work, reference, capfd):
    """The launcher in this process, its workers real processes (their stderr is this process's fd 2);
    rank 1 is killed by ``tests/kill_rank/sitecustomize.py`` once loaded, before its first image."""
    out = work / "killed"
    t0 = time.monotonic()
    path = os.pathsep.join(p for p in (KILL_RANK, os.environ.get("PYTHONPATH")) if p)
    kill = {"PRX_TEST_KILL_RANK": "1", "PYTHONPATH": path}
    r = run(work, "--num-processes", "2", "--out-dir", str(out), env=kill)
    assert time.monotonic() - t0 < 120  # no hang
    workers = capfd.readouterr().err
    assert r.returncode == 1, r.stderr + workers
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("prx-compile: error: 3 of 7 images are missing"), r.stderr
    assert "Traceback" not in r.stderr + workers
    summary = json.loads((out / "summary.json").read_text())
    assert [m["index"] for m in summary["missing"]] == [4, 5, 6]  # exactly rank 1's prompts
    assert [m["prompt"] for m in summary["missing"]] == PROMPTS[4:]
    assert all(m["rank"] == 1 and "killed by SIGKILL" in m["reason"] for m in summary["missing"])
    assert summary["ranks"][1]["status"] == "killed by SIGKILL"
    assert summary["ranks"][0]["written"] == [0, 1, 2, 3]
    assert "a castle at night" in r.stdout  # the missing prompts are printed too
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
    assert sorted(kept) == sorted(list(reference)[:4])

    r = run(work, "--num-processes", "2", "--out-dir", str(out))  # --resume is the default
    assert r.returncode == 0, r.stderr + capfd.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["written"], summary["skipped"], summary["missing"]) == (3, 4, [])
    rank0, rank1 = summary["ranks"]
    assert rank0["skipped"] == [0, 1, 2, 3] and rank0["setup_s"] is None  # nothing to do: no model loaded
    assert rank1["written"] == [4, 5, 6]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.png") if p.name in kept} == kept  # untouched
    assert pngs(out) == reference


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from prx_compile import compile_prx
    from prx_compile.tools.generate import generate_images
    from prx_compile.tools.testing import tiny_pipeline

    class FailsOnRobots:
        '''The tiny pipeline, except that a prompt with "robot" raises (as a CUDA error or OOM would).'''

        def __init__(self, pipe):
            self.pipe, self.transformer, self.vae_scale_factor = pipe, pipe.transformer, pipe.vae_scale_factor

        def set_progress_bar_config(self, **kw):
            self.pipe.set_progress_bar_config(**kw)

        def __call__(self, prompt, **kw):
            if "robot" in prompt:
                raise RuntimeError("the robot broke the pipeline\\nsecond line")
            return self.pipe(prompt=prompt, **kw)

    def factory(device):
        pipe = tiny_pipeline().to(device)
        pipe.transformer = compile_prx(
            pipe.transformer, backend="eager", resolution=32, vae_scale_factor=1, aspect_bins=[],
            text_len=[1, 16], specialize=[[32, 32, 2]],
        )
        return FailsOnRobots(pipe)

    prompts = sys.argv[2:]
    result = generate_images(
        factory, prompts, sys.argv[1], steps=2, height=32, width=32,
        pipeline_kwargs={"use_resolution_binning": False},
    )
    print(json.dumps({"kind": result["kind"], "missing": result.get("missing")}))
    """
)


def test_api_under_a_torchrun_style_launch_a_failing_prompt_does_not_stop_the_others(work, tmp_path):
    """Two processes as accelerate launch / torchrun start them (rank 0 coordinates): the prompt that
    raises is reported with its error, every other image is written, the ranks exit 0."""
    (tmp_path / "job.py").write_text(SCRIPT)
    out = tmp_path / "out"
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "job.py"), str(out), *PROMPTS],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    main, other = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results)
    assert main["kind"] == "summary" and other == {"kind": "rank", "missing": None}
    assert [(m["index"], m["rank"]) for m in main["missing"]] == [(3, 0)]  # "a blue robot", rank 0's share
    assert main["missing"][0]["reason"] == "RuntimeError: the robot broke the pipeline"
    assert sorted(pngs(out)) == [image_name(i, p) for i, p in enumerate(PROMPTS) if i != 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"][0]["failed"] == {"3": "RuntimeError: the robot broke the pipeline"}
    assert summary["ranks"][1]["written"] == [4, 5, 6]
    # the ranks' records live on in the summary only; what made the images stays for a resume
    assert [p.name for p in (out / ".prx-generate").iterdir()] == ["made.json"]


def test_help_says_how_seeds_are_chosen_and_bad_input_is_one_line(work, tmp_path):
    r = run_cli("generate", "--help")
    text = " ".join(r.stdout.split())
    assert "image i (the prompt's index) uses seed + i, whatever the process count" in text
    assert "--num-processes N" in text and "--no-resume" in text and "accelerate launch" in text
    for args, message in (
        (["--num-processes", "0"], "--num-processes 0: must be 1 or more"),
        (["--num-processes", "2", "--prompts-file", str(tmp_path / "none.txt")], "none.txt does not exist"),
    ):
        r = run(work, *args, "--out-dir", str(tmp_path / "o"))
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("prx-compile: error:") and message in last, r.stderr
        assert "Traceback" not in r.stderr
    r = run_cli("generate", "--num-processes", "2")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("prx-compile: error: no prompt given"), r.stderr
    with pytest.raises(ConfigError, match="no prompt given"):
        generate_images(lambda device: None, [], tmp_path / "o")
    with pytest.raises(ConfigError, match="steps=0"):
        generate_images(lambda device: None, ["a cat"], tmp_path / "o", steps=0)
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_shares_and_names_do_not_depend_on_the_process_count():
    for count in (0, 1, 7, 16, 101):
        for world in (1, 2, 3, 8):
            parts = shares(count, world)
            assert [i for part in parts for i in part] == list(range(count))  # contiguous, in order
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
            sizes = [len(part) for part in parts]
            assert sorted(sizes, reverse=True) == sizes  # the first ranks take one more
    assert image_name(7, "A Cat, at night!") == "007-a-cat-at-night.png"
    assert image_name(1007, "???") == "1007-image.png"


def test_records_and_status_folders_read_from_disk_are_checked(tmp_path):
    from prx_compile.tools.generate import (
        STATUS_DIR,
        _read_json,
        _remove_old_runs,
        _status_root,
        _valid_record,
    )

    good = {
        "kind": "rank",
        "rank": 1,
        "host": "h",
        "device": "cpu",
        "written": [3],
        "skipped": [],
        "failed": {},
        "setup_s": 1.0,
        "generate_s": 2.0,
        "images_per_s": 0.5,
        "generate_start": 10.0,
        "generate_end": 12.0,
        "engine_builds": None,
        "engine_cache_loads": None,
    }
    assert _valid_record(good, 1) and not _valid_record(good, 0)
    for key, bad in (
        ("written", ["3"]),
        ("failed", {"3": 4}),
        ("generate_end", None),
        ("host", 7),
        ("host", "h" * 10_000),  # sizes are bounded
        ("images_per_s", float("nan")),
        ("unexpected", 1),  # the record's keys are exactly those _run_share writes
    ):
        assert not _valid_record({**good, key: bad}, 1), key
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "real.json").write_text('{"a": 1}')
    os.symlink(tmp_path / "real.json", tmp_path / "link.json")
    assert _read_json(tmp_path / "fifo.json") is None  # no hang
    assert _read_json(tmp_path / "link.json") is None and _read_json(tmp_path / "real.json") == {"a": 1}
    # old runs are removed, a live one (this process) and anything not named like a run are kept
    root = tmp_path / "out" / STATUS_DIR
    for name in ("0123456789abcdef", "fedcba9876543210", "keep-me.txt"):
        (root / name).mkdir(parents=True)
    live = {"rank": 0, "host": socket.gethostname(), "pid": os.getpid()}
    (root / "fedcba9876543210" / "rank-0.start.json").write_text(json.dumps(live))
    _remove_old_runs(tmp_path / "out", keep="new")
    assert sorted(p.name for p in root.iterdir()) == ["fedcba9876543210", "keep-me.txt"]
    (tmp_path / "o2").mkdir()
    os.symlink(tmp_path, tmp_path / "o2" / STATUS_DIR)
    with pytest.raises(ConfigError, match="link"):
        _status_root(tmp_path / "o2")


# -- issue 26: prompts split on "\n" alone, only regular PNGs, records only from this run ----------
def test_prompts_file_is_split_on_newlines_alone(tmp_path):
    from prx_compile.tools.cli import CLIError, read_prompts

    f = tmp_path / "p.txt"
    f.write_bytes("a\x0cb\nc\x1cd\r\ne\x85f\u2028g\n\n  h  \r\n".encode())
    assert read_prompts(f) == ["a\x0cb", "c\x1cd", "e\x85f\u2028g", "h"]  # splitlines() makes 8
    f.write_bytes(b"a cat\n\xff\xfe dog\n")
    with pytest.raises(CLIError, match=r"p\.txt is not UTF-8 text \(byte 6: b'\\xff\\xfe d'\)") as e:
        read_prompts(f)
    assert "\n" not in str(e.value)


def test_only_regular_png_files_count_as_images(tmp_path):
    from PIL import Image

    from prx_compile.tools.generate import _finished

    out = tmp_path / "o"
    out.mkdir()
    (out / "000-a.png").mkdir()  # a folder named like an image
    Image.new("RGB", (4, 4)).save(tmp_path / "real.png")
    (out / "001-b.png").symlink_to(tmp_path / "real.png")
    Image.new("RGB", (4, 4)).save(out / "002-c.png")
    assert _finished(out, ["000-a.png", "001-b.png", "002-c.png"], True, 0.0) == [False, False, True]

    class Pipe:
        transformer = None

        def __call__(self, **kw):
            return type("Out", (), {"images": [Image.new("RGB", (4, 4))]})()

    summary = generate_images(lambda device: Pipe(), ["a"], out, steps=1, show_progress=False)
    assert summary["images"] == 0 and [m["index"] for m in summary["missing"]] == [0]
    assert "IsADirectoryError" in summary["missing"][0]["reason"] and (out / "000-a.png").is_dir()


def test_records_without_the_run_token_are_ignored_with_a_warning(tmp_path, caplog):
    from prx_compile.tools.generate import _coordinate, _JobBar

    token = "0123456789abcdef0123456789abcdef"
    record = {
        "kind": "rank",
        "host": "h",
        "device": "cpu",
        "written": [0],
        "skipped": [],
        "failed": {},
        "generate_s": 1.0,
        "images_per_s": 1.0,
        "generate_start": 1.0,
        "generate_end": 2.0,
    }
    (tmp_path / "rank-0.json").write_text(json.dumps({**record, "rank": 0}))  # forged: no token
    (tmp_path / "rank-1.json").write_text(
        json.dumps({**record, "rank": 1, "token": "f" * 32})
    )  # another run's
    (tmp_path / "rank-2.json").write_text(json.dumps({**record, "rank": 2, "written": [], "token": token}))
    with caplog.at_level("WARNING", logger="prx_compile.tools.generate"):
        records, ended, _ = _coordinate(
            ["a", "b", "c"],
            ["000-a.png", "001-b.png", "002-c.png"],
            tmp_path,
            tmp_path,
            3,
            lambda r: "exited with code 0",
            _JobBar(3, 0, False),
            token=token,
            resume=True,
            since=0.0,
        )
    assert list(records) == [2] and "token" not in records[2]
    assert ended == {0: "exited with code 0", 1: "exited with code 0"}
    warned = [r.getMessage() for r in caplog.records]
    assert sum("rank-0.json is not from this run" in m for m in warned) == 1
    assert sum("rank-1.json is not from this run" in m for m in warned) == 1


class _Image:
    def __init__(self, seed):
        self.seed = seed

    def save(self, f, format):  # noqa: A002 - PIL's name
        from PIL import Image

        Image.new("RGB", (4, 4), (self.seed % 256, 0, 0)).save(f, format=format)


class _Pipe:
    """A stand-in pipeline: a 4x4 PNG whose colour is the call's seed (what the checks below read)."""

    calls = 0
    transformer = None  # not compiled: the size is the call's

    def __call__(self, prompt, generator, **kw):
        _Pipe.calls += 1

        class Out:
            images = [_Image(int(generator.initial_seed()))]

        return Out()


def test_a_resume_keeps_only_images_this_run_would_make(tmp_path):
    """0.26 kept any file with an image's name: images of other settings (reported as this run's),
    of another prompt with the same first 40 letters, a copy cut short."""
    out = tmp_path / "out"
    job = dict(steps=2, height=4, width=4, show_progress=False)
    assert generate_images(lambda d: _Pipe(), ["a cat", "a dog"], out, **job)["missing"] == []
    with pytest.raises(ConfigError, match=r"holds images made with other settings \(seed, steps\)"):
        generate_images(lambda d: _Pipe(), ["a cat", "a dog"], out, **{**job, "steps": 7}, seed=99)
    with pytest.raises(ConfigError, match=r"000-a-cat.png was made for another prompt \(1 image"):
        generate_images(lambda d: _Pipe(), ["A CAT!", "a dog"], out, **job)  # the same file name
    calls = _Pipe.calls
    (out / "001-a-dog.png").write_bytes((out / "001-a-dog.png").read_bytes()[:20])  # cut short
    summary = generate_images(lambda d: _Pipe(), ["a cat", "a dog", "a fox"], out, **job)
    assert summary["missing"] == [] and _Pipe.calls == calls + 2  # the cut copy and the new prompt
    # --no-resume makes them all, and records the new settings once every image is made
    generate_images(lambda d: _Pipe(), ["a cat", "a dog", "a fox"], out, **{**job, "steps": 7}, resume=False)
    generate_images(lambda d: _Pipe(), ["a cat", "a dog", "a fox"], out, **{**job, "steps": 7})
    assert _Pipe.calls == calls + 5


@pytest.mark.parametrize(
    "prompts, seed, match",
    [
        (["x" * 10_001], 0, "prompt 0 has 10001 characters, more than 10000"),
        (["a", "b"], 2**63 - 1, r"seed=9223372036854775807: image i uses seed \+ i"),
        (["a"], -1, r"seed=-1: image i uses seed \+ i"),
    ],
)
def test_prompts_and_seeds_torch_cannot_take_are_refused_before_any_work(tmp_path, prompts, seed, match):
    with pytest.raises(ConfigError, match=match):
        generate_images(lambda d: pytest.fail("no model loaded"), prompts, tmp_path, seed=seed)


def test_a_rank_record_over_a_megabyte_is_read_whole(tmp_path):
    """120,000 prompts all made already: the record lists them (1 MB), and 0.26 read it cut short,
    then waited for it forever."""
    prompts = [f"p{i}" for i in range(120_000)]
    out = tmp_path / "out"
    out.mkdir()
    with open(tmp_path / "one.png", "wb") as f:
        _Image(1).save(f, "PNG")
    data = (tmp_path / "one.png").read_bytes()
    for i, p in enumerate(prompts):
        (out / image_name(i, p)).write_bytes(data)
    t = time.perf_counter()
    summary = generate_images(lambda d: pytest.fail("no model loaded"), prompts, out, show_progress=False)
    assert summary["missing"] == [] and summary["images"] == 120_000
    assert time.perf_counter() - t < 120


def test_temporary_files_killed_processes_left_are_removed_at_the_next_run(tmp_path):
    """A process killed while writing an image leaves ``write_atomic``'s temporary file (0.27 kept it
    for good). The next run removes the job's stale ones, and nothing else: another job's, fresh ones
    (a run writing now) and links stay."""
    out = tmp_path / "out"
    status = out / ".prx-generate"
    status.mkdir(parents=True)
    old = time.time() - 3600
    names = [image_name(0, "a cat"), "summary.json"]
    stale = [out / f".{n}.0123456789ab.tmp" for n in names] + [status / ".made.json.aaaaaaaaaaaa.tmp"]
    kept = [
        out / f".{image_name(0, 'a cat')}.ffffffffffff.tmp",  # fresh: a run writing now
        out / ".notes.txt.0123456789ab.tmp",  # not this job's
        out / f".{image_name(0, 'a cat')}.xyz.tmp",  # not write_atomic's name
    ]
    for f in stale + kept:
        f.write_bytes(b"x")
    for f in stale + kept[1:]:
        os.utime(f, (old, old))
    link = out / f".{image_name(0, 'a cat')}.aaaaaaaaaaaa.tmp"
    link.symlink_to(tmp_path / "elsewhere")
    generate_images(lambda d: _Pipe(), ["a cat"], out, steps=2, height=4, width=4, show_progress=False)
    assert not any(f.exists() for f in stale)
    assert all(f.exists() for f in kept) and link.is_symlink()
