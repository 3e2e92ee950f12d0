"""The distillation measurement of docs/results.md, stage by stage, resumable: run the same
command again after any stop (Ctrl-C, a lost machine, the end of a sitting) and it goes on with
the first stage not done; a training stage resumes from its own checkpoints, a decoding keeps
the files it finished. One stage at a time, in the background:

    nohup python -m dev.distill_pipeline --runs ~/runs --data_dir data/multi30k \\
        > ~/runs/pipeline.log 2>&1 &
    python -m dev.distill_pipeline --runs ~/runs --data_dir data/multi30k --status

The stages, each marked done in RUNS/stages/NAME.json with its command(s) and minutes:
  teacher_sSEED  the 42-epoch command of docs/results.md's bf16 table (--preset
                 multi30k_modern --num_epochs 42, bf16 where the CPU computes it, else fp32
                 with the same epochs) for each --teacher_seeds; the first is the model every
                 result is compared with
  teachers       each teacher and the ensembles of the first 2 and of all, their decoding
                 chosen on validation (the best checkpoint, the average of the last 3 or 5
                 epochs; beam 4 or 5), then scored once on test
  student_MODE_sSEED  the teachers' preset and epochs trained on the ensemble of all teachers'
                 translations, with the ensemble's chosen averaging and beam: --distill_data
                 distilled and both (half the epochs: the same steps) with the first seed, then
                 the mode validation prefers with the second
  students       each student's decoding chosen on validation, test scored once; paired tests
                 (compare.py, cased sacreBLEU and chrF; the papers' BLEU) against the first
                 teacher and against the ensemble of all teachers: RUNS/eval/*.compare
Scores: RUNS/eval/scores.json; every command run: RUNS/eval/commands.sh.
"""

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import compare
from config import Config
from nmt.checkpoint import load_checkpoint, resolve_preload
from nmt.cli import run_main
from nmt.metrics import papers_bleu, score

ROOT = Path(__file__).resolve().parent.parent
DECODINGS = {"best": ["--preload", "best"], "avg3": ["--average", "3"],
             "avg5": ["--average", "5"]}
BEAMS = (4, 5)
EPOCHS = 42  # the 42-epoch row of docs/results.md's bf16 table


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Pipeline:
    def __init__(self, args):
        self.args, self.runs = args, Path(args.runs).expanduser().resolve()
        self.eval = self.runs / "eval"
        for folder in (self.runs / "stages", self.eval):
            folder.mkdir(parents=True, exist_ok=True)
        self.data = Path(args.data_dir).resolve()
        self.scores_path = self.eval / "scores.json"
        self.scores = json.loads(self.scores_path.read_text()) if self.scores_path.exists() \
            else {}

    # ---- bookkeeping ----
    def done(self, stage: str):
        path = self.runs / "stages" / f"{stage}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def mark(self, stage: str, **record):
        path = self.runs / "stages" / f"{stage}.json"
        path.write_text(json.dumps({"ended": time.strftime("%Y-%m-%d %H:%M"), **record},
                                   indent=1))
        print(f"[pipeline] {stage} done: {record}", flush=True)

    def save_scores(self):
        tmp = self.scores_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.scores, indent=1))
        os.replace(tmp, self.scores_path)

    def run(self, script: str, *args) -> float:
        """Runs a script of the repo with this Python; its seconds. A failure stops the
        pipeline with the script's exit status (a stop resumes where it was)."""
        command = [sys.executable, str(ROOT / script), *map(str, args)]
        logged = self.eval / "commands.sh"  # (a shell script: `sh commands.sh` runs them again)
        with open(logged, "a") as log:
            log.write(("" if logged.stat().st_size else f"cd {shlex.quote(str(ROOT))}\n")
                      + shlex.join(command) + "\n")
        print(f"[pipeline] {time.strftime('%H:%M')} {' '.join(command[1:])}", flush=True)
        started = time.time()
        code = subprocess.call(command, cwd=ROOT)
        if code:
            print(f"[pipeline] stopped: {script} exited {code}; the same command goes on",
                  flush=True)
            sys.exit(code)
        return time.time() - started

    # ---- training ----
    def train(self, stage: str, flags: list):
        """A training stage: the whole command on a fresh start, the folder's own flags on a
        resume (a run resumes with the flags it was trained with); minutes over all starts."""
        folder = self.runs / stage
        fresh = not any(folder.glob("tmodel_*.pt"))
        where = ["--model_folder", folder, "--experiment_name", self.runs / "tb" / stage,
                 "--threads", self.args.threads]
        common = ["--data_dir", self.data, "--preset", "multi30k_modern", "--precision",
                  "bf16" if cpu_has_bf16() else "fp32"]
        self.run("train.py", *(common + flags if fresh else []), *where)
        newest = resolve_preload(Config(model_folder=str(folder), preload="latest"))
        seconds = load_checkpoint(newest, mmap=True)["provenance"]["seconds"]  # every start's
        self.mark(stage, minutes=round(seconds / 60, 1), command=" ".join(
            map(str, ["python train.py", *common, *flags, *where])))

    # ---- decoding ----
    def decode(self, name: str, model: list, split: str, decoding: str, beam: int) -> Path:
        out = self.eval / f"{name}.{decoding}.b{beam}.{split}.hyp"
        if not out.exists():
            tmp = out.with_suffix(".tmp")
            self.run("translate.py", *model, *DECODINGS[decoding], "--beam", beam, "--input",
                     self.data / f"{split}.en", "--output", tmp, "--threads", self.args.threads)
            os.replace(tmp, out)
        return out

    def choose_and_test(self, name: str, model: list):
        """Every decoding on validation, the best on test (once): scores.json[name]."""
        entry = self.scores.setdefault(name, {"validation": {}})
        references = read(self.data / "val.de")
        for decoding in DECODINGS:
            for beam in BEAMS:
                key = f"{decoding}.b{beam}"
                if key not in entry["validation"]:
                    hyp = read(self.decode(name, model, "val", decoding, beam))
                    entry["validation"][key] = round(score(hyp, references, False, 1)["bleu"], 2)
                    self.save_scores()
        chosen = max(entry["validation"], key=entry["validation"].get)
        decoding, beam = chosen.split(".b")
        test = self.decode(name, model, "test_2016_flickr", decoding, int(beam))
        references = read(self.data / "test_2016_flickr.de")
        scores = score(read(test), references, False)
        tok = read(self.data / "tok" / "test_2016_flickr.lc.norm.tok.de")
        entry.update(chosen=chosen, test_file=test.name, test={
            "bleu": round(scores["bleu"], 2), "chrf": round(scores["chrf"], 2),
            "papers_bleu": round(papers_bleu(read(test), tok, "de")["bleu"], 2)})
        self.save_scores()
        return entry

    def paired_tests(self, name: str, baseline: str, others: list):
        for papers in (False, True):
            out = self.eval / f"{name}{'.papers' if papers else ''}.compare"
            if out.exists():
                continue
            files = [self.eval / self.scores[m]["test_file"] for m in [baseline, *others]]
            reference = self.data / ("tok/test_2016_flickr.lc.norm.tok.de" if papers
                                     else "test_2016_flickr.de")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):  # compare.py's table, in this process
                compare.main([*map(str, files), "--reference", str(reference),
                              *(["--papers_bleu", "de"] if papers else [])])
            out.write_text(printed.getvalue())

    # ---- the stages ----
    def stages(self):
        seeds = self.args.teacher_seeds
        teachers = [f"teacher_s{s}" for s in seeds]
        for stage, seed in zip(teachers, seeds):
            if not self.done(stage):
                self.train(stage, ["--num_epochs", EPOCHS, "--seed", seed])
        if not self.done("teachers"):
            started = time.time()
            for t in teachers:
                self.choose_and_test(t, ["--model_folder", self.runs / t])
            for k in sorted({2, len(teachers)}):
                self.choose_and_test(f"ensemble{k}", ["--ensemble", ",".join(
                    str(self.runs / t) for t in teachers[:k])])
            self.paired_tests("teachers", teachers[0], [f"ensemble{k}" for k in
                                                   sorted({2, len(teachers)})])
            self.mark("teachers", minutes=round((time.time() - started) / 60, 1))
        ensemble = self.scores[f"ensemble{len(teachers)}"]["chosen"]
        decoding, beam = ensemble.split(".b")
        if decoding == "best":
            distill = ["--distill_from", ",".join(str(self.runs / t / "tmodel_best.pt")
                                                  for t in teachers)]
        else:
            distill = ["--distill_from", ",".join(str(self.runs / t) for t in teachers),
                       "--distill_average", decoding[3:]]
        distill += ["--distill_beam", beam]
        first, second = self.args.student_seeds
        for mode in ("distilled", "both"):
            self.student(mode, first, distill)
        if not self.done("students_chosen"):
            for mode in ("distilled", "both"):
                self.choose_and_test(f"student_{mode}_s{first}",
                                     ["--model_folder", self.runs / f"student_{mode}_s{first}"])
            mode = max(("distilled", "both"), key=lambda m: max(
                self.scores[f"student_{m}_s{first}"]["validation"].values()))
            self.mark("students_chosen", mode=mode)
        mode = self.done("students_chosen")["mode"]
        self.student(mode, second, distill)
        if not self.done("students"):
            students = [f"student_{mode}_s{s}" for s in (first, second)]
            for s in students:
                self.choose_and_test(s, ["--model_folder", self.runs / s])
            self.paired_tests("students_vs_hour", teachers[0], students)
            self.paired_tests("students_vs_ensemble", f"ensemble{len(teachers)}", students)
            self.mark("students")

    def student(self, mode: str, seed: int, distill: list):
        stage = f"student_{mode}_s{seed}"
        if self.done(stage):
            return
        made = [self.runs / s / "distilled" for s in os.listdir(self.runs)
                if s.startswith("student_") and (self.runs / s / "distilled/meta.json").exists()]
        target = self.runs / stage / "distilled"
        if made and not target.exists():  # the same teachers' translations: not made twice
            shutil.copytree(made[0], target)  # (a different key would translate again)
        epochs = EPOCHS // 2 if mode == "both" else EPOCHS  # both: twice the pairs an epoch
        self.train(stage, ["--num_epochs", epochs, "--seed", seed, *distill,
                           "--distill_data", mode])

    def status(self):
        for path in sorted((self.runs / "stages").glob("*.json")):
            print(path.stem, path.read_text().replace("\n", " "))
        for name, entry in self.scores.items():
            print(name, entry.get("chosen"), entry.get("test"))


def read(path: Path) -> list:
    return Path(path).read_text(encoding="utf-8").splitlines()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dev.distill_pipeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="folder of the runs (outside the checkout)")
    parser.add_argument("--data_dir", required=True, help="Multi30k's raw files (and tok/)")
    parser.add_argument("--teacher_seeds", type=int, nargs="+", default=[42, 7, 13])
    parser.add_argument("--student_seeds", type=int, nargs=2, default=[42, 7])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--status", action="store_true", help="print what is done, and stop")
    args = parser.parse_args(argv)
    if len(set(args.teacher_seeds)) < 2 or len(set(args.teacher_seeds)) < len(args.teacher_seeds):
        parser.error("--teacher_seeds: two seeds or more, each once (the teachers' ensembles)")
    pipeline = Pipeline(args)
    pipeline.status() if args.status else pipeline.stages()


def cli(argv=None):
    """main() as the command line runs it: Ctrl-C (or a SIGTERM) ends in one line, exit 130."""
    run_main("python -m dev.distill_pipeline", lambda: main(argv),
             "stopped; run the same command again to go on where it stopped")


if __name__ == "__main__":
    cli()
