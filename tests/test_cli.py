"""nmt/cli.py: run_main where only a process shows it (a stdout whose reader has gone ends
the script quietly, any other broken pipe is a failure shown whole); where a line to stderr
starts (below_a_bar)."""

import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = '''
import os, sys
sys.path.insert(0, {root!r})
from nmt.cli import run_main


def main():
    if sys.argv[1] == "stdout":
        print("a line")  # buffered: met by run_main's flush
        return
    read, write = os.pipe()
    os.close(read)
    os.write(write, b"x")  # another pipe's reader gone


run_main("script.py", main)
'''


@pytest.mark.parametrize("pipe", ["stdout", "another"])
def test_a_reader_gone_ends_quietly_only_where_it_was_stdouts(tmp_path, pipe):
    """`translate.py ... | head -1` ended in a BrokenPipeError's traceback; a broken pipe of
    anything else must not be hidden."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    process = subprocess.Popen([sys.executable, str(script), pipe], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)  # (PYTHONUNBUFFERED as CI has it, or not)
    if pipe == "stdout":
        process.stdout.close()  # the reader gone before a line is written
    _, err = process.communicate(timeout=60)  # (else stdout is read: alive)
    err = err.decode()
    assert process.returncode == 1, err
    if pipe == "stdout":
        assert err == ""
    else:
        assert "Traceback" in err and "BrokenPipeError" in err


def test_a_line_to_stderr_starts_below_a_terminals_bar_or_an_open_one(monkeypatch):
    """On a terminal, a bar's line (or the ^C it echoed) is under the cursor: the line starts
    on the next; redirected to a file, only an open tqdm bar's line lacks its newline."""
    import io

    from tqdm import tqdm

    from nmt.cli import below_a_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert below_a_bar() == "\n"
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a file
    assert below_a_bar() == ""
    with tqdm(total=2, file=io.StringIO()):
        assert below_a_bar() == "\n"
    assert below_a_bar() == ""
