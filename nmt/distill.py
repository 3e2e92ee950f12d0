"""Sequence-level knowledge distillation (Kim and Rush, 2016): the teachers (one model, or
several as one ensemble) translate the training split's sources once with beam search, and the
student trains on their translations, alone or beside the corpus's own references
(--distill_data). train.py plans the translation before it loads the data
(`plan_translation`: the teachers checked, what is left to translate), every process translates
its share (`translate_share`), and rank 0 joins the parts (`finish_translation`); corpus.py then
reads the translations in place of (or beside) the references. `distil` does the three in one
process.

    python train.py --preset multi30k_modern --data_dir data/multi30k \\
        --distill_from weights/teacher_a,weights/teacher_b --distill_average 5 \\
        --model_folder weights/student

The translations are kept in <model_folder>/distilled/ (corpus.DistilledTargets: the format,
its parts and its meta.json) under a key: the teachers' weights (each the average it translates
with; the order they are named in does not matter), beam, averaging, length penalty and the
sources. They are made in chunks, each kept as it is done: a run stopped while translating goes
on from its last finished chunk when started again. A later start with the same key does not
translate again; other teachers, weights, settings or sources translate afresh. Under torchrun
every process translates its own chunks.
"""

import dataclasses
import math
import signal
import time
from pathlib import Path

from tqdm import tqdm

from config import LENGTH_PENALTY, Config
from corpus import (DistilledTargets, column, corpus_source, digest, load_corpus, note,
                    own_corpus)
from nmt.checkpoint import (CheckpointError, load_averaged, load_checkpoint, resolve_preload,
                            weights_digest)
from nmt.cli import StoppedAndSaid
from nmt.decoding import translate
from nmt.runtime import sum_over_ranks
from nmt.trained_model import check_languages, load_ensemble, load_translator

CHUNK = 2048  # sentences a part at most: what a stop loses at most, per process
PARTS = 16  # parts at least (a small corpus too is shared out between processes)


def teacher_checkpoint(teacher: str) -> Path:
    """The checkpoint file a teacher names: a model folder's newest, or the file itself."""
    path = Path(teacher)
    if path.is_dir():
        found = resolve_preload(Config(model_folder=str(path), preload="latest"))
        if found is None:
            raise CheckpointError(f"--distill_from {teacher}: no checkpoint in {path}/")
        return found
    if path.is_file():
        return path
    raise CheckpointError(f"--distill_from {teacher}: no such model folder or checkpoint file")


def check_teacher(teacher: str, state: dict, config: Config, corpus: dict):
    """A teacher must translate the student's language pair, and have been trained on the
    student's corpus: the same text (its checkpoint records the corpus's fingerprint, which
    reads the files' contents, wherever they lie; its own extra pairs or teachers aside), and,
    where validation is held out of the
    training split, the same held-out pairs (else the teacher trained on the student's
    validation). One line, else."""
    saved = Config.from_dict(state["config"])
    check_languages(f"--distill_from {teacher}", saved, "the student", config,
                    "a teacher must translate the student's language pair")
    recorded = state.get("corpus") or {}
    if recorded.get("version", 1) < 2 and recorded.get("source") == corpus["source"]:
        note(f"--distill_from {teacher} records its corpus by the files' times (an earlier "
             f"version): the same folder, its text not checked")
    # the corpus alone, without the teacher's own extra pairs or teachers (earlier versions
    # record only the whole, the same for a run with neither)
    elif recorded.get("text", recorded.get("fingerprint")) != corpus["text"]:
        trained_on = recorded.get("source") or "a corpus it does not record"
        raise CheckpointError(
            f"--distill_from {teacher} was trained on {trained_on}, whose text is not this "
            f"run's corpus {corpus['source']}: a teacher must be trained on the student's corpus")
    if corpus["held_out"]:
        for name in ("seed", "val_fraction"):
            if getattr(saved, name) != getattr(config, name):
                raise CheckpointError(
                    f"--distill_from {teacher} held its validation pairs out of the training "
                    f"split with --{name} {getattr(saved, name)}, this run with "
                    f"{getattr(config, name)}: it trained on the student's validation pairs; "
                    f"give the student --{name} {getattr(saved, name)}")


def describe(teacher: str, config: Config, corpus: dict) -> dict:
    """A teacher checked, with the checkpoint it translates with and the digest of the weights
    it translates with (the average of its newest --distill_average checkpoints)."""
    path = teacher_checkpoint(teacher)
    saved = load_checkpoint(path, mmap=True)
    check_teacher(teacher, saved, config, corpus)
    folder = dataclasses.replace(Config(), model_folder=str(path.parent))
    state, paths = load_averaged(folder, path, config.distill_average, "--distill_average")
    return {"teacher": teacher, "checkpoint": str(path.resolve()),
            "averaged": [p.name for p in paths], "weights": weights_digest(state),
            "target": (saved.get("tokenizers") or [None, None])[1]}


def plan_translation(config: Config, resumed: dict = None):
    """What this run must translate (rank 0, before any data is prepared): None with no
    --distill_from, for a resumed run that has its translations (it keeps what it trained on,
    whatever its teachers' folders hold now), and where the translations of these teachers,
    settings and sources are already there; else the plan every process translates its share
    of, with parts/ readied for it (the parts of an earlier start kept). `resumed`: the state
    of the checkpoint a resume starts from. Checks the teachers first (one line and exit 2 for
    a bad one), and writes nothing before."""
    targets = DistilledTargets(config.model_folder)
    meta = targets.meta()
    if not config.distill_from or (resumed and meta):
        return None
    splits = load_corpus(own_corpus(config), wanted=("train", "validation"))
    corpus = {"source": corpus_source(config), "text": splits["text"],
              "held_out": bool(splits.get("held_out"))}
    described = sorted((describe(t, config, corpus) for t in config.teachers()),
                       key=lambda t: t["weights"])  # one ensemble, however ordered
    check_targets(described)
    if resumed:  # its translations are gone: the same only from the same weights
        trained_on = (resumed.get("corpus") or {}).get("distilled") or {}
        if sorted(t.get("weights", "") for t in trained_on.get("teachers", [])) != \
                [t["weights"] for t in described]:
            raise CheckpointError(
                f"{targets.folder} is gone and the teachers' weights are not those the run "
                f"trained on the translations of: put it back, or train into another "
                f"--model_folder")
    sources = targets.sources_key(splits["train"])
    key = digest([[t["weights"] for t in described], config.distill_beam,
                  config.distill_average, LENGTH_PENALTY, sources])
    if meta and meta.get("key") == key:
        note(f"the teachers' translations of {meta['sentences']:,} training sources are in "
             f"{targets.folder}: not translating again")
        return None
    if meta:
        note(f"{targets.folder} holds translations by other teachers, weights, settings or "
             f"sources: translating again")
    sentences = len(splits["train"])
    chunk = min(CHUNK, math.ceil(sentences / PARTS))
    chunks = math.ceil(sentences / chunk)
    found = targets.begin(f"{key}/{chunk}")  # parts/ ready for every process
    if found:
        note(f"{found} of {chunks} chunks of the teachers' translations are done "
             f"({targets.parts}): going on from them")
    return {"key": key, "teachers": [{k: t[k] for k in ("teacher", "checkpoint", "averaged",
                                                        "weights")} for t in described],
            "beam": config.distill_beam, "average": config.distill_average, "alpha": LENGTH_PENALTY,
            "sentences": sentences, "sources": sources, "chunk": chunk, "chunks": chunks,
            "started": time.time(), "todo": sum(min(chunk, sentences - c * chunk)
                                                for c in range(chunks) if not targets.done(c))}


def check_targets(described: list):
    """An ensemble averages its teachers' probabilities of the same target tokens: teachers
    with other target tokenizers are refused here, before anything is written."""
    first = described[0]
    for t in described[1:]:
        if None not in (t["target"], first["target"]) and t["target"] != first["target"]:
            raise CheckpointError(
                f"--distill_from {t['teacher']} has another target tokenizer than "
                f"{first['teacher']}: an ensemble of teachers averages their probabilities "
                f"of the same target tokens")


def translate_share(config: Config, plan: dict, rank: int = 0, world: int = 1):
    """This process's chunks of the plan (i, i + world, ...) not yet done, each written as it
    ends; returns when every process is done (then rank 0 joins them: `finish_translation`).
    A stop (Ctrl-C) keeps the chunks done."""
    if plan is None:
        return
    targets = DistilledTargets(config.model_folder)
    mine = [c for c in range(rank, plan["chunks"], world) if not targets.done(c)]
    if mine:
        translate_chunks(config, plan, targets, mine, world)
    try:
        sum_over_ranks(0)  # every chunk is written
    except KeyboardInterrupt as interrupt:  # (rank 0's share done, the others' still going)
        note(f"stopped while the other processes translate: rank 0's chunks are done, each "
             f"process's finished ones kept in {targets.parts}; the same command goes on "
             f"from them")
        raise StoppedAndSaid(getattr(interrupt, "signum", signal.SIGINT)) from None


def translate_chunks(config: Config, plan: dict, targets: DistilledTargets, chunks: list,
                     world: int = 1):
    train = load_corpus(own_corpus(config), wanted=("train", "validation"))["train"]
    model, teacher_config, tokenizer_src, tokenizer_tgt = load_teachers(config, plan["teachers"])
    size = plan["chunk"]
    todo = sum(min(size, plan["sentences"] - c * size) for c in chunks)
    bar = tqdm(total=todo, desc=f"teachers translating (beam {plan['beam']})",
               unit=" sentences", dynamic_ncols=True, mininterval=1.0)
    finished = 0
    try:
        for c in chunks:
            rows = range(c * size, min((c + 1) * size, plan["sentences"]))
            outputs = translate(model, teacher_config, tokenizer_src, tokenizer_tgt,
                                column(train.select(rows), "src"), beam=plan["beam"],
                                alpha=plan["alpha"], progress=bar.update,
                                numbers=[n + 1 for n in rows])  # (a warning names the line)
            targets.write_chunk(c, outputs)
            finished += 1
    except KeyboardInterrupt as interrupt:
        bar.close()
        whose = ("" if world == 1 else  # (rank 0 speaks; every process keeps what it finished)
                 f" of rank 0's share (each of the {world} processes keeps its own)")
        note(f"stopped while translating: {finished} of the {len(chunks)} chunk(s) left at this "
             f"start{whose} are done, kept in {targets.parts}; the same command goes on from them")
        raise StoppedAndSaid(getattr(interrupt, "signum", signal.SIGINT)) from None
    bar.close()


def finish_translation(config: Config, plan: dict):
    """Rank 0, once every process has translated its share: the parts joined into the
    translations the run trains on."""
    if plan is None:
        return None
    targets = DistilledTargets(config.model_folder)
    seconds = time.time() - plan["started"]
    meta = {k: plan[k] for k in ("key", "teachers", "beam", "average", "alpha", "sentences",
                                 "sources")}
    meta["seconds"] = round(seconds, 1)  # of the start that finished it (plan["todo"])
    targets.finish(plan["chunks"], meta)
    earlier = plan["sentences"] - plan["todo"]  # (translated by an earlier start)
    note(f"the teachers translated {plan['todo']:,} training sources in {seconds:.0f}s "
         f"({plan['todo'] / max(seconds, 1e-9):.1f} a second)"
         + (f", after {earlier:,} of an earlier start" if earlier else "")
         + f": {targets.folder}")
    return meta


def distil(config: Config, resumed: dict = None):
    """In one process: the plan, its translation, the parts joined; returns the meta.json of
    the translations the run trains on (None without --distill_from)."""
    plan = plan_translation(config, resumed)
    translate_share(config, plan)
    finish_translation(config, plan)
    return DistilledTargets(config.model_folder).meta() if config.distill_from else None


def load_teachers(config: Config, described: list):
    """(model or Ensemble, config, source tokenizer(s), target tokenizer): the teachers on
    this run's device and threads, each averaged over --distill_average checkpoints."""
    loading = dataclasses.replace(Config(), device=config.device, threads=config.threads)
    given = {"device", "threads"}
    checkpoints = [t["checkpoint"] for t in described]
    if len(checkpoints) == 1:
        return load_translator(loading, given, checkpoints[0], config.distill_average)
    return load_ensemble(loading, given, checkpoints, config.distill_average)
