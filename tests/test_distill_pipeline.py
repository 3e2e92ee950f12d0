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
            "student_both_s2": "avg5.b5", "teacher_s3": "avg5.b5", "ensemble3": "best.b5"}
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


def test_a_scripts_command_is_logged_and_a_failure_stops_with_its_exit_status(
        tmp_path, monkeypatch, capsys):
    """Pipeline.run: each command is written to eval/commands.sh and printed before it runs
    (this Python, a script of the checkout, run from the checkout), its seconds are returned,
    and a failed script stops the pipeline with the script's own exit status and a line that
    says the same command goes on."""
    import shlex
    import sys
    import time
    from types import SimpleNamespace

    from dev import distill_pipeline as module
    clock, seen = [1000.0], []

    def call(command, cwd=None):
        seen.append((command, cwd))
        clock[0] += 90.0
        return [0, 3][len(seen) - 1]
    monkeypatch.setattr(module.subprocess, "call", call)
    monkeypatch.setattr(module, "time", SimpleNamespace(time=lambda: clock[0],
                                                        strftime=time.strftime))
    pipeline = module.Pipeline(SimpleNamespace(runs=tmp_path / "runs", data_dir=tmp_path,
                                               threads=1))
    assert pipeline.run("translate.py", "--beam", 4) == 90.0
    assert seen == [([sys.executable, str(module.ROOT / "translate.py"), "--beam", "4"],
                     module.ROOT)]
    with pytest.raises(SystemExit) as stop:
        pipeline.run("train.py", "--seed", 1)
    assert stop.value.code == 3
    # a shell script that runs them again as run: from the checkout, with this Python
    logged = (tmp_path / "runs/eval/commands.sh").read_text().splitlines()
    assert [shlex.split(line) for line in logged] == [
        ["cd", str(module.ROOT)],
        [sys.executable, str(module.ROOT / "translate.py"), "--beam", "4"],
        [sys.executable, str(module.ROOT / "train.py"), "--seed", "1"]]
    out = capsys.readouterr().out
    assert f"{module.ROOT / 'train.py'} --seed 1" in out
    assert "stopped: train.py exited 3; the same command goes on" in out


@pytest.mark.parametrize("flags, bf16", [("avx512f avx512_bf16", True), ("amx_bf16 avx2", True),
                                         ("avx2 avx512f", False), (None, False)])
def test_bf16_is_chosen_where_the_cpu_computes_it(tmp_path, monkeypatch, flags, bf16):
    """The teachers train in bf16 where /proc/cpuinfo names either bf16 instruction set, else
    (or with no /proc/cpuinfo) in fp32."""
    from dev import distill_pipeline as module
    if flags is not None:
        (tmp_path / "cpuinfo").write_text(f"processor : 0\nflags : sse {flags}\n")
    monkeypatch.setattr(module, "Path", lambda path: tmp_path / "cpuinfo")
    assert module.cpu_has_bf16() is bf16


def test_a_training_stopped_midway_resumes_with_its_own_flags(pipeline):
    """A training stage whose folder holds a checkpoint is resumed with the folder's flags only
    (train.py resumes with those it was trained with), a fresh one gets the whole command."""
    module, args, calls, stop_at, runs, _ = pipeline
    (runs / "teacher_s1").mkdir(parents=True)
    torch.save(tiny_state(provenance={"seconds": 60.0}), runs / "teacher_s1/tmodel_03.pt")
    stop_at[0] = 3
    with pytest.raises(SystemExit):
        module.main(args)
    resumed, fresh = (a for s, a in calls[:2])
    assert resumed == ["--model_folder", f"{runs}/teacher_s1", "--experiment_name",
                       f"{runs}/tb/teacher_s1", "--threads", "1"]
    assert fresh[:2] == ["--data_dir", args[args.index("--data_dir") + 1]]
    assert fresh[fresh.index("--seed") + 1] == "2" and "--model_folder" in fresh


def test_three_teachers_two_ensembles_and_a_students_best_checkpoint_distillation(
        pipeline, monkeypatch):
    """With three teachers: the ensembles of the first 2 and of all 3, the students distilled
    from the ensemble of all 3 (here its best checkpoints: no averaging), each paired test
    against its baseline, the threads, precision and minutes of each command as given, and the
    papers' BLEU on the tokenized, lowercased references."""
    import time
    from types import SimpleNamespace

    from nmt.metrics import papers_bleu, score
    module, args, calls, _, runs, _ = pipeline
    data = runs.parent / "data"
    cased = data / "test_2016_flickr.de"  # (tok/ keeps the lowercased references)
    cased.write_text(cased.read_text().title())
    clock = iter(range(0, 10_000, 90))  # the teachers' decodings: 90 s
    monkeypatch.setattr(module, "time", SimpleNamespace(time=lambda: next(clock),
                                                        strftime=time.strftime))
    args = args[:args.index("--teacher_seeds")] + ["--teacher_seeds", "1", "2", "3"] + \
        args[args.index("--student_seeds"):-1] + ["3"]  # --threads 3
    paired = []
    monkeypatch.setattr(module.Pipeline, "paired_tests",
                        lambda self, name, baseline, others: paired.append((name, baseline,
                                                                           others)))
    monkeypatch.setattr(module, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(module, "load_checkpoint",
                        lambda path, mmap: {"provenance": {"seconds": 150.0}})
    module.main(args)
    ensembles = {a[a.index("--output") + 1].split("/")[-1].split(".")[0]:
                 a[a.index("--ensemble") + 1] for s, a in calls if "--ensemble" in a}
    teachers = [f"{runs}/teacher_s{s}" for s in (1, 2, 3)]
    assert ensembles == {"ensemble2": ",".join(teachers[:2]), "ensemble3": ",".join(teachers)}
    students = ["student_both_s1", "student_both_s2"]
    assert paired == [("teachers", "teacher_s1", ["ensemble2", "ensemble3"]),
                      ("students_vs_hour", "teacher_s1", students),
                      ("students_vs_ensemble", "ensemble3", students)]
    trained = [a for s, a in calls if s == "train.py"]
    assert all(a[a.index("--precision") + 1] == "bf16" for a in trained[:3])
    assert all(a[a.index("--threads") + 1] == "3" for s, a in calls)
    distilled = trained[3]  # ensemble3 chose its best checkpoints, beam 5
    assert distilled[distilled.index("--distill_from") + 1] == ",".join(
        f"{t}/tmodel_best.pt" for t in teachers)
    assert "--distill_average" not in distilled
    assert distilled[distilled.index("--distill_beam") + 1] == "5"
    for args_given in (a for s, a in calls if s == "translate.py"):  # as its file name says
        decoding, beam, split = args_given[args_given.index("--output") + 1].split(".")[1:4]
        assert args_given[args_given.index("--beam") + 1] == beam[1:]
        assert " ".join(module.DECODINGS[decoding]) in " ".join(args_given)
        assert args_given[args_given.index("--input") + 1] == str(data / f"{split}.en")
    stage = json.loads((runs / "stages/teacher_s2.json").read_text())  # (150 s)
    assert stage["minutes"] == 2.5 and stage["command"].startswith("python train.py")
    assert "--num_epochs 42 --seed 2 --model_folder" in stage["command"]
    assert json.loads((runs / "stages/teachers.json").read_text())["minutes"] == 1.5
    scores = json.loads((runs / "eval/scores.json").read_text())
    assert scores["teacher_s1"]["test"]["papers_bleu"] == 100.0  # (its references)
    student = scores["student_distilled_s1"]  # (its test translation is not the reference)
    hyp = (runs / "eval" / student["test_file"]).read_text().splitlines()
    found = score(hyp, (data / "test_2016_flickr.de").read_text().splitlines(), False)
    tok = (data / "tok/test_2016_flickr.lc.norm.tok.de").read_text().splitlines()
    assert student["test"] == {"bleu": round(found["bleu"], 2), "chrf": round(found["chrf"], 2),
                               "papers_bleu": round(papers_bleu(hyp, tok, "de")["bleu"], 2)}


def test_the_paired_tests_put_the_baseline_first_and_run_once(tmp_path, monkeypatch):
    """paired_tests: compare.py on the baseline's test translation first, then the others', once
    against the cased references (sacreBLEU) and once against the tokenized ones (the papers'
    BLEU); a table already written is not computed again."""
    from types import SimpleNamespace

    from dev import distill_pipeline as module
    runs, data = tmp_path / "runs", tmp_path / "data"
    pipeline = module.Pipeline(SimpleNamespace(runs=runs, data_dir=data, threads=1))
    pipeline.scores = {name: {"test_file": f"{name}.hyp"} for name in ("a", "b", "c")}
    argvs = []

    def compare(argv):
        argvs.append(argv)
        print("the papers' table" if "--papers_bleu" in argv else "sacreBLEU's table")
    monkeypatch.setattr(module.compare, "main", compare)
    pipeline.paired_tests("x", "b", ["a", "c"])
    files = [str(runs / "eval" / f"{name}.hyp") for name in "bac"]
    assert sorted(argvs, key=len) == [
        files + ["--reference", str(data / "test_2016_flickr.de")],
        files + ["--reference", str(data / "tok/test_2016_flickr.lc.norm.tok.de"),
                 "--papers_bleu", "de"]]
    assert (runs / "eval/x.compare").read_text() == "sacreBLEU's table\n"
    assert (runs / "eval/x.papers.compare").read_text() == "the papers' table\n"
    (runs / "eval/x.papers.compare").unlink()
    pipeline.paired_tests("x", "b", ["a", "c"])  # (stopped before the papers' table)
    assert len(argvs) == 3 and argvs[2][-1] == "de"
    assert (runs / "eval/x.papers.compare").read_text() == "the papers' table\n"


@pytest.mark.parametrize("seeds", [["1"], ["1", "1"], ["1", "2", "1"]])
def test_one_teacher_seed_or_a_repeated_one_is_refused(pipeline, capsys, seeds):
    """--teacher_seeds 1 made "ensembles" of one model and paired-tested it against itself; a
    repeated seed trained one teacher into both places: each is refused before any stage."""
    module, args, calls, _, runs, _ = pipeline
    at = args.index("--teacher_seeds")
    with pytest.raises(SystemExit) as e:
        module.main(args[:at + 1] + seeds + args[at + 3:])
    assert e.value.code == 2 and calls == [] and not runs.exists()
    assert capsys.readouterr().err.endswith("error: --teacher_seeds: two seeds or more, each "
                                            "once (the teachers' ensembles)\n")


def test_status_prints_the_stages_done_and_the_scores_and_runs_nothing(pipeline, capsys):
    """--status: each stage done with its record, each scored system with its chosen decoding
    and test scores, read from the runs folder; nothing is run."""
    module, args, calls, _, runs, _ = pipeline
    (runs / "stages").mkdir(parents=True)
    (runs / "eval").mkdir()
    (runs / "stages/teacher_s1.json").write_text(json.dumps({"minutes": 2.0}, indent=1))
    (runs / "eval/scores.json").write_text(json.dumps({"teacher_s1": {
        "chosen": "avg3.b5", "test": {"bleu": 40.5}}}))
    module.main(args + ["--status"])
    assert calls == []
    assert capsys.readouterr().out.splitlines() == [
        'teacher_s1 {  "minutes": 2.0 }', "teacher_s1 avg3.b5 {'bleu': 40.5}"]


def test_commands_sh_runs_them_again_with_spaces_and_quotes(tmp_path, monkeypatch):
    """eval/commands.sh is a shell script that runs each command again as it was run: from the
    checkout (a path with a space in it) with arguments holding spaces and quotes, each one
    argument (they were joined with spaces, and the checkout's path unquoted)."""
    import subprocess
    from types import SimpleNamespace

    from dev import distill_pipeline as module
    root = tmp_path / "my checkout"
    root.mkdir()
    (root / "show.py").write_text("import json, os, sys\n"
                                  "open('shown', 'a').write(json.dumps([os.getcwd(), "
                                  "*sys.argv[1:]]) + '\\n')\n")
    monkeypatch.setattr(module, "ROOT", root)
    monkeypatch.setattr(module.subprocess, "call", lambda command, cwd=None: 0)
    pipeline = module.Pipeline(SimpleNamespace(runs=tmp_path / "runs", data_dir=tmp_path,
                                               threads=1))
    pipeline.run("show.py", "--title", "a b", "it's $HOME")
    pipeline.run("show.py", 2)
    monkeypatch.chdir(tmp_path)
    assert subprocess.run(["sh", str(tmp_path / "runs/eval/commands.sh")]).returncode == 0
    shown = [json.loads(line) for line in (root / "shown").read_text().splitlines()]
    assert shown == [[str(root), "--title", "a b", "it's $HOME"], [str(root), "2"]]
