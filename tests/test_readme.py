"""Every code block of README.md says where it runs, and CI runs each CPU one, in order, in one folder."""

import re
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("index", [i for i, (where, _, _) in enumerate(blocks()) if where == "cpu"])
def test_cpu_block_runs_as_written(index, workdir, monkeypatch, capfd):
    """A shell block runs in bash, each command a process of its own (the console script, as a reader
    runs it); a Python block runs in this process, in a namespace of its own, as ``python -c`` would
    (what it needs it imports itself), without the seconds of imports a new process spends."""
    _, lang, code = blocks()[index]
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
        r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr
        return
    assert lang == "python", lang
    monkeypatch.chdir(workdir)
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__main__"})
    assert "Traceback" not in capfd.readouterr().err
