"""nmt/cli.py's run_main where only a process shows it: a stdout whose reader has gone ends
the script quietly, any other broken pipe is a failure shown whole."""

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
