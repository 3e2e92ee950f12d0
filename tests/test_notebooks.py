"""notebooks/: the tour and the Colab notebook run top to bottom in their small mode
(NOTEBOOK_SMALL=1: a toy corpus, a tiny model, offline), every cell; what the tour draws comes
from the repo's modules; the committed tour carries its outputs, the Colab notebook none."""

import re

import nbformat
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOKS = ROOT / "notebooks"


def execute(name, tmp_path, monkeypatch):
    """The notebook run in a kernel of this Python, from notebooks/, in small mode; a cell
    that raises fails the test (nbclient's CellExecutionError)."""
    monkeypatch.setenv("NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("NOTEBOOK_WORK", str(tmp_path))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_tour_runs_and_draws_the_models_own_masks(tmp_path, monkeypatch):
    """Every cell runs; each picture is drawn (a PNG); the causal mask the tour draws is the
    model's (model.causal_mask): position i sees positions <= i, so breaking the model's
    mask breaks this test."""
    nb = execute("tour.ipynb", tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    pictures = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert pictures >= 7
    masks = next(c for c in code if "masks" in c.metadata.get("tags", []))
    rows = [[int(x) for x in re.findall(r"\d", line)]
            for line in text_of(masks).split("as the model applies it:")[1]
            .split("dtype")[0].splitlines() if "[" in line]
    assert len(rows) > 2 and rows == [[int(j <= i) for j in range(len(rows))]
                                      for i in range(len(rows))], rows
    assert "the same output as model.attention: True" in "".join(map(text_of, code))


def test_the_colab_notebook_trains_translates_scores_and_exports(tmp_path, monkeypatch):
    nb = execute("colab.ipynb", tmp_path, monkeypatch)
    out = "".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "wrote the CTranslate2 model (int8)" in out and "train.py's test, beam4: BLEU" in out
    assert (tmp_path / "exported" / "colab" / "model.bin").exists()
    assert (tmp_path / "test.hyp").read_text().strip()


def test_the_committed_notebooks_tour_with_outputs_colab_without():
    """The tour on GitHub shows every picture of a full run (its machine named in the first
    cell's output) and stays small; the Colab notebook carries no outputs (they would come
    from a machine the reader does not have)."""
    tour = nbformat.read(NOTEBOOKS / "tour.ipynb", as_version=4)
    code = [c for c in tour.cells if c.cell_type == "code"]
    pictures = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert pictures >= 7 and "full mode" in text_of(code[0])
    assert (NOTEBOOKS / "tour.ipynb").stat().st_size < 2 * 2**20
    colab = nbformat.read(NOTEBOOKS / "colab.ipynb", as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in colab.cells if c.cell_type == "code")
    assert "parameters" in colab.cells[1].metadata.get("tags", [])  # settings in one cell


def test_the_readmes_badge_opens_the_notebook_of_the_repository_it_clones():
    """The badge and the notebook's REPO setting name one repository: a fork that publishes
    the repo under its own address changes both, or the badge opens a notebook that clones
    another repository."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    badge = re.search(r"colab\.research\.google\.com/github/([^/\s]+/[^/\s]+)/blob/main/"
                      r"notebooks/colab\.ipynb", readme)
    colab = nbformat.read(NOTEBOOKS / "colab.ipynb", as_version=4)
    repo = re.search(r'REPO = "https://github\.com/([^"]+)"', colab.cells[1].source)
    assert badge and repo and badge.group(1) == repo.group(1)
