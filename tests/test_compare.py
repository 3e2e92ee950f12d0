"""compare.py: paired significance tests between translation files, and its refusals."""

from conftest import run_here


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
