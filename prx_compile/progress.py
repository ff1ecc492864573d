"""Progress bars for the long steps (export, lowering, engine build, refit), shown when enabled.

    with progress.reporting(True):
        compiled.build()          # prints "export", "lower", "build" bars with their durations

The CLI enables it unless ``--quiet``; notebooks and scripts opt in the same way. Off by default.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterable, Iterator
from typing import Any

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("prx_compile_progress", default=False)


@contextlib.contextmanager
def reporting(enabled: bool = True) -> Iterator[None]:
    """Within the block, long steps show tqdm progress bars (or not)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def stage(desc: str) -> Iterator[None]:
    """A one-step bar for an opaque step: shows the step while it runs, then its duration."""
    if not enabled():
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}{postfix}", leave=True)
    t0 = time.perf_counter()
    try:
        yield
        bar.set_postfix_str(f"done in {time.perf_counter() - t0:.1f} s", refresh=False)
        bar.update(1)
    finally:
        bar.close()


def items(iterable: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """``iterable`` with a progress bar when enabled."""
    if not enabled():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=True)
