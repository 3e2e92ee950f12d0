"""nmt/distill.py, corpus.DistilledTargets and train.py --distill_from: sequence-level knowledge
distillation with teachers that translate (tiny models trained until they get most number words
right), so that a student's targets can be held line by line to what the teachers output: the
order, the content and the settings each show."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from config import Config
from conftest import ROOT, TINY, make_corpus, number_pairs, run_here, write_aligned
from nmt.checkpoint import load_checkpoint

# Teachers that learn the number words: 160 pairs, 16 epochs (13 s on a busy core).
TEACHER = [*TINY, "--warmup", "16", "--lr", "5e-3"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A folder with a tiny corpus (with a test set) and two teachers trained on it: t1 from
    scratch, t2 from t1 with another seed for 2 epochs (other weights, as good)."""
    home = tmp_path_factory.mktemp("distil")
    make_corpus(home / "corpus", n=160)
    write_aligned(home / "corpus", "test", number_pairs(6, seed=9))
    for folder, flags in (("t1", ["--num_epochs", "16", "--seed", "1"]),
                          ("t2", ["--num_epochs", "2", "--seed", "2",
                                  "--init_from", "weights/t1"])):
        result = run_here("train.py", "--data_dir", "corpus", *TEACHER, *flags,
                          "--model_folder", f"weights/{folder}", "--experiment_name",
                          f"runs/{folder}", cwd=home)
        assert result.returncode == 0, result.stderr.decode()[-2000:]
    return home


def student(home, *flags, folder="weights/student", epochs="1"):
    return run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", epochs,
                    "--model_folder", folder, "--experiment_name", "runs/student", *flags,
                    cwd=home)


def ensemble_output(home, *flags, source="corpus/train.en"):
    """translate.py's output at each teacher's newest checkpoint (what a teacher folder
    translates with)."""
    result = run_here("translate.py", *flags, "--preload", "latest", "--input", source, cwd=home)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return result.stdout.decode().splitlines()


def lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def prepared_pairs(home, folder):
    """The (source, target) texts a run's prepared training data decode to."""
    from dataset import load_prepared
    from tokenizer import load_tokenizer
    meta = json.loads((home / folder / "prepared/meta.json").read_text())
    train, _, _ = load_prepared(home / folder / "prepared", meta["key"])
    src = load_tokenizer(home / folder / "tokenizer_en.json", "bpe")
    tgt = load_tokenizer(home / folder / "tokenizer_it.json", "bpe")
    return sorted((src.decode(list(map(int, train.src_ids[i]))).strip(),
                   tgt.decode(list(map(int, train.tgt_ids[i]))).strip())
                  for i in range(len(train)))


def distil_config(home, **changes):
    return dataclasses.replace(Config(), **{
        "data_dir": str(home / "corpus"), "seq_len": 24, "distill_from": f"{home}/weights/t1",
        "distill_beam": 2, **changes})


def test_the_teachers_translate(teachers):
    """The tests below can see order and content only if the teachers translate: most of
    their outputs are distinct, and many are right."""
    out = ensemble_output(teachers, "--model_folder", "weights/t1")
    reference = lines(teachers / "corpus/train.it")
    assert len(set(out)) > 100 and sum(a == b for a, b in zip(out, reference)) > 20


def test_student_trains_on_the_ensembles_translations(teachers):
    home = teachers
    result = student(home, "--distill_from", "weights/t1, weights/t2", "--distill_beam", "2",
                     epochs="2")  # (a space after the comma: names are trimmed)
    err = result.stderr.decode()
    assert result.returncode == 0, err[-2000:]
    assert "teachers translating (beam 2)" in err  # the progress bar
    assert "training pairs: 160 translated by the teachers" in err
    targets = lines(home / "weights/student/distilled/train.tgt")
    # line by line what translate.py --ensemble makes of the training sources
    assert targets == ensemble_output(home, "--ensemble", "weights/t1,weights/t2", "--beam", "2")
    # ... and the student trained on each source with its own translation (not shifted)
    sources = lines(home / "corpus/train.en")
    assert prepared_pairs(home, "weights/student") == sorted(zip(sources, targets))
    # its tokenizers are the corpus's (as the teachers', trained on the same text), not ones
    # trained on the translations
    for name in ("tokenizer_en.json", "tokenizer_it.json"):
        assert (home / "weights/student" / name).read_bytes() == \
            (home / "weights/t1" / name).read_bytes()
    # validation and test stay the corpus's references
    import dataset
    data = dataset.get_ds(dataclasses.replace(
        Config(), data_dir=str(home / "corpus"), model_folder=str(home / "weights/student"),
        seq_len=24, vocab_size=300, distill_from="weights/t1,weights/t2", distill_beam=2))
    assert data.validation.tgt_texts == lines(home / "corpus/val.it")
    assert data.test["test"][1] == lines(home / "corpus/test.it")
    # the checkpoint and the model card record the teachers
    state = load_checkpoint(home / "weights/student/tmodel_00.pt")
    recorded = state["corpus"]["distilled"]
    assert sorted(t["teacher"] for t in recorded["teachers"]) == ["weights/t1", "weights/t2"]
    assert recorded["beam"] == 2
    card = (home / "weights/student/MODEL_CARD.md").read_text(encoding="utf-8")
    assert "knowledge distillation" in card and "`weights/t1`" in card and "`weights/t2`" in card
    # translate.py --example reads validation, not the teachers' translations it no longer needs
    shutil.rmtree(home / "weights/student/distilled")
    example = run_here("translate.py", "--model_folder", "weights/student", "--example", "3",
                       cwd=home)
    assert example.returncode == 0, example.stderr.decode()[-2000:]
    assert lines(home / "corpus/val.en")[3] in example.stdout.decode()


def test_both_keeps_the_references_beside_the_translations(teachers):
    home = teachers
    result = student(home, "--distill_from", "weights/t1", "--distill_data", "both",
                     "--distill_beam", "1", folder="weights/both")
    err = result.stderr.decode()
    assert result.returncode == 0, err[-2000:]
    assert "160 translated by the teachers (--distill_from), after the corpus's own 160" in err
    sources = lines(home / "corpus/train.en")
    translated = ensemble_output(home, "--model_folder", "weights/t1")
    own = list(zip(sources, lines(home / "corpus/train.it")))
    assert prepared_pairs(home, "weights/both") == sorted(own + list(zip(sources, translated)))


def test_averaging_translates_with_the_averaged_weights(teachers):
    """--distill_average N: each teacher is the mean of its newest N epochs, as translate.py
    --average N loads it (and that translates otherwise than the newest alone)."""
    from nmt import distill
    home = teachers
    config = distil_config(home, model_folder=str(home / "weights/avg"), distill_average=3)
    meta = distill.distil(config)
    assert meta["average"] == 3 and meta["teachers"][0]["averaged"] == [
        "tmodel_13.pt", "tmodel_14.pt", "tmodel_15.pt"]
    averaged = ensemble_output(home, "--model_folder", "weights/t1", "--average", "3",
                               "--beam", "2")
    assert lines(home / "weights/avg/distilled/train.tgt") == averaged
    assert averaged != ensemble_output(home, "--model_folder", "weights/t1", "--beam", "2")


def test_the_key_is_the_weights_not_the_files(teachers, tmp_path, capsys):
    """The same weights translate once: a copy of the teacher elsewhere, a checkpoint file
    named in place of its folder, the file saved again without its optimizer state, the
    teachers of an ensemble in another order. Other weights translate again."""
    from nmt import distill
    home = teachers
    config = distil_config(home, model_folder=str(tmp_path / "w"))
    first = distill.distil(config)
    assert "teachers translated 160 training sources" in capsys.readouterr().err
    copy = tmp_path / "copy"
    shutil.copytree(home / "weights/t1", copy)
    state = torch.load(copy / "tmodel_15.pt", weights_only=False)
    state.pop("optimizer_state_dict")
    torch.save(state, copy / "tmodel_15.pt")  # another file, the same weights
    for teacher in (str(copy), str(copy / "tmodel_15.pt")):
        again = distill.distil(dataclasses.replace(config, distill_from=teacher))
        assert again["key"] == first["key"]
        assert "not translating again" in capsys.readouterr().err
    both = dataclasses.replace(config, distill_from=f"{home}/weights/t1,{home}/weights/t2")
    made = distill.distil(both)
    assert made["key"] != first["key"]  # other teachers: translated again
    assert "translating again" in capsys.readouterr().err
    reordered = distill.distil(dataclasses.replace(
        config, distill_from=f"{home}/weights/t2,{home}/weights/t1"))
    assert reordered["key"] == made["key"]
    assert "not translating again" in capsys.readouterr().err
    other = distill.distil(dataclasses.replace(config, distill_from=f"{home}/weights/t1/"
                                                                    f"tmodel_14.pt"))
    assert other["key"] != first["key"]  # an earlier epoch: other weights


def test_a_stopped_translation_goes_on_where_it_stopped(teachers, tmp_path, monkeypatch,
                                                        capsys):
    """Chunks are kept as they are done: a stop (Ctrl-C) in the third of four keeps two, the
    next start translates the other two only, and the whole equals an unbroken run's."""
    from nmt import distill
    home = teachers
    monkeypatch.setattr(distill, "PARTS", 4)  # 4 parts of 40
    whole = distil_config(home, model_folder=str(tmp_path / "whole"))
    distill.distil(whole)
    config = dataclasses.replace(whole, model_folder=str(tmp_path / "stopped"))
    real, calls = distill.translate, []

    def stopping(*args, **kw):
        calls.append(len(args[4]))
        if calls == [40, 40, 40]:  # once: the third chunk of the first start, by SIGTERM
            interrupt = KeyboardInterrupt()  # (nmt.stopping turns it into one, with its
            interrupt.signum = 15  # number: 143, as any stop by SIGTERM)
            raise interrupt
        return real(*args, **kw)
    monkeypatch.setattr(distill, "translate", stopping)
    from nmt.cli import run_main
    with pytest.raises(SystemExit) as stopped:  # as train.py runs it: the stop said, no
        run_main("train.py", lambda: distill.distil(config),  # "aborted; the checkpoints
                 aborted="aborted; the checkpoints already saved are intact")  # ...": none is
    err = capsys.readouterr().err
    assert stopped.value.code == 143 and err.endswith(
        f"stopped while translating: 2 of the 4 chunk(s) left at this start are done, kept in "
        f"{tmp_path / 'stopped/distilled/parts'}; the same command goes on from them\n"), err
    parts = tmp_path / "stopped/distilled/parts"
    assert sorted(p.name for p in parts.glob("*.tgt")) == ["00000.tgt", "00001.tgt"]
    assert not (tmp_path / "stopped/distilled/meta.json").exists()  # not complete
    calls.clear()
    distill.distil(config)
    assert calls == [40, 40]  # the two chunks left
    err = capsys.readouterr().err
    assert "2 of 4 chunks of the teachers' translations are done" in err
    assert "the teachers translated 80 training sources in" in err and \
        "after 80 of an earlier start" in err  # the rate: this start's sentences
    assert lines(tmp_path / "stopped/distilled/train.tgt") == \
        lines(tmp_path / "whole/distilled/train.tgt")
    assert not parts.exists()


def test_translation_is_shared_out_between_processes(teachers, tmp_path, monkeypatch):
    """Under torchrun each rank translates chunks rank, rank + world, ...; rank 0 joins them
    when every rank is done: the same lines as one process."""
    from nmt import distill
    home = teachers
    monkeypatch.setattr(distill, "PARTS", 4)  # 4 parts of 40
    monkeypatch.setattr(distill, "sum_over_ranks", lambda *v: v)  # (the ranks run in turn)
    from corpus import DataError
    config = distil_config(home, model_folder=str(tmp_path / "w"))
    plan = distill.plan_translation(config)
    written = []
    real = distill.DistilledTargets.write_chunk

    def write(self, chunk, text):
        written.append(chunk)
        return real(self, chunk, text)
    monkeypatch.setattr(distill.DistilledTargets, "write_chunk", write)
    distill.translate_share(config, plan, 0, 2)
    assert written == [0, 2]
    with pytest.raises(DataError, match="chunk.s. 1, 3 of the teachers' translations are "
                                        "missing"):
        distill.finish_translation(config, plan)  # rank 0 alone: rank 1's share is missing
    assert not (tmp_path / "w/distilled/meta.json").exists()
    distill.translate_share(config, plan, 1, 2)
    distill.finish_translation(config, plan)
    assert written == [0, 2, 1, 3]
    alone = distil_config(home, model_folder=str(tmp_path / "alone"))
    distill.distil(alone)
    assert lines(tmp_path / "w/distilled/train.tgt") == \
        lines(tmp_path / "alone/distilled/train.tgt")


def stop_translating_at(n: int, monkeypatch):
    """The teachers' n-th translation call (one a chunk) is stopped by Ctrl-C; returns the real
    function."""
    from nmt import distill
    real, calls = distill.translate, []

    def stopping(*args, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(distill, "translate", stopping)
    return real


def test_a_stop_under_torchrun_says_its_count_is_rank_0s_share(teachers, tmp_path, monkeypatch,
                                                                capsys):
    """Rank 0 alone speaks: its count of chunks done is its own share's, and says so."""
    from nmt import distill
    from nmt.cli import StoppedAndSaid
    monkeypatch.setattr(distill, "PARTS", 4)  # 4 parts of 40: rank 0 of 2 has chunks 0 and 2
    monkeypatch.setattr(distill, "sum_over_ranks", lambda *v: v)
    config = distil_config(teachers, model_folder=str(tmp_path / "w"))
    plan = distill.plan_translation(config)
    stop_translating_at(2, monkeypatch)
    capsys.readouterr()
    with pytest.raises(StoppedAndSaid):
        distill.translate_share(config, plan, 0, 2)
    assert capsys.readouterr().err.endswith(
        "stopped while translating: 1 of the 2 chunk(s) left at this start of rank 0's share "
        "(each of the 2 processes keeps its own) are done, kept in "
        f"{tmp_path / 'w/distilled/parts'}; the same command goes on from them\n")


def test_the_teachers_search_with_config_length_penalty_and_their_key_names_it(teachers,
                                                                               tmp_path,
                                                                               monkeypatch):
    """The plan's alpha (the teachers' beam search's, recorded in meta.json) is
    config.LENGTH_PENALTY; another would be another key: translated again, not reused."""
    from config import LENGTH_PENALTY
    from nmt import distill
    plan = distill.plan_translation(distil_config(teachers, model_folder=str(tmp_path / "a")))
    assert plan["alpha"] == LENGTH_PENALTY
    monkeypatch.setattr(distill, "LENGTH_PENALTY", LENGTH_PENALTY + 0.4)
    other = distill.plan_translation(distil_config(teachers, model_folder=str(tmp_path / "b")))
    assert other["alpha"] == LENGTH_PENALTY + 0.4 and other["key"] != plan["key"]

def test_a_stop_while_rank_0_waits_for_the_others_says_what_is_kept(teachers, tmp_path,
                                                                       monkeypatch, capsys):
    """Rank 0 done with its chunks, waiting for the others: a stop there said "aborted; the
    checkpoints already saved are intact" (none exist); it says what is kept, and how to go on."""
    from nmt import distill
    from nmt.cli import StoppedAndSaid
    monkeypatch.setattr(distill, "PARTS", 4)

    def waiting(*values):
        interrupt = KeyboardInterrupt()
        interrupt.signum = 15
        raise interrupt
    monkeypatch.setattr(distill, "sum_over_ranks", waiting)
    config = distil_config(teachers, model_folder=str(tmp_path / "w"))
    plan = distill.plan_translation(config)
    capsys.readouterr()
    with pytest.raises(StoppedAndSaid) as stopped:
        distill.translate_share(config, plan, 0, 2)
    assert stopped.value.signum == 15
    assert capsys.readouterr().err.endswith(
        "stopped while the other processes translate: rank 0's chunks are done, each process's "
        f"finished ones kept in {tmp_path / 'w/distilled/parts'}; the same command goes on from "
        "them\n")
    assert sorted(p.name for p in (tmp_path / "w/distilled/parts").glob("*.tgt")) == \
        ["00000.tgt", "00002.tgt"]


def test_a_copy_of_the_corpus_is_the_corpus(teachers, tmp_path):
    """Teachers are checked against the corpus's text, not its path: a byte-identical copy
    elsewhere is accepted, a corpus rewritten at the teachers' path is refused."""
    from nmt import distill
    from nmt.checkpoint import CheckpointError
    home = teachers
    shutil.copytree(home / "corpus", tmp_path / "corpus")
    copied = distil_config(tmp_path, model_folder=str(tmp_path / "w"),
                           distill_from=f"{home}/weights/t1", distill_beam=1)
    assert distill.plan_translation(copied)["sentences"] == 160
    (tmp_path / "corpus/train.it").write_text("".join(
        line.upper() + "\n" for line in lines(home / "corpus/train.it")), encoding="utf-8")
    with pytest.raises(CheckpointError, match="whose text is not this run's corpus"):
        distill.plan_translation(copied)


def test_a_resume_keeps_its_teachers_and_settings(teachers):
    """A resume that adds, drops or changes --distill_from, --distill_beam, --distill_data or
    --distill_average is refused before any work, naming the flag; the same teachers in
    another order are the same."""
    home = teachers
    plain = student(home, folder="weights/plain")
    assert plain.returncode == 0, plain.stderr.decode()[-2000:]
    added = student(home, "--distill_from", "weights/t1", folder="weights/plain", epochs="2")
    err = added.stderr.decode()
    assert added.returncode == 2
    assert err.strip().splitlines()[-1].endswith(
        "was trained with --distill_from none (a run's training pairs are fixed when it "
        "starts): resume without --distill_from, or train a new run into another "
        "--model_folder")
    assert "translating" not in err and not (home / "weights/plain/distilled").exists()
    made = student(home, "--distill_from", "weights/t1,weights/t2", "--distill_beam", "1",
                   folder="weights/resumed")
    assert made.returncode == 0, made.stderr.decode()[-2000:]
    teachers_given = ["--distill_from", "weights/t1,weights/t2"]
    for flags, name in (([*teachers_given, "--distill_beam", "3"], "distill_beam 1"),
                        ([*teachers_given, "--distill_data", "both"], "distill_data distilled"),
                        ([*teachers_given, "--distill_average", "2"], "distill_average 1"),
                        (["--distill_from", "weights/t1"], "distill_from weights/t1,weights/t2")):
        changed = student(home, *flags, folder="weights/resumed", epochs="2")
        assert changed.returncode == 2, flags
        assert f"was trained with --{name} (a run's" in changed.stderr.decode(), flags
    # a setting alone, without the teachers: checked with the run's own, so the same line
    alone = student(home, "--distill_beam", "3", folder="weights/resumed", epochs="2")
    assert alone.returncode == 2 and "was trained with --distill_beam 1 (a run's" in \
        alone.stderr.decode(), alone.stderr.decode()
    card = (home / "weights/resumed/MODEL_CARD.md").read_text(encoding="utf-8")
    assert "--distill_beam 3" not in card
    same = student(home, "--distill_from", "weights/t2,weights/t1", folder="weights/resumed",
                   epochs="2")
    assert same.returncode == 0, same.stderr.decode()[-2000:]
    assert "teachers translating" not in same.stderr.decode()


def test_mismatched_teachers_are_refused(teachers):
    home = teachers
    # another language pair: the student translates it->en
    result = student(home, "--distill_from", "weights/t1", "--lang_src", "it", "--lang_tgt",
                     "en", folder="weights/reverse")
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2
    assert err[-1] == ("train.py: error: --distill_from weights/t1 translates en->it, the "
                       "student it->en: a teacher must translate the student's language pair")
    # another corpus
    write_aligned(home / "other", "train", number_pairs(32, seed=9))
    write_aligned(home / "other", "val", number_pairs(8, seed=10))
    result = run_here("train.py", "--data_dir", "other", *TINY, "--num_epochs", "1",
                      "--model_folder", "weights/other", "--distill_from", "weights/t1",
                      cwd=home)
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2
    assert "a teacher must be trained on the student's corpus" in err[-1]
    # a teacher that does not exist
    result = student(home, "--distill_from", "weights/t1,weights/none", folder="weights/x")
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1] == (
        "train.py: error: --distill_from weights/none: no such model folder or checkpoint file")
    # more checkpoints to average than the teacher has: the student's flag is named
    result = student(home, "--distill_from", "weights/t2", "--distill_average", "5",
                     folder="weights/y")
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1].startswith(
        "train.py: error: --distill_average 5: only 2 per-epoch checkpoint(s)")
    for refused in ("reverse", "other", "x", "y"):  # nothing left behind by a refused start
        assert not (home / "weights" / refused).exists()


def test_held_out_validation_must_be_the_teachers(tmp_path):
    """Without a validation split, each run holds one out of train by --seed: a teacher that
    held out others trained on the student's validation pairs."""
    from nmt.checkpoint import CheckpointError
    from nmt.distill import check_teacher
    state = {"config": Config(seed=7).to_dict(), "corpus": {"text": "f", "version": 2}}
    corpus = {"source": "/data", "text": "f", "held_out": True}
    with pytest.raises(CheckpointError, match="give the student --seed 7"):
        check_teacher("t", state, Config(seed=42), corpus)
    check_teacher("t", state, Config(seed=7), corpus)
    check_teacher("t", state, Config(seed=42), {**corpus, "held_out": False})
    with pytest.raises(CheckpointError, match="give the student --val_fraction 0.1"):
        check_teacher("t", state, Config(seed=7, val_fraction=0.2), corpus)


def test_a_teacher_is_checked_by_its_corpus_text_even_at_the_same_path(tmp_path):
    """A teacher that records its corpus's text is refused where the text differs, though the
    folder is the student's; only an earlier version's record (the files' times) is let through
    with a note. Teachers whose target tokenizers are not recorded are not told apart; a model
    folder with no checkpoint says so."""
    from nmt.checkpoint import CheckpointError
    from nmt.distill import check_targets, check_teacher, teacher_checkpoint
    corpus = {"source": "/data", "text": "g", "held_out": False}
    recorded = {"text": "f", "version": 2, "source": "/data"}
    with pytest.raises(CheckpointError, match="was trained on /data, whose text is not"):
        check_teacher("t", {"config": Config().to_dict(), "corpus": recorded}, Config(), corpus)
    check_teacher("t", {"config": Config().to_dict(), "corpus": {**recorded, "version": 1}},
                  Config(), corpus)
    check_targets([{"teacher": "a", "target": None}, {"teacher": "b", "target": "x"}])
    with pytest.raises(CheckpointError, match="^--distill_from b has another target tokenizer"):
        check_targets([{"teacher": "a", "target": "y"}, {"teacher": "b", "target": "x"}])
    with pytest.raises(CheckpointError, match=f"^--distill_from {tmp_path}: no checkpoint in "
                                              f"{tmp_path}/$"):
        teacher_checkpoint(str(tmp_path))


def test_parts_hold_at_most_chunk_sentences_each_named_by_its_line(teachers, tmp_path,
                                                                   monkeypatch):
    """CHUNK caps a part (50 here, where 2 parts would hold 80): 160 sources in parts of 50,
    50, 50 and 10, each sentence numbered by its line in the training file (a warning about a
    long one names it); the whole is translate.py's lines; meta.json records the seconds."""
    from nmt import distill
    monkeypatch.setattr(distill, "CHUNK", 50)
    monkeypatch.setattr(distill, "PARTS", 2)
    real, seen = distill.translate, []

    def numbered(*args, numbers, **kw):
        seen.append((numbers[0], numbers[-1]))
        return real(*args, numbers=numbers, **kw)
    monkeypatch.setattr(distill, "translate", numbered)
    meta = distill.distil(distil_config(teachers, model_folder=str(tmp_path / "w")))
    assert seen == [(1, 50), (51, 100), (101, 150), (151, 160)]
    assert 0 <= meta["seconds"] < 600  # (this start's translating time)
    assert lines(tmp_path / "w/distilled/train.tgt") == \
        ensemble_output(teachers, "--model_folder", "weights/t1", "--beam", "2")


def test_an_ensemble_is_ordered_by_its_weights_not_its_names(teachers, tmp_path):
    """The teachers' newest checkpoints copied as b.pt (t1's) and a.pt (t2's): by name the
    other order than t1, t2; by weights the same ensemble, the same key."""
    from nmt import distill
    home = teachers
    shutil.copy(home / "weights/t1/tmodel_15.pt", tmp_path / "b.pt")
    shutil.copy(home / "weights/t2/tmodel_01.pt", tmp_path / "a.pt")
    named = distill.plan_translation(distil_config(
        home, model_folder=str(tmp_path / "w1"), distill_from=f"{tmp_path}/b.pt,{tmp_path}/a.pt"))
    folders = distill.plan_translation(distil_config(
        home, model_folder=str(tmp_path / "w2"),
        distill_from=f"{home}/weights/t1,{home}/weights/t2"))
    assert named["key"] == folders["key"]


def test_distill_flags_need_teachers():
    from config import UserError, parse_config
    with pytest.raises(UserError, match="go with --distill_from"):
        parse_config(["--distill_beam", "3"])
    with pytest.raises(UserError, match="--distill_from names no model"):
        parse_config(["--distill_from", " , "])
    config, _ = parse_config(["--distill_from", "a/, ./b", "--distill_beam", "3"])
    assert config.distill_beam == 3 and config.teachers() == ["a", "b"]


def test_two_ranks_translate_and_train(teachers, tmp_path):
    """torchrun straight away: both processes translate their chunks, then train on them."""
    home = teachers
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train.py"), "--data_dir", str(home / "corpus"), *TINY, "--num_epochs", "1",
         "--distill_from", str(home / "weights/t1"), "--distill_beam", "1",
         "--model_folder", "w", "--experiment_name", "runs/w"],
        cwd=tmp_path, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert lines(tmp_path / "w/distilled/train.tgt") == \
        ensemble_output(home, "--model_folder", "weights/t1")
    # one voice: each process loads the teacher, rank 0 alone says so
    assert result.stderr.decode().count(f"loaded {home / 'weights/t1'}") == 1, \
        result.stderr.decode()[-3000:]


def test_other_settings_or_sources_translate_again_and_no_part_of_them_is_reused(
        teachers, tmp_path, monkeypatch, capsys):
    """Everything that changes the translations is in the key: the beam, the averaging, the
    sources (another held-out split), the size of the parts. A start stopped under one key
    leaves parts no other key takes."""
    from nmt import distill
    home = teachers
    config = distil_config(home, model_folder=str(tmp_path / "w"))
    first = distill.distil(config)["key"]
    for change in (dict(distill_beam=1), dict(distill_average=2)):
        assert distill.distil(dataclasses.replace(config, **change))["key"] != first
        assert "translating again" in capsys.readouterr().err
    # parts of a stopped start, then another teacher in the same folder: translated afresh
    monkeypatch.setattr(distill, "PARTS", 4)
    real = stop_translating_at(3, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        distill.distil(config)
    monkeypatch.setattr(distill, "translate", real)
    other = dataclasses.replace(config, distill_from=f"{home}/weights/t2")
    distill.distil(other)
    alone = dataclasses.replace(other, model_folder=str(tmp_path / "t2"))
    distill.distil(alone)
    assert lines(tmp_path / "w/distilled/train.tgt") == lines(tmp_path / "t2/distilled/train.tgt")
    # parts of another size: not taken either
    stop_translating_at(3, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        distill.distil(config)
    monkeypatch.setattr(distill, "translate", real)
    monkeypatch.setattr(distill, "PARTS", 8)
    assert "chunks of the teachers' translations are done" not in capsys.readouterr().err
    distill.distil(config)
    assert "chunks of the teachers' translations are done" not in capsys.readouterr().err
    # without a validation split, the sources are the split the seed leaves in train
    held = tmp_path / "held"
    shutil.copytree(home / "corpus", held)
    for f in held.glob("val.*"):
        f.unlink()
    a = distill.DistilledTargets.sources_key(
        distill.load_corpus(Config(data_dir=str(held), seed=1), ("train",))["train"])
    b = distill.DistilledTargets.sources_key(
        distill.load_corpus(Config(data_dir=str(held), seed=2), ("train",))["train"])
    assert a != b


def test_the_translations_must_match_the_sources_line_for_line(teachers, tmp_path):
    from corpus import DataError, DistilledTargets, load_corpus
    from nmt import distill
    home = teachers
    config = distil_config(home, model_folder=str(tmp_path / "w"))
    distill.distil(config)
    targets = DistilledTargets(config.model_folder)
    both = ("train", "validation")
    train = load_corpus(config, both)["train"]  # (the distilled pairs read fine)
    own = load_corpus(dataclasses.replace(config, distill_from=""), both)["train"]
    assert len(train) == 160
    path = tmp_path / "w/distilled/train.tgt"
    good = path.read_text(encoding="utf-8")
    path.write_text(good + "one more\n", encoding="utf-8")
    with pytest.raises(DataError, match="has more lines than the 160 sources"):
        targets.pairs(own)
    path.write_text("".join(line + "\n" for line in good.splitlines()[:-1]), encoding="utf-8")
    with pytest.raises(DataError, match="has 159 lines for 160 sources"):
        targets.pairs(own)
    path.write_text(good, encoding="utf-8")
    with pytest.raises(DataError, match="translates other sources"):
        targets.pairs(own.select(range(1, 160)))


def test_a_stop_while_joining_leaves_no_false_meta(teachers, tmp_path, monkeypatch):
    """meta.json is written last, and complete translations of another key lose theirs
    before anything else is written: a stop while joining leaves no meta.json that does not
    describe train.tgt, and the next start joins again without translating."""
    import corpus
    from nmt import distill
    home = teachers
    config = distil_config(home, model_folder=str(tmp_path / "w"))
    distill.distil(config)
    real = corpus._write_atomic

    def stop_at_meta(path, text):
        if path.name == "meta.json":
            raise KeyboardInterrupt
        return real(path, text)
    monkeypatch.setattr(corpus, "_write_atomic", stop_at_meta)
    other = dataclasses.replace(config, distill_beam=1)
    with pytest.raises(KeyboardInterrupt):
        distill.distil(other)
    assert not (tmp_path / "w/distilled/meta.json").exists()
    monkeypatch.setattr(corpus, "_write_atomic", real)
    calls = []
    monkeypatch.setattr(distill, "translate", lambda *a, **k: calls.append(1))
    meta = distill.distil(other)
    assert calls == [] and meta["beam"] == 1


def test_a_resume_keeps_its_translations_or_refuses_other_weights(teachers, tmp_path):
    """A resumed student keeps the translations it trained on whatever its teachers' folders
    hold now; with its distilled/ gone, it translates them again from the same weights, and
    refuses other weights before translating."""
    home = teachers
    shutil.copytree(home / "weights/t1", tmp_path / "t")
    flags = ["--distill_from", str(tmp_path / "t"), "--distill_beam", "1"]
    made = student(home, *flags, folder=str(tmp_path / "s"))
    assert made.returncode == 0, made.stderr.decode()[-2000:]
    (tmp_path / "t/tmodel_15.pt").unlink()  # the teacher's newest is now another epoch
    kept = student(home, *flags, folder=str(tmp_path / "s"), epochs="2")
    assert kept.returncode == 0, kept.stderr.decode()[-2000:]
    assert "teachers translating" not in kept.stderr.decode()
    shutil.rmtree(tmp_path / "s/distilled")
    refused = student(home, *flags, folder=str(tmp_path / "s"), epochs="3")
    err = refused.stderr.decode()
    assert refused.returncode == 2 and "teachers translating" not in err
    assert err.strip().splitlines()[-1].endswith(
        "distilled is gone and the teachers' weights are not those the run trained on the "
        "translations of: put it back, or train into another --model_folder")
    shutil.copy(home / "weights/t1/tmodel_15.pt", tmp_path / "t/tmodel_15.pt")
    again = student(home, *flags, folder=str(tmp_path / "s"), epochs="3")
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert "teachers translating" in again.stderr.decode()


def test_teachers_are_checked_on_the_corpus_alone(teachers, tmp_path):
    """A student with extra pairs, a teacher that is itself a distilled student: the corpus
    they share is what is compared; the sources translated are the corpus's own."""
    from nmt import distill
    home = teachers
    write_aligned(tmp_path / "extra", "train", number_pairs(20, seed=11))
    first = student(home, "--distill_from", "weights/t1", "--distill_beam", "1",
                    folder=str(tmp_path / "distilled"))
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    config = distil_config(home, model_folder=str(tmp_path / "w"),
                           distill_from=str(tmp_path / "distilled"),
                           extra_data_dir=str(tmp_path / "extra"))
    plan = distill.plan_translation(config)
    assert plan["sentences"] == 160


def test_held_out_validation_is_checked_when_planning(tmp_path):
    from nmt import distill
    from nmt.checkpoint import CheckpointError
    write_aligned(tmp_path / "corpus", "train", number_pairs(40, seed=3))  # no validation
    result = run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "1",
                      "--seed", "1", "--model_folder", "weights/t", cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    config = dataclasses.replace(Config(), data_dir=str(tmp_path / "corpus"), seq_len=24,
                                 model_folder=str(tmp_path / "s"),
                                 distill_from=str(tmp_path / "weights/t"), seed=42)
    with pytest.raises(CheckpointError, match="give the student --seed 1"):
        distill.plan_translation(config)


def test_teachers_with_other_target_vocabularies_are_refused_before_anything_is_written(
        teachers, tmp_path):
    from nmt import distill
    from nmt.checkpoint import CheckpointError
    home = teachers
    shutil.copytree(home / "weights/t2", tmp_path / "t")
    state = torch.load(tmp_path / "t/tmodel_01.pt", weights_only=False)
    state["tokenizers"] = [state["tokenizers"][0], "another"]
    torch.save(state, tmp_path / "t/tmodel_01.pt")
    config = distil_config(home, model_folder=str(tmp_path / "w"),
                           distill_from=f"{home}/weights/t1,{tmp_path}/t")
    with pytest.raises(CheckpointError, match="has another target tokenizer than"):
        distill.plan_translation(config)
    assert not (tmp_path / "w").exists()


def test_the_model_card_names_each_teachers_weights():
    """The card's distillation sentence names each teacher as given and the checkpoint(s) it
    translated with: a checkpoint file as itself, a folder with its averaged files; no 'average of
    its newest 1 checkpoint(s)' for a lone checkpoint."""
    from config import Config
    from nmt.model_card import distilled_text
    distilled = {"sentences": 29000, "beam": 5, "average": 2, "teachers": [
        {"teacher": "runs/t1/tmodel_best.pt", "checkpoint": "runs/t1/tmodel_best.pt",
         "averaged": ["tmodel_best.pt"]},
        {"teacher": "runs/t2", "checkpoint": "runs/t2/tmodel_09.pt",
         "averaged": ["tmodel_08.pt", "tmodel_09.pt"]}]}
    text = distilled_text(Config(distill_data="both"), distilled)
    assert ("translations of 29,000 training sources by the ensemble of "
            "`runs/t1/tmodel_best.pt`, `runs/t2` (the average of tmodel_08.pt, tmodel_09.pt) "
            "(beam 5), beside the corpus's own references.") in text
    one = dict(distilled, teachers=[{"teacher": "runs/t3", "checkpoint": "runs/t3/tmodel_04.pt",
                                     "averaged": ["tmodel_04.pt"]}])
    text = distilled_text(Config(distill_data="distilled"), one)
    assert "sources by `runs/t3` (tmodel_04.pt) (beam 5), in place of the references." in text
    assert distilled_text(Config(), {}) == ""
