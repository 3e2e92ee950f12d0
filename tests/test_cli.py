"""nmt/cli.py: run_main where only a process shows it (a stdout whose reader has gone ends
the script quietly, any other broken pipe is a failure shown whole); where a line to stderr
starts (below_a_bar); the parser naming a mistyped flag, a required one too."""

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


@pytest.mark.parametrize("argv, said", [
    (["--refrence", "r.txt"], "unrecognized argument --refrence: did you mean --reference?"),
    (["--reference=r.txt", "--seeed", "1"], "unrecognized argument --seeed: did you mean --seed?"),
    (["--seed", "1"], "the following arguments are required: --reference"),
    (["--seed=1"], "the following arguments are required: --reference"),
    # what argparse takes is no typo: an abbreviation, a word after "--" or with a space
    (["--se", "1"], "the following arguments are required: --reference"),
    (["--seed", "1", "--", "--x"], "the following arguments are required: --reference"),
    (["--seed", "1", "--a sentence"], "the following arguments are required: --reference"),
    # another error than a missing flag is said as argparse says it
    (["--seed", "one", "--refrence", "r.txt"], "argument --seed: invalid int value: 'one'"),
])
def test_a_typo_in_a_required_flag_is_named_not_reported_missing(argv, said, capsys):
    """argparse checks required flags before unknown ones: `compare.py a b --refrence x` said
    --reference was missing."""
    from nmt.cli import ArgumentParser
    parser = ArgumentParser(prog="script.py")
    parser.add_argument("--reference", required=True)
    parser.add_argument("--seed", type=int)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"script.py: error: {said} (see --help)"


def test_a_typo_on_the_command_line_itself_is_named(monkeypatch, capsys):
    """A script's parse_args() reads sys.argv: a typo there is named too."""
    from nmt.cli import ArgumentParser
    parser = ArgumentParser(prog="script.py")
    parser.add_argument("--reference", required=True)
    monkeypatch.setattr(sys, "argv", ["script.py", "--refrence", "r.txt"])
    with pytest.raises(SystemExit):
        parser.parse_args()
    assert "unrecognized argument --refrence: did you mean --reference?" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--seeed=1"], "unrecognized argument --seeed: did you mean --seed?"),
    (["--frobnicate", "1"], "unrecognized argument --frobnicate"),  # nothing near: no guess
    (["--a-b-c-d", "1"], "unrecognized argument --a-b-c-d: did you mean --a_b_c_d?"),
    (["--seeed", "1", "--refrence", "r"], "unrecognized argument --seeed: did you mean --seed?"),
    (["-1"], "unrecognized arguments: -1; one sentence an argument"),  # a value, not a flag
    (["a", "b"], "unrecognized arguments: a b; one sentence an argument"),
])
def test_an_unknown_flag_is_named_with_the_nearest_and_other_words_with_the_leftover(argv, said,
                                                                                     capsys):
    """The first unknown flag (its =value aside) with the nearest known one, dashes read as
    underscores, and no guess where none is near; a number or a word is said with `leftover`."""
    from nmt.cli import ArgumentParser
    parser = ArgumentParser(prog="script.py", leftover="one sentence an argument")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--a_b_c_d")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"script.py: error: {said} (see --help)\n"
    parser = ArgumentParser(prog="script.py", leftover=lambda args: f"seed {args.seed}")
    parser.add_argument("--seed", type=int)
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "3", "word"])
    assert capsys.readouterr().err == \
        "script.py: error: unrecognized arguments: word; seed 3 (see --help)\n"


def test_a_users_error_ends_an_open_bar_first_so_its_line_is_one_of_its_own(capsys):
    """fail(): an open progress bar is closed before the line (in a log, an open bar's line
    has no newline yet: the error would be glued to it)."""
    import io

    from tqdm import tqdm

    from nmt.cli import fail
    bar = tqdm(total=2, file=io.StringIO())
    try:
        with pytest.raises(SystemExit) as exit_:
            fail("script.py", "no such folder")
        assert exit_.value.code == 2 and not tqdm._instances
    finally:
        bar.close()
    assert capsys.readouterr().err == "script.py: error: no such folder\n"
