"""Prompts to PNG files in one or many processes (one per GPU, on one machine or several), with accelerate.

    from prx_compile import compile_prx
    from prx_compile.tools.generate import generate_images
    from prx_compile.tools.pipeline import load_pipeline

    def make_pipe(device):                       # called once per process, with its device
        pipe = load_pipeline("path/to/prx", torch_dtype=torch.bfloat16).to(device)
        pipe.transformer = compile_prx(pipe.transformer, device=str(device), engine_cache_dir="engines")
        return pipe

    summary = generate_images(make_pipe, prompts, "images", steps=28)

Run the script as is (one process) or under ``accelerate launch`` (N processes); ``prx-compile
generate --num-processes N`` launches N processes on this machine for you. The rules:

- **Same images whatever the process count.** Image ``i`` (the prompt's index in ``prompts``) uses
  ``torch.Generator("cpu").manual_seed(seed + i)`` and is written as ``<i>-<slug>.png``; neither
  depends on the rank or on the other prompts, so 1 and N processes write byte-identical files
  (given the same GPU model and the same engines, which the engine cache shares).
- **The split.** Of N processes, rank r takes a contiguous block of indices: ``shares(len, N)[r]``
  (accelerate's ``split_between_processes`` rule: the first ``len % N`` ranks take one more).
- **Nothing lost.** Each PNG is written atomically (a temporary file, then a rename), so an existing
  PNG is complete; with ``resume`` (the default) it is kept and not made again. A prompt that raises
  is recorded with its error and the rank goes on with its other prompts.
- **No collective after start-up.** Each rank writes its record (written, skipped, failed, timings,
  engine builds) to ``<out_dir>/.prx-generate/<run>/rank-<r>.json`` when it ends; that is all the
  ranks exchange, so a dead rank cannot hang the others. The run id comes from the launcher or, under
  accelerate, from one broadcast right after the process group forms, with a random run token that
  every record carries: a ``rank-*.json`` without this run's token (left by another run, or forged)
  is ignored with a warning. The run's folder is private (mode 700).
- **One coordinator** (rank 0, or the ``--num-processes`` launcher) shows one progress bar for the
  whole job (finished PNGs), waits for every rank's record or its death (a rank of this host whose
  process is gone; under the launcher, a worker that exited), then lists the prompts without a PNG
  ("missing") and writes the summary (``summary_path``, default ``<out_dir>/summary.json``). Only
  regular ``*.png`` files count as finished images (not a folder or a link of that name).

Timing: ``images_per_s`` counts the images made in this run over the generation window (the first
rank's start of generation to the last rank's end); it leaves out process start, model load and
engine builds, which happen in the pipeline factory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .. import CompiledTransformer, progress, schema
from ..errors import ConfigError, excerpt
from ..io.artifact import ATOMIC_TEMPORARY, write_atomic

logger = logging.getLogger(__name__)

STATUS_DIR = ".prx-generate"
#: Set by ``launch`` in its workers: the run id; the launcher coordinates, not rank 0.
RUN_ENV = "PRX_COMPILE_RUN"
#: Set by ``launch`` in its workers beside ``RUN_ENV``: the run's secret token (``_run_id``).
TOKEN_ENV = "PRX_COMPILE_RUN_TOKEN"
#: The engine cache folder shared by the processes of a run (``default_engine_cache``).
CACHE_ENV = "PRX_COMPILE_CACHE"
#: How long the processes of a run wait for each other to form the process group at start.
START_TIMEOUT_S = 600
#: How long a ready rank waits for the others to finish loading before it starts anyway (a rank of
#: this host that died is noticed at once; one of another host only by this timeout).
READY_TIMEOUT_S = 1800
POLL_S = 0.25
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOKEN = re.compile(r"[0-9a-f]{32}")


# -- names, seeds, shares --------------------------------------------------------------------------
def image_name(index: int, prompt: str) -> str:
    """``<index>-<slug>.png``: the index zero-padded to at least 3 digits, the slug the prompt's first
    40 lower-case ASCII letters and digits, dashes between words. It depends on nothing else."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40] or "image"
    return f"{index:03d}-{slug}.png"


def shares(count: int, world: int) -> list[range]:
    """The prompt indices of each of ``world`` ranks: contiguous blocks, the first ``count % world``
    ranks one longer (accelerate's ``split_between_processes`` rule)."""
    per, extra = divmod(count, world)
    out, start = [], 0
    for r in range(world):
        n = per + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def default_engine_cache() -> str:
    """The engine cache folder processes of one machine share: ``$PRX_COMPILE_CACHE``, else
    ``~/.cache/prx_compile/engines``."""
    return os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "prx_compile" / "engines")


def default_size(pipe: Any) -> tuple[int, int] | None:
    """(height, width) in pixels of the compiled transformer's first engine set (its first serving
    shape) through the pipeline's VAE; for a set that counts image tokens (FLUX), the config's first
    ``specialize`` entry (else its resolution²). None when ``pipe.transformer`` is not compiled."""
    ct = pipe.transformer
    if not isinstance(ct, CompiledTransformer) or not ct.backends:
        return None
    shapes = ct.backends[0].shapes
    if shapes.tokens:
        cfg = ct.compile_config
        return (cfg.specialize[0][0], cfg.specialize[0][1]) if cfg.specialize else (cfg.resolution,) * 2
    _, h, w, _ = shapes.opt_point()
    return h * pipe.vae_scale_factor, w * pipe.vae_scale_factor


# -- files -----------------------------------------------------------------------------------------
def write_png(image: Any, path: Path) -> None:
    """Write the PIL image to ``path`` atomically (a temporary file in the same folder, then rename)."""
    write_atomic(path, lambda f: image.save(f, format="PNG"))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, lambda f: f.write((json.dumps(data, indent=1) + "\n").encode()))


def _read_json(path: Path, limit: int = 1 << 20) -> dict[str, Any] | None:
    """A JSON object from a regular file (no link, FIFO or device; at most ``limit`` bytes: a longer
    one is None, never read cut short), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = json.loads(os.read(fd, limit))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def is_summary(path: Path) -> bool:
    """Whether ``path`` holds a summary this module wrote (a run may replace it, and nothing else)."""
    data = _read_json(path, limit=1 << 28)
    return data is not None and data.get("kind") == "summary"


def _status_root(out_dir: Path) -> Path:
    """``<out_dir>/.prx-generate``, refused when it is a link (records are written and removed there)."""
    root = out_dir / STATUS_DIR
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ConfigError(f"{root} is a link or not a folder.", "remove it; generate makes it itself.")
    return root


def _remove_old_runs(out_dir: Path, keep: str) -> None:
    """Remove the status folders of earlier runs (only the coordinator, before any rank writes):
    folders named like run ids, not links, with no process of this host still running in them."""
    root = _status_root(out_dir)
    if not root.is_dir():
        return
    host = socket.gethostname()
    for d in root.iterdir():
        if d.name == keep or not _RUN_ID.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        starts = [_read_json(f) or {} for f in d.glob("rank-*.start.json")]
        if any(st.get("host") == host and _valid_pid(st.get("pid")) and _alive(st["pid"]) for st in starts):
            continue  # another run writing to the same folder right now
        shutil.rmtree(d, ignore_errors=True)


#: a temporary file this old was left by a killed process (a PNG or record is written in milliseconds)
STALE_TEMPORARY_S = 60.0


def _remove_stale_temporaries(out_dir: Path, names: Sequence[str]) -> int:
    """Remove what killed processes left of the job's files (only the coordinator, before any rank
    writes): ``write_atomic``'s temporary files of its images, its summary and the folder's record,
    regular files (not links) untouched for ``STALE_TEMPORARY_S`` (another run writing to the folder
    now keeps its own). Returns how many went."""
    return _remove_stale(out_dir, {*names, "summary.json"}) + _remove_stale(_status_root(out_dir), {MADE})


def _remove_stale(folder: Path, ours: set[str]) -> int:
    now, removed = time.time(), 0
    if not folder.is_dir() or folder.is_symlink():
        return 0
    with os.scandir(folder) as entries:
        for e in entries:
            m = ATOMIC_TEMPORARY.fullmatch(e.name)
            if m is None or m.group(1) not in ours:
                continue
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TEMPORARY_S:
                    os.unlink(e.path)
                    removed += 1
    return removed


#: a PNG's first 8 bytes, and its last 12 (the IEND chunk: a file cut short has none)
_PNG_HEAD = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def _is_png(path: Path) -> bool:
    """Is ``path`` a whole PNG: a regular file (not a folder, a link or a device) that starts and ends
    as PNGs do? Only those count as images (a copy cut short or an empty file is made again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < len(_PNG_HEAD) + len(_PNG_END):
            return False
        return os.pread(fd, 8, 0) == _PNG_HEAD and os.pread(fd, 12, st.st_size - 12) == _PNG_END
    except OSError:
        return False
    finally:
        os.close(fd)


#: what made a folder's images (``_check_made``)
MADE = "made.json"


def made_record(
    prompts: Sequence[str],
    *,
    seed: int,
    steps: int,
    guidance: float,
    height: int | None,
    width: int | None,
    pipeline_kwargs: dict[str, Any] | None = None,
    made_with: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of what makes a job's images (``generate_images``' arguments of the same names):
    its settings (as JSON reads them back) and each prompt's sha256 (16 hex digits), by index."""
    settings = dict(
        seed=seed,
        steps=steps,
        guidance=guidance,
        height=height,
        width=width,
        pipeline_kwargs=pipeline_kwargs or {},
        made_with=made_with,
    )
    return {
        "settings": json.loads(json.dumps(settings, sort_keys=True, default=str)),
        "prompts": [hashlib.sha256(p.encode("utf-8", "surrogatepass")).hexdigest()[:16] for p in prompts],
    }


def _check_made(out_dir: Path, names: list[str], made: dict[str, Any]) -> None:
    """A ConfigError, before any work, where ``out_dir`` holds PNGs that a run with other settings
    made, or made for another prompt at their index (names keep only 40 letters of a prompt): a
    resume keeps only images this run would make. A folder without a record (0.26's) is trusted."""
    old = _read_json(_status_root(out_dir) / MADE, limit=(1 << 20) + 20 * len(names))
    with os.scandir(out_dir) as it:
        present = {e.name for e in it}
    if old is None or not any(n in present for n in names):  # nothing of this job's there to keep
        return
    hint = "pass --no-resume (resume=False) to make them all again, or use another --out-dir."
    if old.get("settings") != made["settings"]:
        before = old.get("settings") if isinstance(old.get("settings"), dict) else {}
        diff = [k for k in sorted(made["settings"]) if before.get(k) != made["settings"][k]]
        raise ConfigError(f"{out_dir} holds images made with other settings ({', '.join(diff)}).", hint)
    hashes = old.get("prompts") if isinstance(old.get("prompts"), list) else []
    clash = [
        i
        for i, h in enumerate(made["prompts"])
        if i < len(hashes) and hashes[i] != h and _is_png(out_dir / names[i])
    ]
    if clash:
        raise ConfigError(
            f"{out_dir / names[clash[0]]} was made for another prompt ({len(clash)} image(s) so).", hint
        )


def _finished(out_dir: Path, names: list[str], resume: bool, since: float) -> list[bool]:
    """Per prompt: is its PNG there as a regular file (and, without resume, written in this run)?"""
    mtimes = {}
    with os.scandir(out_dir) as it:
        for entry in it:
            if entry.name.endswith(".png"):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        mtimes[entry.name] = st.st_mtime
    return [n in mtimes and (resume or mtimes[n] >= since) for n in names]


# -- processes -------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _valid_pid(pid: Any) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 1


_SECONDS = schema.Float(0, 1e11)  # durations, and times since the epoch
_MAYBE = schema.Null()
_INDICES = schema.List(schema.Int(0, 2**31), max_len=10**7)
#: a rank's record as ``_run_share`` writes it; read back from the run folder by the coordinator
_RECORD = schema.Dict(
    {
        "kind": schema.Str(4, choices=("rank",)),
        "token": schema.Str(32, pattern=_TOKEN.pattern),
        "rank": schema.Int(0, 2**20),
        "host": schema.Str(255),
        "pid": schema.Int(0, 2**31),
        "device": schema.Str(64),
        "share": schema.Tuple(schema.Int(0, 2**31), schema.Int(0, 2**31)),
        "written": _INDICES,
        "skipped": _INDICES,
        "failed": schema.Map(schema.Str(10), schema.Str(400), max_len=10**7),
        "error": schema.OneOf(_MAYBE, schema.Str(400)),
        "setup_s": schema.OneOf(_MAYBE, _SECONDS),
        "generate_s": _SECONDS,
        "generate_start": schema.OneOf(_MAYBE, _SECONDS),
        "generate_end": schema.OneOf(_MAYBE, _SECONDS),
        "images_per_s": schema.Float(0, 1e9),
        "engine_builds": schema.OneOf(_MAYBE, schema.Int(0, 2**20)),
        "engine_cache_loads": schema.OneOf(_MAYBE, schema.Int(0, 2**20)),
        "torch_threads": schema.OneOf(_MAYBE, schema.Int(0, 2**20)),
    },
    optional=(
        *("token", "pid", "share", "error", "torch_threads", "setup_s"),
        *("engine_builds", "engine_cache_loads", "generate_start", "generate_end"),
    ),
)


def _valid_record(rec: dict[str, Any], rank: int) -> bool:
    """A rank's record as ``_run_share`` writes it (it is read back from disk: check before use)."""
    try:
        schema.check(_RECORD, rec, f"rank-{rank}.json")
    except schema.SchemaError as e:
        logger.debug("%s", e)
        return False
    started = rec.get("generate_start") is not None and rec.get("generate_end") is not None
    return rec["rank"] == rank and (started or not rec["written"])


def _alive(pid: int) -> bool:
    """Is process ``pid`` of this host running (a zombie counts as gone)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _process() -> tuple[Any, torch.device]:
    """accelerate's PartialState (rank, world) and this process's device (``cuda:<local rank>``,
    made the current CUDA device, or cpu). On a machine without CUDA, several processes form a gloo
    group; PartialState only does so when told ``cpu=True``."""
    from accelerate import PartialState

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    state = PartialState(
        cpu=use_cpu or not torch.cuda.is_available(), timeout=timedelta(seconds=START_TIMEOUT_S)
    )
    device = torch.device(state.device)
    if device.type == "cpu":
        device = torch.device("cpu")  # accelerate numbers CPU processes cpu:<i>: one device here
    elif device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return state, device


def _run_id(state: Any) -> tuple[str, str, bool]:
    """(this run's id, its secret token, whether this process coordinates). A launcher passes both
    (and coordinates); under accelerate rank 0 makes them and broadcasts them, once, over a gloo
    group. Every record of the run carries the token; the coordinator reads no other."""
    given = os.environ.get(RUN_ENV)
    if given:
        token = os.environ.get(TOKEN_ENV, "")
        if not _RUN_ID.fullmatch(given) or not _TOKEN.fullmatch(token):
            raise ConfigError(
                f"{RUN_ENV}={excerpt(given)} with {TOKEN_ENV} is not a run id and token.",
                f"unset {RUN_ENV} (the launcher sets both).",
            )
        return given, token, False
    if state.num_processes == 1:
        return uuid.uuid4().hex[:16], secrets.token_hex(16), True
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=START_TIMEOUT_S))
    box = [(uuid.uuid4().hex[:16], secrets.token_hex(16)) if state.is_main_process else None]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    run_id, token = box[0]
    return run_id, token, state.is_main_process


# -- one rank ------------------------------------------------------------------------------------
def _gone_on_this_host(run_dir: Path, rank: int, host: str, token: str) -> str | None:
    """Why rank ``rank`` ended without its record, if it ran on this host and its process is gone;
    None while it may still report (running, not started yet, on another host, or its start record
    is not of this run: without ``token``)."""
    start = _read_json(run_dir / f"rank-{rank}.start.json")
    if (
        not start
        or start.get("token") != token
        or start.get("host") != host
        or not _valid_pid(start.get("pid"))
    ):
        return None
    return None if _alive(start["pid"]) else f"process {start['pid']} is gone"


def _wait_for_peers(run_dir: Path, world: int, rank: int, host: str, token: str) -> None:
    """Start generating together: wait until every other rank is ready (loaded), finished, or gone,
    so that the ranks' generation windows overlap and images/s measures them running side by side."""
    (run_dir / f"rank-{rank}.ready").touch()
    waiting = set(range(world)) - {rank}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting and time.monotonic() < deadline:
        waiting = {
            r
            for r in waiting
            if not (run_dir / f"rank-{r}.ready").exists()
            and not (run_dir / f"rank-{r}.json").exists()
            and not _gone_on_this_host(run_dir, r, host, token)
        }
        if waiting:
            time.sleep(POLL_S)
    if waiting:
        logger.warning(
            "rank %d: ranks %s are not ready after %d s: starting without them",
            rank,
            sorted(waiting),
            READY_TIMEOUT_S,
        )


def _make_image(pipe, prompt, index, *, seed, steps, guidance, height, width, pipeline_kwargs):
    kwargs = {
        "prompt": prompt,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "generator": torch.Generator(device="cpu").manual_seed(seed + index),
        **pipeline_kwargs,
    }
    if height:
        kwargs["height"] = height
    if width:
        kwargs["width"] = width
    return pipe(**kwargs).images[0]


def _run_share(
    factory: Callable[[torch.device], Any],
    prompts: Sequence[str],
    names: list[str],
    indices: range,
    out_dir: Path,
    run_dir: Path,
    rank: int,
    world: int,
    device: torch.device,
    *,
    token: str,
    resume: bool,
    on_image: Callable[[], None] | None,
    **call: Any,
) -> dict[str, Any]:
    """Make this rank's images; write and return its record (also when a prompt or the factory fails)."""
    host, pid = socket.gethostname(), os.getpid()
    start = {"rank": rank, "host": host, "pid": pid, "token": token}
    _write_json(run_dir / f"rank-{rank}.start.json", start)
    todo = [i for i in indices if not (resume and _is_png(out_dir / names[i]))]
    skipped = sorted(set(indices) - set(todo))
    record: dict[str, Any] = {
        "kind": "rank",
        "token": token,
        "rank": rank,
        "host": host,
        "pid": pid,
        "device": str(device),
        "share": [indices.start, indices.stop],
        "written": [],
        "skipped": skipped,
        "failed": {},
        "error": None,
        "setup_s": None,
        "generate_s": 0.0,
        "generate_start": None,
        "generate_end": None,
        "images_per_s": 0.0,
        "engine_builds": None,
        "engine_cache_loads": None,
        "torch_threads": torch.get_num_threads(),  # PyTorch's CPU threads in this process
    }
    try:
        if not todo:  # everything resumed: no model to load
            return record
        t0 = time.perf_counter()
        try:
            pipe = factory(device)
        except Exception as e:
            if world == 1:  # nothing else to finish: the caller gets the error itself
                raise
            record["error"] = f"the pipeline factory failed: {_one_line(e)}"
            record["failed"] = {str(i): record["error"] for i in todo}
            logger.error("rank %d: %s", rank, record["error"])
            return record
        record["setup_s"] = round(time.perf_counter() - t0, 3)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)  # the coordinator's bar is the only one
        size = default_size(pipe) or (None, None)
        call["height"], call["width"] = call["height"] or size[0], call["width"] or size[1]
        _wait_for_peers(run_dir, world, rank, host, token)
        record["generate_start"] = time.time()
        t1 = time.perf_counter()
        for i in todo:
            try:
                image = _make_image(pipe, prompts[i], i, **call)
                write_png(image, out_dir / names[i])
            except Exception as e:
                record["failed"][str(i)] = _one_line(e)
                logger.warning("rank %d: prompt %d (%r) failed: %s", rank, i, prompts[i][:60], _one_line(e))
            else:
                record["written"].append(i)
            record["generate_s"] = round(time.perf_counter() - t1, 3)
            record["generate_end"] = time.time()
            if on_image is not None:
                on_image()
        elapsed = time.perf_counter() - t1  # unrounded: a fast pipeline's 0.0 s divides by zero
        if record["written"] and elapsed > 0:
            record["images_per_s"] = round(min(len(record["written"]) / elapsed, 1e9), 4)
        transformer = getattr(pipe, "transformer", None)
        if isinstance(transformer, CompiledTransformer):  # engine sets built here / loaded
            record["engine_builds"] = transformer.builds
            record["engine_cache_loads"] = sum(1 for h in transformer.cache_hits if h["load_s"] is not None)
        return record
    finally:
        _write_json(run_dir / f"rank-{rank}.json", record)


# -- the coordinator -----------------------------------------------------------------------------
class _JobBar:
    """One bar for the job: finished PNGs of all ranks. In a terminal a tqdm bar on stderr; elsewhere
    a line when the count changes (at most every 10 s) and one at the end."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.total, self.done, self.enabled = total, done, enabled
        self.t0 = self.last_line = time.perf_counter()
        self.bar = None
        if enabled and progress._tty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, desc="generate", unit="image", file=sys.stderr)

    def update(self, done: int) -> None:
        if done == self.done:
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
        elif self.enabled and time.perf_counter() - self.last_line >= 10:
            self.last_line = time.perf_counter()
            print(f"prx-compile: generate: {done}/{self.total} images", file=sys.stderr, flush=True)
        self.done = done

    def close(self) -> None:
        """The last line: "done", or "stopped" when an exception (Ctrl-C) is on its way out."""
        stopped = sys.exc_info()[0] is not None
        if self.bar is not None:
            if stopped:
                self.bar.set_postfix_str("stopped", refresh=True)
            self.bar.close()
        elif self.enabled:
            end = "stopped after" if stopped else "done in"
            print(
                f"prx-compile: generate: {self.done}/{self.total} images, "
                f"{end} {time.perf_counter() - self.t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )


def _coordinate(
    prompts: Sequence[str],
    names: list[str],
    out_dir: Path,
    run_dir: Path,
    world: int,
    gone: Callable[[int], str | None],
    bar: _JobBar,
    *,
    token: str,
    resume: bool,
    since: float,
) -> tuple[dict[int, dict[str, Any]], dict[int, str], list[bool]]:
    """Wait for every rank's record, or its end without one (``gone(rank)`` gives the reason, or
    None while it may still report), updating the bar. A record without this run's ``token`` is not
    this run's: ignored, with a warning, while the rank may still write its own. Returns (records,
    ended, finished per prompt); the records without their token."""
    records: dict[int, dict[str, Any]] = {}
    ended: dict[int, str] = {}
    foreign: set[int] = set()

    def read(r: int) -> dict[str, Any] | None:
        rec = _read_json(run_dir / f"rank-{r}.json", limit=(1 << 20) + 400 * len(prompts))
        if rec is not None and rec.get("token") != token:
            if r not in foreign:
                foreign.add(r)
                logger.warning("%s is not from this run (no or another run token): ignored", f"rank-{r}.json")
            return None
        return rec

    while True:
        for r in range(world):
            if r in records or r in ended:
                continue
            rec = read(r)
            reason = None if rec else gone(r)
            if reason:  # it may have written its record just before it ended
                rec = read(r)
            if rec and not _valid_record(rec, r):
                rec, reason = None, "its record is malformed"
            if rec:
                records[r] = {k: v for k, v in rec.items() if k != "token"}
            elif reason:
                ended[r] = reason
        finished = _finished(out_dir, names, resume, since)
        bar.update(sum(finished))
        if len(records) + len(ended) == world:
            return records, ended, finished
        time.sleep(POLL_S)


def _summary(
    prompts: Sequence[str],
    names: list[str],
    world: int,
    records: dict[int, dict[str, Any]],
    ended: dict[int, str],
    finished: list[bool],
    *,
    run_id: str,
    started: float,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The job's summary: images, seconds and images/s per rank and in total, the missing prompts."""
    split = shares(len(prompts), world)
    ranks: list[dict[str, Any]] = []
    for r in range(world):
        if r in records:
            ranks.append({**records[r], "status": "finished"})
        else:
            ranks.append({"rank": r, "share": [split[r].start, split[r].stop], "status": ended[r]})
    missing = []
    for i, ok in enumerate(finished):
        if ok:
            continue
        r = next(k for k, s in enumerate(split) if i in s)
        if r in ended:
            reason = f"rank {r} ended without a report ({ended[r]})"
        else:
            reason = records[r].get("failed", {}).get(str(i)) or f"rank {r} did not make it"
        missing.append({"index": i, "prompt": prompts[i], "file": names[i], "rank": r, "reason": reason})
    done = [rec for rec in records.values() if rec.get("written")]
    written = sum(len(rec["written"]) for rec in done)
    threads = sorted({rec["torch_threads"] for rec in done if rec.get("torch_threads")}) or None
    window = 0.0
    if done:  # the first start of generation to the last end, over the ranks that made images
        window = max(rec["generate_end"] for rec in done) - min(rec["generate_start"] for rec in done)
    return {
        "kind": "summary",
        "run": run_id,
        "processes": world,
        "prompts": len(prompts),
        "images": sum(finished),
        "written": written,
        "skipped": sum(len(rec.get("skipped", [])) for rec in records.values()),
        "missing": missing,
        "seconds": round(time.time() - started, 3),
        "generate_s": round(window, 3),
        "images_per_s": round(written / window, 4) if window > 0 else 0.0,
        "images_per_s_sum_of_ranks": round(sum(rec.get("images_per_s", 0.0) for rec in done), 4),
        "timing": "images_per_s: images written / (last rank's end - first rank's start of generation), "
        "the same window for 1 and N processes; process start, model load and engine builds are outside "
        f"it. The processes shared {os.cpu_count()} CPU cores with "
        f"{'/'.join(map(str, threads or ['?']))} torch thread(s) each "
        "(GPU runs are not bound by them)",
        "torch_threads": threads,
        **settings,
        "ranks": ranks,
    }


def _finish(summary: dict[str, Any], out_dir: Path, run_dir: Path, summary_path: str | Path | None) -> None:
    path = Path(summary_path) if summary_path else out_dir / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, summary)
    summary["summary_path"] = str(path)
    shutil.rmtree(run_dir, ignore_errors=True)  # its records are in the summary
    with contextlib.suppress(OSError):
        run_dir.parent.rmdir()


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text: totals, one line per rank, and the missing prompts."""
    s = summary
    lines = [
        f"{s['images']}/{s['prompts']} images in {s['out_dir']} ({s['written']} made, {s['skipped']} "
        f"kept from before) by {s['processes']} process(es): {s['images_per_s']:.3f} images/s over "
        f"{s['generate_s']:.1f} s of generation, {s['seconds']:.1f} s in all"
    ]
    for r in s["ranks"]:
        if r["status"] != "finished":
            lines.append(f"  rank {r['rank']}: {r['status']} (prompts {r['share'][0]}..{r['share'][1] - 1})")
            continue
        engines = (
            f"; engine sets built {r['engine_builds']}, loaded from the cache {r['engine_cache_loads']}"
            if r.get("engine_builds") is not None
            else ""
        )
        lines.append(
            f"  rank {r['rank']} ({r['host']}, {r['device']}): {len(r['written'])} made, "
            f"{len(r['skipped'])} kept, {len(r['failed'])} failed in {r['generate_s']:.1f} s: "
            f"{r['images_per_s']:.3f} images/s{engines}"
        )
    if s["missing"]:
        lines.append(f"missing {len(s['missing'])} of {s['prompts']} images:")
        for m in s["missing"]:
            lines.append(f"  {m['index']} {m['prompt'][:80]!r}: {m['reason']}")
    lines.append(f"summary: {s.get('summary_path')}")
    return "\n".join(lines)


#: the longest prompt taken: text encoders read a few hundred tokens, and diffusers' prompt cleaning
#: takes time quadratic in a prompt's length (a 1 MB prompt: minutes)
MAX_PROMPT_CHARS = 10_000


def check_job(prompts: Any, steps: Any, seed: Any = 0) -> list[str]:
    """The prompts as a list, or a ConfigError naming what is wrong: not a list of strings, none, a
    prompt over ``MAX_PROMPT_CHARS``, steps < 1, or seeds (``seed`` + index) outside what torch's
    generators take."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ConfigError("prompts must be a list of strings.", "pass e.g. ['a cat', 'a dog'].")
    if not prompts:
        raise ConfigError("no prompt given.", "pass at least one prompt.")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ConfigError(f"prompt {bad[0]} is a {type(prompts[bad[0]]).__name__}, not a string.")
    long = [i for i, p in enumerate(prompts) if len(p) > MAX_PROMPT_CHARS]
    if long:
        raise ConfigError(
            f"prompt {long[0]} has {len(prompts[long[0]])} characters, more than {MAX_PROMPT_CHARS}.",
            "text encoders read a few hundred tokens: shorten it.",
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r} must be a positive integer.")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**63 - len(prompts):
        raise ConfigError(
            f"seed={excerpt(seed)}: image i uses seed + i, which must stay within 0 and 2**63 - 1.",
            f"use a seed from 0 to 2**63 - {len(prompts)}.",
        )
    return list(prompts)


# -- the API -------------------------------------------------------------------------------------
def generate_images(
    pipeline_factory: Callable[[torch.device], Any],
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    steps: int = 28,
    guidance: float = 4.0,
    height: int | None = None,
    width: int | None = None,
    seed: int = 0,
    resume: bool = True,
    summary_path: str | Path | None = None,
    pipeline_kwargs: dict[str, Any] | None = None,
    show_progress: bool | None = None,
    made_with: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Make one PNG per prompt in ``out_dir``, split over the processes of this run (see the module).

    Args:
        pipeline_factory: ``factory(device) -> PRXPipeline`` (any callable pipeline whose output has
            ``.images``), called once per process with its device (``cuda:<local rank>`` or cpu), and
            only if the process has images to make. Build engines in it so they stay out of the timing.
        prompts: the job's prompts; image ``i`` is ``prompts[i]``, seed ``seed + i``.
        out_dir: where ``<i>-<slug>.png`` go (created).
        steps, guidance: denoising steps and guidance scale.
        height, width: pixels; default: the compiled transformer's first engine set, else the pipeline's.
        resume: keep PNGs that exist (default): whole PNGs, made by a run with the same settings and
            ``made_with`` for the same prompt at their index (else a ConfigError, before any work);
            False makes every image again.
        summary_path: the summary JSON (default ``<out_dir>/summary.json``).
        pipeline_kwargs: more keyword arguments for every pipeline call.
        show_progress: the job's bar on the coordinator; default: as ``prx_compile.progress.reporting``.
        made_with: what else decides the images (the model and its config; JSON), recorded beside the
            settings in ``<out_dir>/.prx-generate/made.json``.

    Returns:
        On the coordinating process (rank 0; the only one without accelerate): the summary, with
        ``"missing"`` (prompts without a PNG: index, prompt, file, rank, reason) empty when all is
        done. On the other ranks: that rank's record (``"kind": "rank"``).

    Raises:
        ConfigError: bad prompts, steps or seed (``check_job``); with ``resume``, PNGs in ``out_dir``
            that other settings or other prompts made (``_check_made``).
    """
    prompts = check_job(prompts, steps, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [image_name(i, p) for i, p in enumerate(prompts)]
    call = dict(  # each image's pipeline call, and what the folder's record holds
        seed=seed,
        steps=steps,
        guidance=guidance,
        height=height,
        width=width,
        pipeline_kwargs=dict(pipeline_kwargs or {}),
    )
    made = made_record(prompts, **call, made_with=made_with)
    if resume:
        _check_made(out_dir, names, made)
    started = time.time()
    state, device = _process()
    run_id, token, coordinates = _run_id(state)
    rank, world = state.process_index, state.num_processes
    if coordinates:
        _remove_old_runs(out_dir, keep=run_id)
        _remove_stale_temporaries(out_dir, names)
    run_dir = _status_root(out_dir) / run_id
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if coordinates and resume:  # what the images kept and made are: the next resume holds them to it
        _write_json(run_dir.parent / MADE, made)
    show = progress.enabled() if show_progress is None else show_progress
    bar = (
        _JobBar(len(prompts), sum(_finished(out_dir, names, resume, started)), show) if coordinates else None
    )

    scan = {"next": 0.0}

    def on_image() -> None:  # the coordinator's bar counts every rank's PNGs in the folder
        now = time.perf_counter()
        if now < scan["next"]:
            return
        bar.update(sum(_finished(out_dir, names, resume, started)))
        scan["next"] = now + 9 * (time.perf_counter() - now)  # a big folder's scans: a tenth of the time

    # the coordinator reports; under ``launch`` (whose bar the workers' terminal shows) rank 0 reports
    # its engine builds in lines that name it; the other ranks stay quiet
    launched = not coordinates and rank == 0 and os.environ.get(RUN_ENV) is not None
    reporting = progress.reporting(show and (coordinates or launched), None if coordinates else "rank 0")
    try:
        with reporting:
            record = _run_share(
                pipeline_factory,
                prompts,
                names,
                shares(len(prompts), world)[rank],
                out_dir,
                run_dir,
                rank,
                world,
                device,
                token=token,
                resume=resume,
                on_image=on_image if bar else None,
                **call,
            )
    except BaseException:
        if world == 1:  # no one else reads the run's records
            shutil.rmtree(run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()
        if bar is not None:
            bar.close()
        raise
    if not coordinates:
        return record
    host = socket.gethostname()
    try:
        records, ended, finished = _coordinate(
            prompts,
            names,
            out_dir,
            run_dir,
            world,
            lambda r: _gone_on_this_host(run_dir, r, host, token),
            bar,
            token=token,
            resume=resume,
            since=started,
        )
    finally:
        bar.close()
    settings = {"out_dir": str(out_dir), "seed": seed, "steps": steps, "guidance": guidance}
    summary = _summary(
        prompts, names, world, records, ended, finished, run_id=run_id, started=started, settings=settings
    )
    _finish(summary, out_dir, run_dir, summary_path)
    if not resume and not summary["missing"]:  # every image is this run's now
        _status_root(out_dir).mkdir(exist_ok=True)
        _write_json(_status_root(out_dir) / MADE, made)
    return summary


def launch(
    command: list[str],
    num_processes: int,
    prompts: Sequence[str],
    out_dir: str | Path,
    *,
    resume: bool = True,
    summary_path: str | Path | None = None,
    settings: dict[str, Any] | None = None,
    show_progress: bool = True,
    made: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``command`` (a process that calls ``generate_images`` with these prompts, e.g.
    ``python -m prx_compile generate ...``) as ``num_processes`` ranks on this machine, and coordinate
    them: one bar, then the summary (as ``generate_images``'s coordinator returns it).

    The workers get RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as
    torchrun sets them; the rendezvous store lives here (as torchrun's agent holds it), so it outlives
    every worker. A worker that ends without its record (killed, crashed) is reported, never waited for.
    ``made``: what makes the images (``made_record``), held against the folder's (``resume``) and
    recorded, as ``generate_images`` does.
    """
    from torch.distributed import TCPStore

    prompts = list(prompts)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [image_name(i, p) for i, p in enumerate(prompts)]
    if made is not None and resume:
        _check_made(out_dir, names, made)
    started = time.time()
    run_id, token = uuid.uuid4().hex[:16], secrets.token_hex(16)
    _remove_old_runs(out_dir, keep=run_id)
    _remove_stale_temporaries(out_dir, names)
    run_dir = _status_root(out_dir) / run_id
    run_dir.mkdir(mode=0o700, parents=True)
    if made is not None and resume:
        _write_json(run_dir.parent / MADE, made)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        "WORLD_SIZE": str(num_processes),
        "LOCAL_WORLD_SIZE": str(num_processes),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        RUN_ENV: run_id,
        TOKEN_ENV: token,
        # the machine's cores shared out: N processes use the cores one process would (CPU timings)
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
        or str(max(1, (os.cpu_count() or 1) // num_processes)),
    }
    bar = _JobBar(len(prompts), sum(_finished(out_dir, names, resume, started)), show_progress)
    workers: list[subprocess.Popen] = []
    try:
        for r in range(num_processes):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            workers.append(subprocess.Popen(command, env=rank_env))

        early: list[int] = []  # ranks that ended before the group formed (no start record)
        stopped: set[int] = set()

        def gone(r: int) -> str | None:
            code = workers[r].poll()
            joined = (run_dir / f"rank-{r}.start.json").exists()  # written once the group formed
            if code is None:
                if early and not joined and r not in stopped:  # it would wait for them for minutes
                    workers[r].terminate()
                    stopped.add(r)
                return None
            if r in stopped:
                return f"stopped: rank {early[0]} ended before the processes could start together"
            if not joined and r not in early:
                early.append(r)
            return _exit_reason(code)

        records, ended, finished = _coordinate(
            prompts,
            names,
            out_dir,
            run_dir,
            num_processes,
            gone,
            bar,
            token=token,
            resume=resume,
            since=started,
        )
    except BaseException:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        raise
    finally:
        bar.close()
        try:
            for w in workers:  # reported: let each exit on its own, within a minute
                try:
                    w.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: stop them now
            for w in workers:
                w.kill()
            raise
        del store
    summary = _summary(
        prompts,
        names,
        num_processes,
        records,
        ended,
        finished,
        run_id=run_id,
        started=started,
        settings={"out_dir": str(out_dir), **(settings or {})},
    )
    _finish(summary, out_dir, run_dir, summary_path)
    if made is not None and not resume and not summary["missing"]:
        _status_root(out_dir).mkdir(exist_ok=True)
        _write_json(_status_root(out_dir) / MADE, made)
    return summary
