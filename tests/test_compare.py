"""compare.py: paired significance tests between translation files, and its refusals."""

from conftest import run_here

from nmt.metrics import compare


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_compare_prints_each_system_with_its_interval_and_p_values(tmp_path):
    """Issue 42: each system's BLEU and chrF with its 95% interval, and the p-values of its
    difference from the first by both of sacreBLEU's paired tests, with their signatures."""
    refs = [f"a dog number {i} runs through the green grass" for i in range(40)]
    base = [f"a dog number {i} runs on the grass" for i in range(40)]
    ref = write(tmp_path / "test.de", refs)
    write(tmp_path / "base.hyp", base)
    write(tmp_path / "good.hyp", refs[:20] + base[20:])
    t = run_here("compare.py", "base.hyp", "good.hyp", "--reference", ref, cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()
    out = t.stdout.decode().splitlines()
    assert out[0].split() == ["system", "BLEU", "±", "95%", "CI", "p", "(bs)", "p", "(ar)",
                              "chrF", "±", "95%", "CI", "p", "(bs)", "p", "(ar)"]
    assert out[1].split()[0] == "base.hyp" and out[1].count("baseline") == 4
    good = out[2].split()
    assert good[0] == "good.hyp" and float(good[4]) < 0.01 and float(good[5]) < 0.01
    assert "40 sentences" in t.stdout.decode()
    assert "|bs:1000|seed:12345|" in t.stdout.decode() and "|ar:10000|" in t.stdout.decode()


def test_compare_refuses_files_of_other_lengths_and_a_single_system(tmp_path):
    """Issue 42: a hypothesis file of another length than the reference, one line and exit 2
    (sacreBLEU would stop with a traceback, or score misaligned lines)."""
    ref = write(tmp_path / "ref", ["one two", "three four", "five six"])
    write(tmp_path / "a", ["one two", "three four", "five six"])
    write(tmp_path / "short", ["one two", "three four"])
    for args, said in ((["a", "short"], "short has 2 lines but the reference"),
                       (["a"], "give two or more translation files"),
                       (["a", "missing"], "cannot read missing")):
        t = run_here("compare.py", *args, "--reference", ref, cwd=tmp_path)
        err = t.stderr.decode().strip()
        assert t.returncode == 2 and said in err and len(err.splitlines()) == 1, err
    write(tmp_path / "empty", [])
    t = run_here("compare.py", "a", "a", "--reference", tmp_path / "empty", cwd=tmp_path)
    assert t.returncode == 2 and "is empty" in t.stderr.decode()


def test_a_zero_difference_is_never_significant_and_p_is_the_same_both_ways(tmp_path):
    """Issue 56, 1: two files that differ only by a space before the final period score the
    same BLEU and chrF, and so do two different files that both score 0: neither test may
    reject (sacreBLEU counted only strictly larger differences: p = 0.001 and 0.0001). A real
    difference gets the same p-values whichever file is the baseline."""
    refs = [f"a dog number {i} runs through the green grass." for i in range(40)]
    base = [f"a dog number {i} runs on the grass." for i in range(40)]
    ref = write(tmp_path / "test.de", refs)
    write(tmp_path / "a.hyp", base)
    write(tmp_path / "b.hyp", [line.replace(".", " .") for line in base])  # sed 's/\./ ./'
    write(tmp_path / "z1.hyp", ["xx yy"] * 40)
    write(tmp_path / "z2.hyp", ["qq zz ww"] * 40)
    write(tmp_path / "good.hyp", refs[:10] + base[10:])

    def p_values(base, system):  # BLEU p (bs), p (ar), chrF p (bs), p (ar)
        found = compare([("base", read(base)), ("system", read(system))], refs,
                        n_bootstrap=200, n_randomization=500)
        return [found[m][1][p] for m in ("bleu", "chrf") for p in ("p_bs", "p_ar")]

    def read(name):
        return (tmp_path / name).read_text(encoding="utf-8").splitlines()
    t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", ref, cwd=tmp_path)  # as a user
    row = t.stdout.decode().splitlines()[2].split()  # b.hyp's row
    assert t.returncode == 0 and [float(row[i]) for i in (4, 5, 9, 10)] == [1.0] * 4, row
    assert p_values("a.hyp", "b.hyp") == [1.0] * 4
    assert p_values("z1.hyp", "z2.hyp")[:2] == [1.0, 1.0]  # BLEU 0 against 0
    forward, backward = p_values("a.hyp", "good.hyp"), p_values("good.hyp", "a.hyp")
    assert forward == backward and max(forward) < 0.01


def test_compare_papers_bleu_from_the_command_line(tmp_path):
    """Issue 61: --papers_bleu LANG prints the papers' BLEU, named, with no chrF column."""
    refs = write(tmp_path / "ref.tok.de", [f"ein hund nummer {i} läuft ." for i in range(20)])
    write(tmp_path / "a.hyp", [f"Ein Hund Nummer {i} rennt." for i in range(20)])
    write(tmp_path / "b.hyp", [f"Ein Hund Nummer {i} läuft." for i in range(20)])
    t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", refs, "--papers_bleu", "de",
                 cwd=tmp_path)
    assert t.returncode == 0, t.stderr.decode()
    out = t.stdout.decode().splitlines()
    assert out[0].startswith("papers' BLEU (lowercased, Moses-tokenized")
    assert "chrF" not in out[1] and out[3].split()[:2] == ["b.hyp", "100.00"]


def test_compare_tokenized_bleu_from_the_command_line(tmp_path):
    """--tokenized_bleu LANG [--compound_split] prints the paper's tokenized BLEU, named, with
    no chrF column; with --papers_bleu, or --compound_split alone, one line and exit 2."""
    refs = write(tmp_path / "ref.de", [f"Ein Hund Nummer {i} läuft ins Rich-Text-Gras." for i in
                                       range(20)])
    write(tmp_path / "a.hyp", [f"Ein Hund Nummer {i} rennt." for i in range(20)])
    write(tmp_path / "b.hyp", [f"Ein Hund Nummer {i} läuft ins Rich-Text Gras." for i in range(20)])
    rows = {}
    for split in ([], ["--compound_split"]):
        t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", refs, "--tokenized_bleu",
                     "de", *split, cwd=tmp_path)
        assert t.returncode == 0, t.stderr.decode()
        out = t.stdout.decode().splitlines()
        assert out[0] == ("tokenized BLEU (cased, Moses-tokenized" +
                          (", compounds split" if split else "") + "; not sacreBLEU's)")
        assert "chrF" not in out[1] and out[3].split()[0] == "b.hyp"
        rows[bool(split)] = float(out[3].split()[1])
    assert rows[True] > rows[False] + 10, rows  # split, the compound's parts match
    for flags, message in ((["--tokenized_bleu", "de", "--papers_bleu", "de"], "give one of "
                            "--papers_bleu (Multi30k's papers) and --tokenized_bleu"),
                           (["--compound_split"], "--compound_split goes with --tokenized_bleu"),
                           (["--tokenized_bleu", ""], "--tokenized_bleu takes the language"),
                           (["--papers_bleu", " "], "--papers_bleu takes the language")):
        t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", refs, *flags, cwd=tmp_path)
        err = t.stderr.decode()
        assert t.returncode == 2 and message in err and err.count("\n") == 1, err


def test_a_language_moses_does_not_know_is_warned_of_and_scored_by_englishs_rules(tmp_path):
    """--tokenized_bleu or --papers_bleu with a language sacremoses has no rules for: one
    warning line on stderr, the table all the same; a language it knows: no warning."""
    refs = write(tmp_path / "ref.txt", [f"Mr. Dog {i} runs." for i in range(10)])
    write(tmp_path / "a.hyp", [f"Mr. Dog {i} walks." for i in range(10)])
    write(tmp_path / "b.hyp", [f"Mr. Dog {i} runs." for i in range(10)])
    for flags, warned in ((["--tokenized_bleu", "xx"], True), (["--papers_bleu", "xx"], True),
                          (["--tokenized_bleu", "en"], False), ([], False)):
        t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", refs, *flags, cwd=tmp_path)
        assert t.returncode == 0, t.stderr.decode()
        assert ("Moses has no rules of its own for 'xx'" in t.stderr.decode()) == warned, flags
        assert "b.hyp" in t.stdout.decode()


def test_a_language_moses_knows_leaves_stderr_empty(tmp_path):
    """With a language sacremoses has rules for, or sacreBLEU's table, nothing is said on
    stderr (no line where moses_fallback found nothing to warn of)."""
    refs = write(tmp_path / "ref.txt", [f"Mr. Dog {i} runs." for i in range(10)])
    write(tmp_path / "a.hyp", [f"Mr. Dog {i} walks." for i in range(10)])
    write(tmp_path / "b.hyp", [f"Mr. Dog {i} runs." for i in range(10)])
    for flags in (["--tokenized_bleu", "en"], ["--papers_bleu", "de"], []):
        t = run_here("compare.py", "a.hyp", "b.hyp", "--reference", refs, *flags, cwd=tmp_path)
        assert t.returncode == 0 and t.stderr.decode() == "", (flags, t.stderr.decode())


def test_the_docstrings_command_keeps_its_continuation_line():
    """compare.py's docstring shows a command over two lines with a shell `\\` continuation;
    in a plain (not raw) string the `\\` and the line break vanished, the two lines run
    together."""
    import ast

    from conftest import ROOT
    doc = ast.get_docstring(ast.parse((ROOT / "compare.py").read_text(encoding="utf-8")),
                            clean=False)
    assert "--reference tok/test_2016_flickr.lc.norm.tok.de \\\n        --papers_bleu de" in doc


def test_help_shows_the_example_commands_as_written_and_the_description_once(tmp_path):
    """`compare.py --help` repeated the description in its epilog, its commands run together
    into one paragraph (argparse refills an epilog that is not raw)."""
    from conftest import run_here
    shown = run_here("compare.py", "--help", cwd=tmp_path)
    assert shown.returncode == 0
    text = shown.stdout.decode()
    assert "\n    python compare.py a.hyp b.hyp --reference test.de              # a: the " \
           "baseline\n" in text
    assert text.count("Is one system's score really higher") == 1


def test_each_p_value_is_printed_under_its_own_tests_column():
    """The table's columns are p (bs) then p (ar) for each metric: each p-value under its own
    test's heading (the two swapped looked as plausible, and both tiny in the other tests)."""
    from compare import table
    found = {"systems": ["base", "sys"],
             "bleu": [{"score": 30.0, "ci": 1.0, "p_bs": None, "p_ar": None},
                      {"score": 32.0, "ci": 1.1, "p_bs": 0.0123, "p_ar": 0.0456}],
             "chrf": [{"score": 50.0, "ci": 0.5, "p_bs": None, "p_ar": None},
                      {"score": 51.0, "ci": 0.6, "p_bs": 0.0789, "p_ar": 0.0987}]}
    head, base, row = table(found).splitlines()
    assert head.split()[5:9] == ["p", "(bs)", "p", "(ar)"]
    assert row.split() == ["sys", "32.00", "±", "1.10", "0.0123", "0.0456", "51.00", "±",
                           "0.60", "0.0789", "0.0987"]


def test_files_of_one_name_in_different_folders_are_told_apart(tmp_path):
    """Systems are named by their file's name; two files of one name in different folders
    (a/test.hyp, b/test.hyp) are named by their paths, not both `test.hyp`."""
    from compare import read_systems
    ref = write(tmp_path / "ref", ["one two"])
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write(tmp_path / folder / "test.hyp", ["one two"])
    paths = [tmp_path / "a" / "test.hyp", tmp_path / "b" / "test.hyp"]
    _, systems = read_systems(paths, ref)
    assert [name for name, _ in systems] == [str(p) for p in paths]
    _, systems = read_systems([paths[0], ref], ref)
    assert [name for name, _ in systems] == ["test.hyp", "ref"]
