"""Every notebook runs top to bottom, headless, on this machine (CPU: tiny model, eager backend)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_all_four_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "lora_refit", "save_load", "benchmark"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "outputs must be stripped in git"
    )
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    streams = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "IProgress not found" not in streams  # progress bars render (ipywidgets in the dev extras)
