"""dev/distill_pipeline.py: the stages in order, each decision taken on validation, and a
pipeline stopped anywhere going on from where it stopped. The scripts it runs are stood in for
(the training and decoding they do are tested in their own files): train.py writes a
checkpoint with its minutes, translate.py writes the reference, worse for all decodings but one
a model."""

import json

import pytest
import torch

from conftest import number_pairs, tiny_state


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    from dev import distill_pipeline
    data = tmp_path / "data"
    (data / "tok").mkdir(parents=True)
    for split, seed in (("val", 1), ("test_2016_flickr", 2)):
        pairs = number_pairs(30, seed=seed)
        (data / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs))
        (data / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs))
    (data / "tok/test_2016_flickr.lc.norm.tok.de").write_text(
        (data / "test_2016_flickr.de").read_text().replace(".", " ."))
    best = {"teacher_s1": "avg3.b5", "teacher_s2": "best.b4", "ensemble2": "avg5.b4",
            "student_distilled_s1": "best.b5", "student_both_s1": "avg3.b4",
            "student_both_s2": "avg5.b5"}
    calls, found = [], []

    def run(self, script, *args):
        args = [str(a) for a in args]
        calls.append((script, args))
        if len(calls) == stop_at[0]:
            raise SystemExit(130)
        if script == "train.py":
            folder = tmp_path / "runs" / args[args.index("--model_folder") + 1].split("/")[-1]
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(tiny_state(provenance={"seconds": 120.0}), folder / "tmodel_00.pt")
            if "--distill_from" in args:
                found.append((folder.name, (folder / "distilled/meta.json").exists()))
                (folder / "distilled").mkdir(exist_ok=True)
                (folder / "distilled/meta.json").write_text("{}")
        else:
            out = args[args.index("--output") + 1]
            name = out.split("/")[-1].split(".")[0]
            decoding = ".".join(out.split("/")[-1].split(".")[1:3])
            split = "val" if ".val." in out else "test_2016_flickr"
            lines = (data / f"{split}.de").read_text().splitlines()
            worse = 1 if decoding != best[name] else 3 if name == "student_distilled_s1" else 0
            lines = [" ".join(line.split()[:-1]) or "x" if worse and i % worse == 0 else line
                     for i, line in enumerate(lines)]  # (the "both" student validates better)
            open(out, "w").write("".join(line + "\n" for line in lines))
        return 1.0
    monkeypatch.setattr(distill_pipeline.Pipeline, "run", run)
    stop_at = [0]
    args = ["--runs", str(tmp_path / "runs"), "--data_dir", str(data), "--teacher_seeds", "1",
            "2", "--student_seeds", "1", "2", "--threads", "1"]
    return distill_pipeline, args, calls, stop_at, tmp_path / "runs", found


def test_the_stages_run_in_order_and_choose_on_validation(pipeline):
    module, args, calls, _, runs, found = pipeline
    module.main(args)
    trained = [a[a.index("--model_folder") + 1].split("/")[-1] for s, a in calls
               if s == "train.py"]
    # teachers, the two modes with the first seed, the mode validation prefers with the second
    assert trained == ["teacher_s1", "teacher_s2", "student_distilled_s1", "student_both_s1",
                       "student_both_s2"]
    first = next(a for s, a in calls if s == "train.py")
    assert first[first.index("--num_epochs") + 1] == "42" and "multi30k_modern" in first
    both = [a for s, a in calls if s == "train.py" and "student_both_s1" in " ".join(a)][0]
    # the ensemble of the teachers with its chosen decoding (avg5.b4), half the epochs
    assert both[both.index("--distill_average") + 1] == "5"
    assert both[both.index("--distill_beam") + 1] == "4"
    assert both[both.index("--num_epochs") + 1] == "21"
    assert both[both.index("--distill_from") + 1] == f"{runs}/teacher_s1,{runs}/teacher_s2"
    scores = json.loads((runs / "eval/scores.json").read_text())
    assert {name: entry["chosen"] for name, entry in scores.items()} == {
        "teacher_s1": "avg3.b5", "teacher_s2": "best.b4", "ensemble2": "avg5.b4",
        "student_distilled_s1": "best.b5", "student_both_s1": "avg3.b4",
        "student_both_s2": "avg5.b5"}
    assert scores["teacher_s1"]["test"]["bleu"] == 100.0
    # each test set decoded once, with the chosen decoding only
    tests = [a for s, a in calls if s == "translate.py" and "test_2016_flickr.en" in " ".join(a)]
    assert len(tests) == 6
    for name in ("teachers", "students_vs_hour", "students_vs_ensemble"):
        assert (runs / f"eval/{name}.compare").read_text().strip()
        assert "papers' BLEU" in (runs / f"eval/{name}.papers.compare").read_text()
    assert json.loads((runs / "stages/teacher_s1.json").read_text())["minutes"] == 2.0
    # the later students found the first's translations: copied, not made again
    assert found == [("student_distilled_s1", False), ("student_both_s1", True),
                     ("student_both_s2", True)]


@pytest.mark.parametrize("stop", [2, 9, 40])  # a teacher, the teachers' decoding, a student's
def test_a_stopped_pipeline_goes_on_where_it_stopped(pipeline, stop, monkeypatch):
    """Stopped at any call, then run again: nothing finished is done twice, and the whole is
    the same as one unbroken run's."""
    module, args, calls, stop_at, runs, _ = pipeline
    monkeypatch.setattr(module.Pipeline, "paired_tests", lambda self, name, *systems: None)
    stop_at[0] = stop
    with pytest.raises(SystemExit):
        module.main(args)
    before = calls[:stop - 1]  # (the stopped call did not finish)
    stop_at[0] = 0
    calls.clear()
    module.main(args)
    again = calls
    finished_outputs = {a[a.index("--output") + 1] for s, a in before if s == "translate.py"}
    assert not finished_outputs & {a[a.index("--output") + 1] for s, a in again
                                   if s == "translate.py"}
    done_training = [a for s, a in before if s == "train.py"]
    for args_done in done_training:  # a finished training stage is not started again
        assert args_done not in [a for s, a in again if s == "train.py"]
    assert (runs / "stages/students.json").exists()


def test_ctrl_c_stops_the_pipeline_in_one_line(pipeline, monkeypatch, capsys):
    """Ctrl-C (here, in a stage) ends `python -m dev.distill_pipeline` with one line saying how
    to go on, and exit 130; no traceback."""
    module, args, calls, stop_at, runs, _ = pipeline

    def interrupted(self, script, *a):
        raise KeyboardInterrupt
    monkeypatch.setattr(module.Pipeline, "run", interrupted)
    with pytest.raises(SystemExit) as stop:
        module.cli(args)
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("python -m dev.distill_pipeline: stopped; run the same command again "
                       "to go on where it stopped") and "Traceback" not in "".join(err)
