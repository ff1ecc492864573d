"""The package's shape: no import cycles, the public API, and presets that ship inside the wheel."""

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import prx_compile

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "prx_compile"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """prx_compile modules that ``path`` imports anywhere (functions included)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != me}
    return found


def import_graph() -> dict[str, set[str]]:
    """prx_compile module -> the prx_compile modules it imports (anywhere in it)."""
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [nxt]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    return [c for m in graph if (c := cycle_from(m))]


#: what only the tools (the CLI and the benchmark harness) may import: the test fixtures
FIXTURES = {"prx_compile.testing"}
TOOLS = {"prx_compile.cli", "prx_compile.bench", "prx_compile.__main__", "prx_compile.testing"}


def fixture_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(library module, what it imports) for every import of the fixtures or the tools outside the tools."""
    return sorted(
        (m, t) for m, targets in graph.items() if m not in TOOLS for t in targets if t in FIXTURES | TOOLS
    )


def test_no_import_cycles():
    graph = import_graph()
    assert graph["prx_compile.module"] >= {"prx_compile.backends", "prx_compile.config"}
    assert not cycles(graph), cycles(graph)[0]
    planted = {**graph, "prx_compile.config": graph["prx_compile.config"] | {"prx_compile.module"}}
    assert cycles(planted)  # the check sees a cycle when there is one


def test_public_api():
    for name in (
        "compile_prx",
        "CompileConfig",
        "save_compiled",
        "load_compiled",
        "load_lora",
        "set_lora",
        "unload_lora",
        "generate_images",
    ):
        assert name in prx_compile.__all__ and callable(getattr(prx_compile, name))


def test_the_library_never_imports_the_test_fixtures_or_the_tools():
    graph = import_graph()
    assert fixture_imports(graph) == []
    assert "prx_compile.testing" in graph["prx_compile.cli"]  # the CLI's --tiny model: allowed there
    planted = {**graph, "prx_compile.module": graph["prx_compile.module"] | {"prx_compile.testing"}}
    assert fixture_imports(planted) == [("prx_compile.module", "prx_compile.testing")]
    planted = {**graph, "prx_compile.saving": graph["prx_compile.saving"] | {"prx_compile.cli"}}
    assert fixture_imports(planted) == [("prx_compile.saving", "prx_compile.cli")]


def test_the_wheel_ships_the_presets(tmp_path):
    """Build the wheel, install it into a fresh virtual environment outside the checkout (the
    dependencies come from this environment), and resolve every preset there."""
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("prx_compile-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, str(wheel)],
        check=True,
        capture_output=True,
    )
    deps = sysconfig.get_paths()["purelib"]  # torch, diffusers, ... of this environment, after the wheel
    Path(site, "deps.pth").write_text(deps + "\n")
    code = (
        "import prx_compile, sys\n"
        "from prx_compile import CompileConfig\n"
        "from prx_compile.config import list_presets\n"
        "assert prx_compile.__file__.startswith(sys.argv[1]), prx_compile.__file__\n"
        "names = list_presets(); assert 'prx-1024-bf16' in names, names\n"
        "print(len([CompileConfig.resolve(n) for n in names]))"
    )
    r = subprocess.run(
        [str(py), "-c", code, site],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) == len(list((ROOT / "configs").glob("*.yaml")))
