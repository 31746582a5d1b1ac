"""The quickstart notebook runs top to bottom (each cell asserts what it shows), shows its plot inline (an image
output, no file written), and prints no warnings or progress bars."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(NOTEBOOK.parents[1]))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the MSA plot is shown inline"
    assert list(tmp_path.iterdir()) == [], "the notebook writes no files"
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in stderr and "%|" not in stderr, stderr  # no TqdmWarning, no progress bars
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert "192 tokens in blocks of 16: the last query sees 12 blocks and keeps 4" in text, text
