"""Every code block of README.md says where it runs, and CI runs each CPU one, in order, in one folder."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ._cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- ci: (\w+) -->\n)?```(\w*)\n(.*?)```", re.S)


def blocks():
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer((ROOT / "README.md").read_text())]


def test_every_code_block_says_where_it_runs():
    found = blocks()
    assert len(found) > 5
    unmarked = [
        code[:60] for where, _, code in found if where not in ("cpu", "gpu", "setup") and code.strip()
    ]
    # the opening one-liner and the two diagrams are not commands
    assert all(
        c.startswith(("pipe.transformer", "PRXTransformer2DModel", "prx_compile/")) for c in unmarked
    ), unmarked


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


#: what a line needs a real shell for (pipes, lists, redirections, expansions, globs)
SHELL_SYNTAX = re.compile(r"[|&;<>$`(){}*?~]")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def shell_commands(code: str) -> list[str]:
    """The block's commands, one a line (a trailing backslash continues a line)."""
    return [c for c in code.replace("\\\n", " ").splitlines() if shlex.split(c, comments=True)]


def run_shell_line(line: str, cwd: Path) -> tuple[int, str]:
    """One command of a shell block: ``prx-compile ARGS`` (with ``VAR=value`` prefixes) as the console
    script runs it, ``main(ARGS)``, in this process; anything else (``cmp``, a line with shell syntax)
    in bash. (exit status, stderr)."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] == "prx-compile" and not SHELL_SYNTAX.search(line):  # (a comment with such a sign: bash)
        r = run_cli(*words[1:], env=env)
        return r.returncode, r.stderr
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=cwd, capture_output=True, text=True)
    return r.returncode, r.stderr


@pytest.mark.parametrize("index", [i for i, (where, _, _) in enumerate(blocks()) if where == "cpu"])
def test_cpu_block_runs_as_written(index, workdir, monkeypatch, capfd):
    """Each block in this process, in order, in one folder: a shell block command by command (bash
    checks its syntax first; ``prx-compile`` lines are ``main(argv)``, what the console script calls,
    so each skips the seconds of imports a new process spends; the console script itself runs as a
    process in tests/test_cli.py::test_console_script_runs_the_command), a Python block
    in a namespace of its own, as ``python -c`` would (what it needs it imports itself)."""
    _, lang, code = blocks()[index]
    monkeypatch.chdir(workdir)
    if lang == "bash":
        syntax = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        for line in shell_commands(code):
            returncode, stderr = run_shell_line(line, workdir)
            assert returncode == 0, f"README block {index} failed at:\n{line}\n--- stderr:\n{stderr[-3000:]}"
            assert "Traceback" not in stderr, stderr[-3000:]
        assert "Traceback" not in capfd.readouterr().err  # the processes it started (generate's workers)
        return
    assert lang == "python", lang
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__main__"})
    assert "Traceback" not in capfd.readouterr().err
