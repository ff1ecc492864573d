"""The package's shape: a top level of core modules and stage folders, the library apart from its tools
(it never imports prx_compile.tools, the test fixtures included), no import cycles, the public API, and a
wheel that ships every folder, the presets and the command.

Each layout check runs on the checkout and on a copy of the package with a violation planted in its
files, and must find that violation."""

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import prx_compile

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "prx_compile"


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: a planted copy of the package parses only the files it changed
_parse = functools.cache(ast.parse)


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """prx_compile modules that ``path`` imports anywhere (functions included), by an import statement or
    by ``importlib.import_module("...")`` with a constant name."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(_parse(path.read_text())):
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
        elif (
            isinstance(node, ast.Call)
            and (ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__"))
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        else:
            continue
        # "import prx_compile.tools.cli" also names its packages; the deepest module is the one imported
        found |= {t for t in targets if t in modules and t != me}
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """prx_compile module -> the prx_compile modules it imports (anywhere in it), read from the files
    under ``root`` (the checkout, or a planted copy of its package)."""
    files = sorted((root / "prx_compile").rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, modules, root) for f in files}


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


#: the applications (the CLI, generate, the benchmark harness, the pipeline loader, the test fixtures)
TOOLS = "prx_compile.tools"
#: the one file outside tools/ that may import them: ``python -m prx_compile`` runs the CLI
ENTRY_POINT = "prx_compile.__main__"


def is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def is_fixture(name: str) -> bool:
    """The test fixtures, wherever a module of that name is put (tools/testing.py today)."""
    return name.rpartition(".")[2] == "testing"


def library(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The library's part of the graph: every module outside tools/, less the entry point."""
    return {m: t for m, t in graph.items() if not is_tool(m) and m != ENTRY_POINT}


def forbidden_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(library module, what it imports) for every import of the tools or of the fixtures by the library."""
    return sorted(
        (m, t) for m, targets in library(graph).items() for t in targets if is_tool(t) or is_fixture(t)
    )


def library_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    lib = library(graph)
    return cycles({m: {t for t in targets if t in lib} for m, targets in lib.items()})


#: the modules at the top of prx_compile/: the entry points, what every stage may use, and the plan
#: (the config resolved for one model and this machine, which the backends and the runtime read)
CORE = ("__init__", "__main__", "_version", "config", "errors", "schema", "progress", "shapes", "plan")
#: the model specs, then the stage folders in the order a denoising step's data flows through them;
#: the tools apart
STAGES = ("models", "export", "lowering", "ops", "quant", "backends", "runtime", "lora", "io", "tools")


def misplaced(graph: dict[str, set[str]]) -> list[str]:
    """Modules neither core (directly under prx_compile/) nor in a stage folder, and stage folders that
    are not packages."""
    out = []
    for m in sorted(graph):
        parts = m.split(".")[1:]
        if parts and not (parts[0] in STAGES or (len(parts) == 1 and parts[0] in CORE)):
            out.append(m)
    return out + [f"prx_compile.{s} (no __init__.py)" for s in STAGES if f"prx_compile.{s}" not in graph]


@pytest.fixture
def planted(tmp_path):
    """plant({path: code}) -> the import graph of a copy of the package with each ``code`` added to its
    ``path`` (a file under prx_compile/, created with its folders if missing; code None removes the
    file): the checks read real files, as on the checkout."""

    def plant(files: dict[str, str]) -> dict[str, set[str]]:
        root = tmp_path / f"tree{len(list(tmp_path.iterdir()))}"
        shutil.copytree(PKG, root / "prx_compile", ignore=shutil.ignore_patterns("__pycache__"))
        for path, code in files.items():
            target = root / "prx_compile" / path
            if code is None:
                target.unlink()
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text((target.read_text() if target.exists() else "") + "\n" + code + "\n")
        return import_graph(root)

    return plant


def test_the_top_level_holds_the_core_modules_and_the_stage_folders(planted):
    graph = import_graph()
    assert misplaced(graph) == []
    assert {m.split(".")[1] for m in graph if m.count(".") == 1} == set(CORE[1:]) | set(STAGES)  # all there
    # the core does not reach into the stages: config reads ShapeRange from shapes, not from export
    assert graph["prx_compile.shapes"] <= {"prx_compile.schema", "prx_compile.errors"}
    assert not {t for t in graph["prx_compile.config"] if t.startswith("prx_compile.export")}
    for files, found in (
        # a helper module added at the top
        ({"helpers.py": "def helper(): pass"}, ["prx_compile.helpers"]),
        # a module put back where it was before the stage folders (the old prx_compile/module.py)
        ({"module.py": "from .runtime.module import CompiledTransformer"}, ["prx_compile.module"]),
        # a folder that is no stage
        ({"extras/__init__.py": "", "extras/more.py": ""}, ["prx_compile.extras", "prx_compile.extras.more"]),
    ):
        assert misplaced(planted(files)) == found, (files, misplaced(planted(files)))
    # a stage folder that is no package any more
    assert misplaced(planted({"quant/__init__.py": None})) == ["prx_compile.quant (no __init__.py)"]


def test_no_import_cycles(planted):
    graph = import_graph()
    assert graph["prx_compile.runtime.module"] >= {"prx_compile.backends", "prx_compile.config"}
    assert graph["prx_compile.io.saving"] >= {"prx_compile.runtime.module", "prx_compile.io.artifact"}
    assert not library_cycles(graph), library_cycles(graph)[0]
    assert not cycles(graph), cycles(graph)[0]  # the tools too
    # planted: config imports runtime.module (which imports config), lazily inside a function, as a
    # cycle hides
    bad = planted({"config.py": "def _planted():\n    from .runtime.module import CompiledTransformer"})
    assert ["prx_compile.config", "prx_compile.runtime.module", "prx_compile.config"] in library_cycles(bad)
    # planted: a longer one across stages: lowering.linear -> io.saving -> runtime.module -> ... -> lowering
    bad = planted({"lowering/linear.py": "from ..io.saving import save_compiled"})
    cycle = next(c for c in library_cycles(bad) if c[0] == "prx_compile.lowering.linear")
    assert cycle[1] == "prx_compile.io.saving" and cycle[-1] == "prx_compile.lowering.linear"


def test_public_api():
    for name in (
        "compile_prx",
        "CompileConfig",
        "save_compiled",
        "load_compiled",
        "load_lora",
        "set_lora",
        "unload_lora",
    ):
        assert name in prx_compile.__all__ and callable(getattr(prx_compile, name))
    # generate_images is a tool now: prx_compile.tools.generate.generate_images
    assert "generate_images" not in prx_compile.__all__ and not hasattr(prx_compile, "generate_images")
    from prx_compile.tools.generate import generate_images

    assert callable(generate_images)


def test_the_library_never_imports_the_tools_or_the_fixtures(planted):
    graph = import_graph()
    assert forbidden_imports(graph) == []
    assert len(library(graph)) > 30 and "prx_compile" in library(graph)  # the checks see the library
    # the tools import the library and each other; the entry point imports the CLI: allowed there only
    assert "prx_compile.tools.testing" in graph["prx_compile.tools.cli"]  # the CLI's --tiny model
    assert graph[ENTRY_POINT] == {"prx_compile.tools.cli"}
    dynamic = "import importlib\nimportlib.import_module('prx_compile.tools.pipeline')"
    for files, found in (
        # a function-level import of the fixtures, as a helper would add it
        (
            {"runtime/module.py": "def _planted():\n    from ..tools.testing import make_prx"},
            "prx_compile.tools.testing",
        ),
        # __init__ exporting a tool again (what generate_images was)
        ({"__init__.py": "from .tools.generate import generate_images"}, "prx_compile.tools.generate"),
        ({"__init__.py": "from . import tools"}, "prx_compile.tools"),
        ({"lowering/linear.py": "from ..tools import bench"}, "prx_compile.tools.bench"),
        ({"io/saving.py": "import prx_compile.tools.cli"}, "prx_compile.tools.cli"),
        ({"backends/tensorrt/backend.py": dynamic}, "prx_compile.tools.pipeline"),
        # a copy of the entry point under another name is library code, not the entry point
        ({"entry.py": "from .tools.cli import main"}, "prx_compile.tools.cli"),
        # the fixtures put back into the library (the old prx_compile/testing.py), and imported there
        ({"testing.py": "", "io/cache.py": "from ..testing import make_prx"}, "prx_compile.testing"),
    ):
        where = [p for p, code in files.items() if code][0]
        mod = module_name(PKG / where)
        assert forbidden_imports(planted(files)) == [(mod, found)], (files, forbidden_imports(planted(files)))


def test_the_wheel_ships_the_presets_and_the_command(tmp_path):
    """Build the wheel, install it into a fresh virtual environment outside the checkout (the
    dependencies come from this environment), and resolve every preset there; the wheel's console
    script is the CLI in tools/, ``import prx_compile`` loads none of the tools, and every package of the
    checkout (each stage folder) imports from the wheel."""
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
    import zipfile

    with zipfile.ZipFile(wheel) as z:  # the extras pin the Torch-TensorRT line this release is checked on
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    ]
    for extra, package in (("tensorrt", "torch-tensorrt"), ("tensorrt-rtx", "torch-tensorrt-rtx")):
        pins = [r for r in requires if f'extra == "{extra}"' in r]
        assert any(r.startswith(package) and "<2.12" in r and ">=2.11" in r for r in pins), pins
        assert any(r.startswith("torch<2.12,>=2.11") or r.startswith("torch>=2.11,<2.12") for r in pins), pins
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
        "import importlib.metadata, prx_compile, sys\n"
        "tools = [m for m in sys.modules if m.startswith('prx_compile.tools')]\n"
        "assert not tools, f'import prx_compile loaded {tools}'\n"
        "from prx_compile import CompileConfig\n"
        "from prx_compile.config import list_presets\n"
        "assert prx_compile.__file__.startswith(sys.argv[1]), prx_compile.__file__\n"
        "dist = importlib.metadata.distribution('prx_compile')\n"
        "assert str(dist.locate_file('')).startswith(sys.argv[1]), dist.locate_file('')\n"
        "(main,) = [e.load() for e in dist.entry_points if e.name == 'prx-compile']  # the console script\n"
        "assert main.__module__ == 'prx_compile.tools.cli' and main.__name__ == 'main', main\n"
        "for package in sys.argv[2].split(','):  # every folder of the checkout ships\n"
        "    assert importlib.import_module(package).__file__.startswith(sys.argv[1]), package\n"
        "names = list_presets(); assert 'prx-1024-bf16' in names, names\n"
        "print(len([CompileConfig.resolve(n) for n in names]))"
    )
    r = subprocess.run(
        [str(py), "-c", code, site, ",".join(sorted(module_name(p) for p in PKG.rglob("__init__.py")))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) == len(list((ROOT / "configs").glob("*.yaml")))


# -- one model's knowledge in one folder -------------------------------------------------------------
#: a few leaf names of the models' modules are ordinary words the library uses for its own things
GENERIC = {
    "attention",
    "blocks",
    "linear",
    "norm",
    "proj",
    "act",
    "net",
    "ff",
    "attn",
    "lin",
    "silu",
    "depth",
}


@functools.cache
def model_names() -> frozenset[str]:
    """What names a model: every spec's class, the classes of its modules and processors (those of
    diffusers' transformer files), its modules' leaf names (the tiny model's) and its config keys."""
    from prx_compile.models import SPECS
    from prx_compile.tools.testing import make_model

    names: set[str] = set()
    for spec in SPECS.values():
        model = make_model(spec.name)
        names.add(spec.class_name)
        for name, module in model.named_modules():
            cls = type(module)
            if cls.__module__.startswith("diffusers.models.transformers"):
                names.add(cls.__name__)
            processor = getattr(module, "processor", None)
            if processor is not None:
                names.add(type(processor).__name__)
            leaf = name.rpartition(".")[2]
            if leaf and not leaf.isdigit() and leaf not in GENERIC:
                names.add(leaf)
        names |= {k for k in model.config if not k.startswith("_") and k not in GENERIC}
    return frozenset(names)


def names_a_model(path: Path) -> list[str]:
    """The model names (``model_names``) ``path`` uses in code: identifiers, attributes, string
    constants (split at dots) and keyword arguments; docstrings and comments may speak of models."""
    tree = _parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    forbidden = model_names()
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            words = [node.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = re.split(r"[^A-Za-z0-9_]+", node.value)
        found += [f"{path.name}:{getattr(node, 'lineno', '?')}: {w}" for w in words if w in forbidden]
    return found


def library_files(root: Path = ROOT) -> list[Path]:
    """The library's files outside models/ (the tools are applications over the specs)."""
    pkg = root / "prx_compile"
    return [f for f in sorted(pkg.rglob("*.py")) if f.relative_to(pkg).parts[0] not in ("models", "tools")]


def test_no_library_file_outside_models_names_a_model_or_its_layers(tmp_path):
    assert {
        "PRXTransformer2DModel",
        "FluxTransformer2DModel",
        "img_qkv_proj",
        "single_transformer_blocks",
        "context_in_dim",
        "PRXAttnProcessor2_0",
    } <= model_names()
    found = [hit for f in library_files() for hit in names_a_model(f)]
    assert found == [], found
    planted = tmp_path / "prx_compile" / "runtime" / "helper.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        '"""Names PRXBlock in a docstring: fine."""\nLAYER = "blocks.0.gate_proj"\n'
        "def f(m):\n    return m.config.patch_size\n"
    )
    assert [h.split(": ")[1] for h in names_a_model(planted)] == ["gate_proj", "patch_size"]
