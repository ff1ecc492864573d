"""The prx-compile command run in the test process: ``main(argv)``, as the console script calls it.

A new process spends seconds on imports (torch, diffusers, transformers) before the command starts, so
the suite runs the command in-process wherever the process boundary is not what a test is about: the
CLI tests, the README's shell blocks (``tests/test_readme.py``: their ``prx-compile`` lines) and
generate's launcher. Real processes where it is: the console script
(``tests/test_cli.py::test_console_script_runs_the_command``), ``python -m prx_compile``
(``tests/test_cli.py::test_module_entry_point_runs_the_command`` and every worker that a
``--num-processes`` launcher starts), several processes of one job (``tests/test_generate.py``, the
README's two-process block) and of one engine cache (``tests/test_artifact.py``), the notebooks' kernels.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from dataclasses import dataclass

#: loggers whose levels main() sets for the process (restored after each call here)
_LOGGERS = ("", "torch", "torch_tensorrt", "py.warnings", "transformers", "diffusers")


@dataclass
class CLIResult:
    """What ``subprocess.run(["prx-compile", *args])`` would report."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args, env: dict[str, str] | None = None) -> CLIResult:
    """``prx-compile ARGS`` in this process: its exit code (an argparse exit included), its stdout and
    its stderr, log records included as the command's own logging set-up prints them (``name: message``).
    ``env`` is set in ``os.environ`` for the call (processes it starts inherit it), then restored."""
    from prx_compile.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    handler.setLevel(logging.DEBUG if "--debug" in args else logging.WARNING)
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    saved = {k: os.environ.get(k) for k in env or {}}
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, --version, a bad argument
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return CLIResult(code, out.getvalue(), err.getvalue())
