"""nmt/distill.py and train.py --distill_from: sequence-level knowledge distillation on tiny
data (two tiny teachers, a student trained on their translations, a second start that does not
translate again, mismatched teachers refused)."""

import dataclasses
import json

import pytest
import torch

from config import Config
from conftest import TINY, make_corpus, number_pairs, run_here, write_aligned
from nmt.checkpoint import CheckpointError, load_checkpoint


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A folder with a tiny corpus and two tiny teachers trained on it (seeds 1 and 2)."""
    home = tmp_path_factory.mktemp("distil")
    make_corpus(home / "corpus", n=48)
    for seed in (1, 2):
        result = run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "2",
                          "--seed", seed, "--model_folder", f"weights/t{seed}",
                          "--experiment_name", f"runs/t{seed}", cwd=home)
        assert result.returncode == 0, result.stderr.decode()[-2000:]
    return home


def student(home, *flags, folder="weights/student"):
    return run_here("train.py", "--data_dir", "corpus", *TINY, "--num_epochs", "1",
                    "--model_folder", folder, "--experiment_name", "runs/student", *flags,
                    cwd=home)


def test_student_trains_on_the_ensembles_translations(teachers):
    home = teachers
    result = student(home, "--distill_from", "weights/t1,weights/t2", "--distill_beam", "2")
    err = result.stderr.decode()
    assert result.returncode == 0, err[-2000:]
    assert "teachers translating (beam 2)" in err  # the progress bar
    assert "training pairs: 48 translated by the teachers" in err
    folder = home / "weights/student/distilled"
    targets = (folder / "train.tgt").read_text(encoding="utf-8").splitlines()
    assert len(targets) == 48
    # the targets are the two teachers' translations as one ensemble, as translate.py makes them
    ensemble = run_here("translate.py", "--ensemble", "weights/t1,weights/t2", "--beam", "2",
                        "--preload", "latest", "--input", "corpus/train.en", cwd=home)
    assert ensemble.returncode == 0, ensemble.stderr.decode()[-2000:]
    assert ensemble.stdout.decode().splitlines() == targets
    # ... and they are what the student trained on: its prepared targets decode to them
    from dataset import load_prepared
    from tokenizer import load_tokenizer
    meta = json.loads((home / "weights/student/prepared/meta.json").read_text())
    train, _, _ = load_prepared(home / "weights/student/prepared", meta["key"])
    tok = load_tokenizer(home / "weights/student/tokenizer_it.json", "bpe")
    trained_on = sorted(tok.decode(list(map(int, train.tgt_ids[i]))).strip()
                        for i in range(len(train)))
    assert trained_on == sorted(targets)
    # the checkpoint and the model card record the teachers
    state = load_checkpoint(home / "weights/student/tmodel_00.pt")
    recorded = state["corpus"]["distilled"]
    assert [t["teacher"] for t in recorded["teachers"]] == ["weights/t1", "weights/t2"]
    assert recorded["beam"] == 2
    card = (home / "weights/student/MODEL_CARD.md").read_text(encoding="utf-8")
    assert "knowledge distillation" in card and "`weights/t1`" in card and "`weights/t2`" in card

    # a second start (a resume for one more epoch) does not translate again
    again = student(home, "--num_epochs", "2")
    err = again.stderr.decode()
    assert again.returncode == 0, err[-2000:]
    assert "teachers translating" not in err
    assert load_checkpoint(home / "weights/student/tmodel_01.pt")["corpus"] == state["corpus"]


def test_distil_translates_once_per_teachers_and_settings(teachers, capsys, monkeypatch):
    from nmt import distill
    monkeypatch.chdir(teachers)
    config = dataclasses.replace(Config(), data_dir="corpus", model_folder="weights/once",
                                 seq_len=24, distill_from="weights/t1", distill_beam=1)
    first = distill.distil(config)
    assert "teachers translated 48 training sources" in capsys.readouterr().err
    assert distill.distil(config) == first  # found: not translated again
    assert "not translating again" in capsys.readouterr().err
    for other in (dict(distill_beam=2), dict(distill_from="weights/t1,weights/t2")):
        changed = distill.distil(dataclasses.replace(config, **other))
        assert changed["key"] != first["key"]
        assert "translating again" in capsys.readouterr().err
    # new translations of the same sources, from the other settings
    meta = json.loads((teachers / "weights/once/distilled/meta.json").read_text())
    assert [t["teacher"] for t in meta["teachers"]] == ["weights/t1", "weights/t2"]


def test_both_keeps_the_references_beside_the_translations(teachers):
    result = student(teachers, "--distill_from", "weights/t1", "--distill_data", "both",
                     "--distill_beam", "1", folder="weights/both")
    err = result.stderr.decode()
    assert result.returncode == 0, err[-2000:]
    assert "48 translated by the teachers (--distill_from), after the corpus's own 48" in err
    meta = json.loads((teachers / "weights/both/prepared/meta.json").read_text())
    assert meta["pairs"] == 96  # (some of the tiny teachers' outputs outgrow seq_len: dropped)


def test_mismatched_teachers_are_refused(teachers):
    home = teachers
    # another language pair: the student translates it->en
    result = student(home, "--distill_from", "weights/t1", "--lang_src", "it", "--lang_tgt",
                     "en", folder="weights/reverse")
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2
    assert err[-1].startswith("train.py: error: --distill_from weights/t1 translates en->it, "
                              "not it->en")
    # another corpus
    write_aligned(home / "other", "train", number_pairs(32, seed=9))
    write_aligned(home / "other", "val", number_pairs(8, seed=10))
    result = run_here("train.py", "--data_dir", "other", *TINY, "--num_epochs", "1",
                      "--model_folder", "weights/other", "--distill_from", "weights/t1",
                      cwd=home)
    err = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2
    assert "was trained on" in err[-1] and "a teacher must be trained on the student's corpus" \
        in err[-1]
    # a teacher that does not exist
    result = student(home, "--distill_from", "weights/t1,weights/none", folder="weights/x")
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines()[-1] == (
        "train.py: error: --distill_from weights/none: no such model folder or checkpoint file")
    for refused in ("reverse", "other", "x"):  # nothing left behind by a refused start
        assert not (home / "weights" / refused).exists()


def test_distill_flags_need_teachers():
    from config import parse_config
    with pytest.raises(SystemExit):
        parse_config(["--distill_beam", "3"])
    config, _ = parse_config(["--distill_from", "a,b", "--distill_beam", "3"])
    assert config.distill_beam == 3


def test_teacher_check_reads_the_checkpoint(tmp_path):
    """check_teacher refuses a checkpoint that records no corpus (written before corpora were
    recorded): which corpus it learned is unknown."""
    from nmt.checkpoint import CheckpointError
    from nmt.distill import check_teacher
    state = {"config": Config(lang_src="en", lang_tgt="it").to_dict()}
    with pytest.raises(CheckpointError, match="a corpus it does not record"):
        check_teacher("old", state, Config(lang_src="en", lang_tgt="it"), "/data")
    state["corpus"] = {"source": "/data"}
    check_teacher("old", state, Config(lang_src="en", lang_tgt="it"), "/data")
    torch.manual_seed(0)  # (no state leaks from here)


def test_a_teacher_recorded_with_its_corpus_link_resolved_is_the_same_corpus(tmp_path):
    """Corpora are now recorded as the user named them (a link stays a link); a teacher trained
    before recorded the link's target: the same folder, not another corpus."""
    from nmt.distill import check_teacher
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    state = {"config": Config(lang_src="en", lang_tgt="it").to_dict(),
             "corpus": {"source": str(tmp_path / "real")}}
    check_teacher("t", state, Config(lang_src="en", lang_tgt="it"), str(tmp_path / "link"))
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="a teacher must be trained on the student's"):
        check_teacher("t", state, Config(lang_src="en", lang_tgt="it"), str(tmp_path / "other"))
