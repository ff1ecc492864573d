"""Every notebook runs top to bottom, headless, on this machine (CPU: tiny model, eager backend)."""

import asyncio
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_all_four_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "lora_refit", "save_load", "benchmark"}


@pytest.fixture(scope="module")
def executed():
    """{path: (the notebook as committed, the executed one or the error it raised)}. Each notebook runs
    in a kernel of its own (a fresh process, as ``jupyter execute`` starts one); the four kernels run at
    the same time, so one's imports overlap another's work on a machine with a spare core."""
    committed = {path: nbformat.read(path, as_version=4) for path in NOTEBOOKS}

    async def run(path):
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(  # four kernels start at once on two cores, without .pyc files in CI:
            nb,  # nbclient's default 60 s for a kernel's first reply is not always enough (seen once)
            timeout=600,
            startup_timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        await client.async_execute()
        return nb

    async def run_all():
        return await asyncio.gather(*(run(path) for path in NOTEBOOKS), return_exceptions=True)

    results = asyncio.run(run_all())
    return {path: (committed[path], result) for path, result in zip(NOTEBOOKS, results, strict=True)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    committed, nb = executed[path]
    assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code"), (
        "outputs must be stripped in git"
    )
    if isinstance(nb, BaseException):
        raise nb
    streams = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "IProgress not found" not in streams  # progress bars render (ipywidgets in the dev extras)
