"""Every code block of README.md and of the pages in docs/ says where it runs, and CI runs each CPU
one, in order, in one folder per page. Markers: ``cpu`` (run here), ``gpu`` (needs a GPU), ``setup``
(the install and test commands CI runs itself: .ci/run), ``none`` (not for CI: another machine's
install step)."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ._cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- ci: (\w+) -->\n)?```(\w*)\n(.*?)```", re.S)


PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def blocks(page: str = "README.md"):
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer((ROOT / page).read_text())]


@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_says_where_it_runs(page):
    found = blocks(page)
    unmarked = [
        code[:60]
        for where, lang, code in found
        if where not in ("cpu", "gpu", "setup", "none") and code.strip() and lang in ("bash", "python", "")
    ]
    # the opening one-liner and the diagrams are not commands
    assert all(
        c.startswith(("pipe.transformer", "PRXTransformer2DModel", "prx_compile/")) for c in unmarked
    ), (
        page,
        unmarked,
    )
    if page == "README.md":
        assert len(found) > 5


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    return {page: tmp_path_factory.mktemp(page.replace("/", "-")) for page in PAGES}


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


@pytest.mark.parametrize(
    "page, index", [(p, i) for p in PAGES for i, (where, _, _) in enumerate(blocks(p)) if where == "cpu"]
)
def test_cpu_block_runs_as_written(page, index, workdirs, monkeypatch, capfd):
    """Each block in this process, in order, in one folder: a shell block command by command (bash
    checks its syntax first; ``prx-compile`` lines are ``main(argv)``, what the console script calls,
    so each skips the seconds of imports a new process spends; the console script itself runs as a
    process in tests/test_cli.py::test_console_script_runs_the_command), a Python block
    in a namespace of its own, as ``python -c`` would (what it needs it imports itself)."""
    _, lang, code = blocks(page)[index]
    workdir = workdirs[page]
    monkeypatch.chdir(workdir)
    if lang == "bash":
        syntax = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        for line in shell_commands(code):
            returncode, stderr = run_shell_line(line, workdir)
            assert returncode == 0, f"{page} block {index} failed at:\n{line}\n--- stderr:\n{stderr[-3000:]}"
            assert "Traceback" not in stderr, stderr[-3000:]
        assert "Traceback" not in capfd.readouterr().err  # the processes it started (generate's workers)
        return
    assert lang == "python", lang
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__main__"})
    assert "Traceback" not in capfd.readouterr().err
