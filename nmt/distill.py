"""Sequence-level knowledge distillation (Kim and Rush, 2016): the teachers (one model, or
several as one ensemble) translate the training split's sources once with beam search, and the
student trains on their translations, alone or beside the corpus's own references
(--distill_data). train.py calls `distil` before it loads the data; corpus.py then reads the
translations in place of (or beside) the references.

    python train.py --preset multi30k_modern --data_dir data/multi30k \\
        --distill_from weights/teacher_a,weights/teacher_b --distill_average 5 \\
        --model_folder weights/student

The translations are kept in <model_folder>/distilled/ (train.src, train.tgt, meta.json) with
what made them: the teachers' checkpoint files (by content), beam, averaging and the sources. A
later start (a resume, a run stopped while translating and started again) finds them and does
not translate again; other teachers, settings or sources translate afresh. Under torchrun rank 0
translates alone while the others wait (nmt.runtime.WAIT_TIMEOUT, two hours): distil a large
corpus in a single process first (the same command, stopped once training begins) and start
torchrun on the same --model_folder after.
"""

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from config import Config
from corpus import (column, corpus_source, digest, distilled_folder, distilled_meta, file_digest,
                    lines_digest, load_corpus, note)
from nmt.checkpoint import CheckpointError, load_checkpoint, resolve_preload
from nmt.decoding import clean, translate
from nmt.trained_model import load_ensemble, load_translator

ALPHA = 0.6  # the teachers' length penalty (translate.py's default)


def teachers(config: Config) -> list:
    """--distill_from's models, in the order given."""
    return [t for t in config.distill_from.split(",") if t]


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


def check_teacher(teacher: str, state: dict, config: Config, source: str):
    """A teacher must translate the student's language pair, and have been trained on the
    student's corpus (its checkpoint records where the corpus came from): one line, else."""
    saved = Config.from_dict(state["config"])
    if (saved.lang_src, saved.lang_tgt) != (config.lang_src, config.lang_tgt):
        raise CheckpointError(
            f"--distill_from {teacher} translates {saved.lang_src}->{saved.lang_tgt}, not "
            f"{config.lang_src}->{config.lang_tgt}: a teacher must translate the student's "
            f"language pair")
    trained_on = (state.get("corpus") or {}).get("source") or "a corpus it does not record"
    if trained_on != source and os.path.realpath(trained_on) != os.path.realpath(source):
        # (the same folder named through a link, or its target as earlier versions recorded)
        raise CheckpointError(
            f"--distill_from {teacher} was trained on {trained_on}, not this run's corpus "
            f"{source}: a teacher must be trained on the student's corpus")


def distil(config: Config, resumed: bool = False):
    """Makes sure <model_folder>/distilled holds the teachers' translations of this run's
    training sources (with --distill_from; nothing without): checks the teachers, and
    translates (with a progress bar) unless the folder already holds the translations of these
    teachers, settings and sources. A resumed run keeps the translations it trained on, whatever
    its teachers' folders hold now (a new checkpoint there would change the key, and then the
    corpus the resume is checked against)."""
    if not config.distill_from or (resumed and distilled_meta(config)):
        return distilled_meta(config)
    names = teachers(config)
    base = dataclasses.replace(config, distill_from="", extra_data_dir="", extra_tag="",
                               upsample=1)
    splits = load_corpus(base, wanted=("train", "validation"))  # validation: a held-out split
    source, sources_key = corpus_source(config), lines_digest(splits["train"], "src")
    described = []
    for name, path in ((n, teacher_checkpoint(n)) for n in names):
        check_teacher(name, load_checkpoint(path, mmap=True), config, source)
        described.append({"teacher": name, "checkpoint": str(path.resolve()),
                          "digest": file_digest(path)})
    key = digest([[t["digest"] for t in described], config.distill_beam,
                  config.distill_average, ALPHA, sources_key])
    folder, meta = distilled_folder(config), distilled_meta(config)
    if meta and meta.get("key") == key and (folder / "train.tgt").is_file():
        note(f"the teachers' translations of {meta['sentences']:,} training sources are in "
             f"{folder}: not translating again")
        return meta
    if meta:
        note(f"{folder} holds translations by other teachers, settings or sources: "
             f"translating again")
    sentences = [clean(s) for s in column(splits["train"], "src")]
    started = time.time()
    model, teacher_config, tokenizer_src, tokenizer_tgt = load_teachers(config, described)
    bar = tqdm(total=len(sentences), desc=f"teachers translating (beam {config.distill_beam})",
               unit=" sentences", dynamic_ncols=True, mininterval=1.0)
    outputs = translate(model, teacher_config, tokenizer_src, tokenizer_tgt, sentences,
                        beam=config.distill_beam, alpha=ALPHA, progress=bar.update)
    bar.close()
    seconds = time.time() - started
    meta = {"key": key, "teachers": described, "beam": config.distill_beam,
            "average": config.distill_average, "alpha": ALPHA, "sentences": len(sentences),
            "sources": sources_key, "seconds": round(seconds, 1)}
    write_folder(folder, sentences, outputs, meta)
    note(f"the teachers translated {len(sentences):,} training sources in {seconds:.0f}s "
         f"({len(sentences) / max(seconds, 1e-9):.1f} a second): {folder}")
    return meta


def load_teachers(config: Config, described: list):
    """(model or Ensemble, config, source tokenizer(s), target tokenizer): the teachers on
    this run's device and threads, each averaged over --distill_average checkpoints."""
    loading = dataclasses.replace(Config(), device=config.device, threads=config.threads)
    given = {"device", "threads"}
    checkpoints = [t["checkpoint"] for t in described]
    if len(checkpoints) == 1:
        return load_translator(loading, given, checkpoints[0], config.distill_average)
    return load_ensemble(loading, given, checkpoints, config.distill_average)


def write_folder(folder: Path, sources: list, outputs: list, meta: dict):
    """The translations and their meta.json, into a temporary folder that replaces `folder`
    only when complete: a run stopped while writing leaves the old folder, or none."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "train.src").write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    (tmp / "train.tgt").write_text("".join(t + "\n" for t in outputs), encoding="utf-8")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
