"""notebooks/: the tour and the Colab notebook run top to bottom in their small mode
(NOTEBOOK_SMALL=1: a toy corpus, a tiny model, offline), every cell; what the tour draws comes
from the repo's modules; the committed tour carries its outputs, the Colab notebook none."""

import re

import nbformat
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOKS = ROOT / "notebooks"


def this_python_kernel(folder):
    """A kernelspec, in `folder`, that starts this very interpreter (sys.executable): the
    name "python3" may find a user's or the system's kernel of another Python first (issue 63,
    10). Returns its name; JUPYTER_PATH must include `folder`."""
    import json
    import sys
    spec = folder / "kernels" / "nmt-tests"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "this Python", "language": "python"}), encoding="utf-8")
    return "nmt-tests"


def execute(name, tmp_path, monkeypatch):
    """The notebook run in a kernel of this Python, from notebooks/, in small mode; a cell
    that raises fails the test (nbclient's CellExecutionError). A last cell, added here, prints
    the kernel's interpreter: the test checks it is this one."""
    import sys
    monkeypatch.setenv("NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("NOTEBOOK_WORK", str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    kernel = this_python_kernel(tmp_path / "jupyter")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('kernel:', sys.executable)"))
    NotebookClient(nb, timeout=240, kernel_name=kernel,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    assert text_of(nb.cells[-1]).strip() == f"kernel: {sys.executable}"
    return nb


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_tour_runs_and_draws_the_models_own_masks(tmp_path, monkeypatch):
    """Every cell runs; each picture is drawn (a PNG); the causal mask the tour draws is
    model.causal_mask, position i sees positions <= i (breaking that function fails the rows
    check); the model's own forward, whose fused attention takes is_causal=True and never
    calls it, is checked apart: a later target token changes no earlier output. Each check the
    tour prints must print True (issue 63, 14): RoPE's diagonals, attention against
    model.attention, the smoothed target against its formula, beam search's scores against
    their recomputation by teacher forcing."""
    nb = execute("tour.ipynb", tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"][:-1]  # (the kernel's cell)
    assert all(c.execution_count for c in code)
    pictures = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert pictures >= 10
    printed = "".join(map(text_of, code))
    for check in ("equal along each diagonal: True", "the same output as model.attention: True",
                  "the target as the formula: True",
                  "beam search's scores recomputed by teacher forcing: True",
                  "a later target token changes no earlier output: True | and its own output "
                  "changes: True"):
        assert check in printed, check
    for view in ("cross", "encoder", "decoder"):
        assert re.search(rf"{view} +\(layers, heads, queries, keys\) = \(\d+, \d+, \d+, \d+\)",
                         printed), view
    masks = next(c for c in code if "masks" in c.metadata.get("tags", []))
    rows = [[int(x) for x in re.findall(r"\d", line)]
            for line in text_of(masks).split("as the model applies it:")[1]
            .split("dtype")[0].splitlines() if "[" in line]
    assert len(rows) > 2 and rows == [[int(j <= i) for j in range(len(rows))]
                                      for i in range(len(rows))], rows


def test_the_colab_notebook_trains_translates_scores_and_exports(tmp_path, monkeypatch):
    """Its shell commands run this kernel's Python (a PATH whose `python` has no torch fails
    them: issue 63, 4); its scoring cell scores the test set of the corpus the run trained on
    (its settings chose it: issue 63, 11); the export needs the optional engine, which the
    small mode never installs (no network from the suite)."""
    import importlib.util
    import os
    import stat
    fake = tmp_path / "fakebin"
    fake.mkdir()
    for name in ("python", "python3"):  # a `python` on PATH that cannot train
        (fake / name).write_text("#!/bin/sh\necho 'not this python' >&2\nexit 3\n")
        (fake / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    nb = execute("colab.ipynb", tmp_path, monkeypatch)
    out = "".join(text_of(c) for c in nb.cells if c.cell_type == "code")
    assert "train.py's test, beam4: BLEU" in out
    assert "test: 8 pairs of" in out and "corpus, en->it" in out  # the run's own corpus
    assert (tmp_path / "test.hyp").read_text().strip()
    if importlib.util.find_spec("ctranslate2") is None:
        assert "ctranslate2 is not installed: no export" in out
    else:
        assert "wrote the CTranslate2 model (int8)" in out
        assert (tmp_path / "exported" / "colab" / "model.bin").exists()


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


def test_the_tours_training_cell_never_blocks_on_a_full_pipe(tmp_path):
    """Issue 63, 3: the tour's training cell read train.py's output through a pipe it only
    polled: past 64 KiB of progress bars and validation lines (16 KiB on macOS) the child
    blocked writing, for ever. The cell's own code, run against a stand-in train.py that
    writes 300 KiB, must finish."""
    import subprocess
    import sys
    cell = next(c.source for c in nbformat.read(NOTEBOOKS / "tour.ipynb", as_version=4).cells
                if c.cell_type == "code" and "subprocess.Popen" in c.source)
    (tmp_path / "train.py").write_text(
        "import sys\nfrom torch.utils.tensorboard import SummaryWriter\n"
        "w = SummaryWriter('runs'); w.add_scalar('train/loss', 1.0, 1); w.close()\n"
        "sys.stdout.write('x' * 300_000 + '\\nmodel: 0.1M parameters\\n')\n")
    script = (
        "import sys, matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "from pathlib import Path\n"
        "WORK, SMALL, flags = Path('.'), True, []\n"
        "show = lambda fig: plt.close(fig)\n" + cell)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"model: 0.1M parameters" in proc.stdout
