"""Progress for the long steps (export, lowering, engine builds, refits), shown when enabled.

    with progress.reporting(True):
        compiled.build()     # "export (...)", "lower", "build TensorRT engines", each with its duration

In a terminal each step is a tqdm bar on stderr; anywhere else (a log file, a notebook's captured
stream, CI) each finished step is one line on stderr, so logs read cleanly. The CLI enables it
unless ``--quiet``; notebooks and scripts opt in the same way. Off by default. A process that shares
its terminal with another's bar (a ``generate --num-processes`` worker) reports in lines that name
it: ``reporting(True, source="rank 0")`` prints ``prx-compile [rank 0]: ...``.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

#: (enabled, the process's name in its lines or None)
_ENABLED: contextvars.ContextVar[tuple[bool, str | None]] = contextvars.ContextVar(
    "prx_compile_progress", default=(False, None)
)


@contextlib.contextmanager
def reporting(enabled: bool = True, source: str | None = None) -> Iterator[None]:
    """Within the block, long steps report their progress (or not); with ``source``, in lines only,
    each ``prx-compile [source]: ...``."""
    token = _ENABLED.set((enabled, source))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()[0]


def _head() -> str:
    source = _ENABLED.get()[1]
    return "prx-compile" if source is None else f"prx-compile [{source}]"


def _tty() -> bool:
    """Whether to draw bars: stderr is a terminal this process does not share with another's bar."""
    return _ENABLED.get()[1] is None and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


@contextlib.contextmanager
def stage(desc: str, times: dict[str, float] | None = None, key: str = "") -> Iterator[None]:
    """An opaque step: a bar while it runs in a terminal, one line with its duration elsewhere.
    With ``times``, its seconds are also stored as ``times[key]`` (shown or not)."""
    t0 = time.perf_counter()
    if times is not None:
        with _timed(times, key, t0), stage(desc):
            yield
        return
    if not enabled():
        yield
        return
    if not _tty():
        yield
        print(f"{_head()}: {desc}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}{postfix}", leave=True, file=sys.stderr)
    try:
        yield
        bar.set_postfix_str(f"done in {time.perf_counter() - t0:.1f} s", refresh=False)
        bar.update(1)
    finally:
        bar.close()


@contextlib.contextmanager
def _timed(times: dict[str, float], key: str, t0: float) -> Iterator[None]:
    try:
        yield
    finally:
        times[key] = time.perf_counter() - t0


def note(text: str) -> None:
    """One line on stderr, when enabled (a result worth seeing, e.g. the kernels a set chose)."""
    if enabled():
        print(f"{_head()}: {text}", file=sys.stderr, flush=True)


def items(iterable: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """``iterable`` with a bar in a terminal (one line when done elsewhere), when enabled."""
    if not enabled():
        return iterable
    if not _tty():
        return _lines(iterable, desc)
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=True, file=sys.stderr)


def _lines(iterable: Iterable[Any], desc: str) -> Iterator[Any]:
    t0, n = time.perf_counter(), 0
    for n, item in enumerate(iterable, 1):  # noqa: B007
        yield item
    print(f"{_head()}: {desc}: {n} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
