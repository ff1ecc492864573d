"""CI runs exactly the set-up commands that README.md gives."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_setup_commands() -> list[str]:
    """The commands of README.md's one block marked ``<!-- ci: setup -->``."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- ci: setup -->\n```bash\n(.*?)```", text, re.S)
    assert len(blocks) == 1, f"README.md has {len(blocks)} set-up blocks"
    block = blocks[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_commands():
    commands = readme_setup_commands()
    assert len(commands) == 2, commands  # one installs, one runs the tests
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci, f"{command!r} is in README.md but not in .ci/run"
    assert ci.index(commands[0]) < ci.index(commands[1])
    assert "pytest" in commands[1]


def test_gitignore_keeps_the_device_kit_out():
    assert ".device-kit/" in (ROOT / ".gitignore").read_text().split()
