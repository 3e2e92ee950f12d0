"""Checkpoint files: atomic saves, safe loads and their refusals, averaging, pruning."""

import dataclasses
import math
import pickle
import shutil

import pytest
import torch
from conftest import tiny_state

from config import Config
from model import build_transformer
from nmt.checkpoint import (CheckpointError, check_tokenizers, latest_checkpoint_path,
                            load_averaged, load_checkpoint, prune_checkpoints, save_checkpoint)


def small_state(vocab=(20, 30), **extra):
    model = build_transformer(vocab[0], vocab[1], 16, 16, d_model=8, N=1, h=2, d_ff=16)
    return {"model_state_dict": model.state_dict(), "config": Config().to_dict(), "epoch": 0,
            "global_step": 1, **extra}


def test_checkpoints_round_trip_and_the_latest_is_found(tmp_path):
    config = Config(model_folder=str(tmp_path))
    for name in ("tmodel_00.pt", "tmodel_01_s0000012.pt", "tmodel_01.pt", "tmodel_02_s0000020.pt",
                 "tmodel_02_s0000018.pt", "other_05.pt"):
        save_checkpoint(small_state(), tmp_path / name)
    assert latest_checkpoint_path(config).name == "tmodel_02_s0000020.pt"
    state = load_checkpoint(tmp_path / "tmodel_01.pt")
    assert state["global_step"] == 1 and isinstance(state["config"], dict)
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_a_missing_epoch_names_the_epochs_there(tmp_path):
    """--preload 99 said only that tmodel_99.pt was missing, not which epochs there are."""
    from nmt.checkpoint import resolve_preload
    config = Config(model_folder=str(tmp_path), preload="99")
    # no epoch's own file yet: two mid-epoch ones, the newest named
    for name in ("tmodel_00_s0000005.pt", "tmodel_00_s0000003.pt", "tmodel_best.pt"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        resolve_preload(config)
    assert str(e.value) == (f"--preload 99: no checkpoint {tmp_path / 'tmodel_99.pt'} (only "
                            "mid-epoch checkpoints there, the newest tmodel_00_s0000005.pt; "
                            "--preload latest for the newest checkpoint)")
    for epoch in (0, 1, 2):
        (tmp_path / f"tmodel_{epoch:02d}.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"tmodel_99\.pt \(the epochs saved there: 00, 01, "
                                              r"02; --preload latest for the newest checkpoint\)$"):
        resolve_preload(config)
    for epoch in range(3, 8):  # eight are listed whole, nine elided
        (tmp_path / f"tmodel_{epoch:02d}.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"there: 00, 01, 02, 03, 04, 05, 06, 07; "):
        resolve_preload(config)
    (tmp_path / "tmodel_08.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"there: 00, 01, 02, \.\.\., 06, 07, 08; "):
        resolve_preload(config)
    empty = tmp_path / "empty"  # how to train into that folder (python train.py: weights/)
    with pytest.raises(CheckpointError) as e:
        resolve_preload(Config(model_folder=str(empty), preload="99"))
    assert str(e.value) == (f"--preload 99: no checkpoint {empty / 'tmodel_99.pt'} (train a "
                            f"model into it with python train.py --model_folder {empty} ..., "
                            f"or pass --checkpoint PATH)")


def test_a_full_disk_while_saving_is_one_line_and_leaves_the_saved_file(tmp_path, monkeypatch):
    """A disk that fills up during a save: torch's zip writer reports the short write as a
    RuntimeError ("[enforce fail at inline_container.cc...] unexpected pos"), which ended the
    run in a traceback with the temporary file left behind. One line now; the file saved
    before is whole and no temporary file stays. Any other error of torch.save is a bug: as
    it was."""
    import nmt.checkpoint as checkpoint
    path = tmp_path / "tmodel_00.pt"
    save_checkpoint(small_state(), path)
    before = path.read_bytes()

    def full(state, f):
        f.write(b"PK" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 135744 "
                           "vs 135632")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*tmodel_00\.pt: the "
                                              r"write stopped short \([\d,]+ MiB free on its "
                                              r"disk\); the checkpoints already saved"):
        save_checkpoint(small_state(), path)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    def bug(state, f):
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setattr(checkpoint.torch, "save", bug)
    with pytest.raises(RuntimeError, match="device-side assert"):
        save_checkpoint(small_state(), path)


class Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_checkpoint_holding_a_pickled_object_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save(small_state(extra=Exploit()), path)
    with pytest.raises(CheckpointError, match=r"evil.pt refused: it holds a pickled object "
                                              r"\((builtins\.)?print\), which could run code") as e:
        load_checkpoint(path)
    assert "weights_only" not in str(e.value)  # never torch's advice to turn the guard off
    assert "this must never run" not in capsys.readouterr().out
    path2 = tmp_path / "pickle.pt"
    path2.write_bytes(pickle.dumps({"model_state_dict": Exploit()}))
    with pytest.raises(CheckpointError, match="pickle.pt"):
        load_checkpoint(path2)


def test_truncated_corrupt_foreign_and_mismatched_checkpoints_are_refused(tmp_path):
    """Each in one short line that says what the file is and what to do (issue 24: a
    truncated file gave a 426-character line of torch's internals)."""
    good = tmp_path / "good.pt"
    save_checkpoint(small_state(), good)
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    (tmp_path / "hello.pt").write_text("hello\n")  # (torch's unpickler: KeyError: 101)
    (tmp_path / "ab.pt").write_text("ab")  # (IndexError: pop from empty list)
    (tmp_path / "tmodel_03.pt").write_bytes(b"\x00" * 64)  # a run's own name: damaged
    (tmp_path / "tokenizer_en.json").write_text('{"version": "1.0"}')
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    for name, message in (
            # (earlier epochs keep the weights only, by default: the advice names a way on)
            ("truncated.pt", "truncated.pt is truncated or damaged (an interrupted copy?); use "
                             "another: --preload NN, or a new run from one's weights "
                             "(--init_from FILE --model_folder NEW)"),
            ("garbage.pt", "garbage.pt is not a PyTorch checkpoint: give a tmodel_*.pt file"),
            ("hello.pt", "hello.pt is not a PyTorch checkpoint: give a tmodel_*.pt file"),
            ("ab.pt", "ab.pt is not a PyTorch checkpoint: give a tmodel_*.pt file"),
            ("tmodel_03.pt", "tmodel_03.pt is damaged (its bytes are not a PyTorch checkpoint); "
                             "use another: --preload NN, or a new run from one's weights"),
            ("tokenizer_en.json", "tokenizer_en.json is a JSON file, not a checkpoint: give a "
                                  "tmodel_*.pt file")):
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(tmp_path / name)
        assert message in str(e.value) and len(str(e.value)) < 200 + len(str(tmp_path))
        assert "\n" not in str(e.value) and "miniz" not in str(e.value)
    with pytest.raises(CheckpointError, match="foreign.pt is not a checkpoint of this project"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="missing.pt not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_language_mismatch_names_the_model_to_look_for_by_the_flags_given():
    """Translating with --lang_src fr a model of en to de: the model to look for is fr to de
    (the side not given is the model's), not fr to it (Config's default target)."""
    from nmt.checkpoint import merge_config
    saved = Config(lang_src="en", lang_tgt="de")
    with pytest.raises(CheckpointError) as e:
        merge_config(saved, Config(lang_src="fr"), {"lang_src"}, "M", set(), translating=True)
    assert "this model translates en to de; drop the flag, or give a model trained for fr to " \
        "de with" in str(e.value)
    with pytest.raises(CheckpointError, match="trained for en to fr with"):
        merge_config(saved, Config(lang_tgt="fr"), {"lang_tgt"}, "M", set(), translating=True)


def word_tokenizer(words):
    """A word-level tokenizer of the four special tokens and `words` (each seen twice)."""
    from tokenizer import build_tokenizer
    return build_tokenizer("word", 1000, [" ".join(words)] * 2)


def test_a_checkpoint_refuses_tokenizers_it_was_not_trained_with(tmp_path):
    """Issue 45: only the vocabulary sizes were compared, so a tokenizer file swapped for another
    of the same size went unnoticed (translate.py printed garbage). Checkpoints now carry their
    tokenizers' fingerprints (vocabulary and merges); those of earlier versions, without them,
    are still held to the sizes."""
    from tokenizer import tokenizer_fingerprint
    good = tmp_path / "good.pt"
    save_checkpoint(small_state(), good)
    state = load_checkpoint(good)
    src = word_tokenizer([f"s{i}" for i in range(16)])  # 20 with the special tokens
    tgt = word_tokenizer([f"t{i}" for i in range(26)])  # 30
    check_tokenizers(state, good, src, tgt)  # no fingerprints saved: the sizes agree
    with pytest.raises(CheckpointError, match="another target tokenizer than the file here "
                                              r"\(a vocabulary of 31, not 30\)"):
        check_tokenizers(state, good, src, word_tokenizer([f"t{i}" for i in range(27)]))
    state["tokenizers"] = [tokenizer_fingerprint(src), tokenizer_fingerprint(tgt)]
    check_tokenizers(state, good, src, tgt)
    swapped = word_tokenizer([f"u{i}" for i in range(26)])  # the same size, other words
    assert swapped.get_vocab_size() == tgt.get_vocab_size()
    with pytest.raises(CheckpointError, match="the same size, but other tokens or merges: "
                                              f"fingerprint {tokenizer_fingerprint(swapped)}"):
        check_tokenizers(state, good, src, swapped)
    assert tokenizer_fingerprint(word_tokenizer([f"t{i}" for i in range(26)])) == \
        state["tokenizers"][1]  # the same tokenizer trained again: the same fingerprint


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "tmodel_00.pt"
    save_checkpoint(small_state(), path)
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device; the checkpoints "
                                              "already saved are untouched"):
        save_checkpoint(small_state(), path)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    assert math.isfinite(load_checkpoint(path)["global_step"])


def test_averaging_uses_per_epoch_checkpoints_only(tmp_path):
    """--average N from a mid-epoch latest: the last N per-epoch files, never a mid-epoch one."""
    config = Config(model_folder=str(tmp_path))
    for name, state in (("tmodel_00.pt", tiny_state(0)), ("tmodel_01.pt", tiny_state(1)),
                        ("tmodel_02_s0000025.pt", tiny_state(2, step=25))):
        save_checkpoint(state, tmp_path / name)
    _, paths = load_averaged(config, tmp_path / "tmodel_02_s0000025.pt", 2)
    assert [p.name for p in paths] == ["tmodel_00.pt", "tmodel_01.pt"]
    _, paths = load_averaged(config, tmp_path / "tmodel_00.pt", 1)
    assert [p.name for p in paths] == ["tmodel_00.pt"]
    with pytest.raises(CheckpointError, match="only 1 per-epoch"):
        load_averaged(config, tmp_path / "tmodel_00.pt", 2)


def ended_at(folder, step: int):
    """The model card a run writes where it ends (its step: nmt.checkpoint.card_step)."""
    (folder / "MODEL_CARD.md").write_text(f"# a run\n\n- {step} optimizer steps in 1.0 "
                                          f"minutes\n", encoding="utf-8")


def test_averaging_counts_a_schedule_that_ended_mid_epoch_as_an_epochs_end(tmp_path):
    """A --time_budget (or --max_steps) run ends its schedule mid-epoch: that last checkpoint
    (its step the model card's) is the end of training and takes part in --average N, from
    itself (the newest); not from an earlier checkpoint, and not where a stop (Ctrl-C) saved
    mid-epoch, even past its schedule_steps (an inverse square root's, not lengthened by a
    raised --max_steps)."""
    config = Config(model_folder=str(tmp_path))
    for epoch in range(3):  # steps 10, 20, 30
        save_checkpoint(tiny_state(epoch, schedule_steps=35), tmp_path / f"tmodel_{epoch:02d}.pt")
    end = tmp_path / "tmodel_03_s0000035.pt"
    save_checkpoint(tiny_state(3, step=35, schedule_steps=35), end)
    ended_at(tmp_path, 35)
    assert [p.name for p in load_averaged(config, end, 3)[1]] == [
        "tmodel_01.pt", "tmodel_02.pt", end.name]
    assert [p.name for p in load_averaged(config, tmp_path / "tmodel_02.pt", 3)[1]] == [
        "tmodel_00.pt", "tmodel_01.pt", "tmodel_02.pt"]
    ended_at(tmp_path, 20)  # a card of an earlier end: this one is a stop
    assert [p.name for p in load_averaged(config, end, 3)[1]] == [
        "tmodel_00.pt", "tmodel_01.pt", "tmodel_02.pt"]
    end.unlink()  # a plan shortened at the epoch's end (step 30) ends at the next epoch's first
    end = tmp_path / "tmodel_03_s0000030.pt"  # batch: a copy of tmodel_02.pt, counted once
    save_checkpoint(tiny_state(3, step=30, schedule_steps=30), end)
    ended_at(tmp_path, 30)
    assert [p.name for p in load_averaged(config, end, 2)[1]] == ["tmodel_01.pt", "tmodel_02.pt"]


def test_load_averaged_gives_the_mean_of_exactly_the_checkpoints_it_names(tmp_path):
    """--average N: the weights load_averaged returns are the mean of the N files it names,
    each once (the run's mid-epoch end among them), and its position the newest's."""
    config = Config(model_folder=str(tmp_path))
    for epoch in range(3):
        torch.manual_seed(epoch)
        save_checkpoint(tiny_state(epoch, schedule_steps=35), tmp_path / f"tmodel_{epoch:02d}.pt")
    end = tmp_path / "tmodel_03_s0000035.pt"
    torch.manual_seed(3)
    save_checkpoint(tiny_state(3, step=35, schedule_steps=35), end)
    ended_at(tmp_path, 35)
    assert load_averaged(config, end, 3)[1][-1] == end
    for path, n in ((end, 3), (tmp_path / "tmodel_02.pt", 2)):
        state, paths = load_averaged(config, path, n)
        assert len(paths) == n == len(set(paths))
        weights = [load_checkpoint(p)["model_state_dict"] for p in paths]
        for k, v in state["model_state_dict"].items():
            mean = torch.stack([w[k].double() for w in weights]).mean(0).to(v.dtype)
            torch.testing.assert_close(v, mean, msg=k)
        assert state["global_step"] == load_checkpoint(paths[-1])["global_step"]


def test_averaging_from_a_mid_epoch_best_leaves_out_the_end_of_its_epoch(tmp_path):
    """Issue 41: --preload best --average N averaged up to the best's epoch; a best from a
    mid-epoch validation (--eval_every) is older than its epoch's end, which joined the
    average. A best saved at an epoch's end keeps that epoch."""
    config = Config(model_folder=str(tmp_path))
    for epoch in range(4):  # steps 10, 20, 30, 40
        save_checkpoint(tiny_state(epoch), tmp_path / f"tmodel_{epoch:02d}.pt")
    best = tmp_path / "tmodel_best.pt"
    save_checkpoint(tiny_state(epoch=3, global_step=35, validation={}), best)  # mid-epoch 3
    assert [p.name for p in load_averaged(config, best, 2)[1]] == ["tmodel_01.pt",
                                                                   "tmodel_02.pt"]
    save_checkpoint(tiny_state(epoch=3, global_step=40, validation={}), best)  # epoch 3's end
    assert [p.name for p in load_averaged(config, best, 2)[1]] == ["tmodel_02.pt",
                                                                   "tmodel_03.pt"]


def test_pruning_keeps_the_newest_epochs_and_mid_epoch_saves_and_never_the_best(tmp_path):
    """--keep_epochs N keeps the newest N per-epoch checkpoints; --keep_last the newest
    mid-epoch ones; the best checkpoint and other files are never touched."""
    names = ["tmodel_00.pt", "tmodel_01_s0000010.pt", "tmodel_01.pt", "tmodel_02.pt",
             "tmodel_03.pt", "tmodel_04_s0000041.pt", "tmodel_04_s0000042.pt",
             "tmodel_04_s0000043.pt", "tmodel_best.pt", "tmodel_validation.json", "notes.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    prune_checkpoints(Config(model_folder=str(tmp_path), keep_epochs=2, keep_last=2,
                             keep_optimizer=0, save_every=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tmodel_02.pt", "tmodel_03.pt", "tmodel_04_s0000042.pt", "tmodel_04_s0000043.pt",
         "tmodel_best.pt", "tmodel_validation.json", "notes.pt"])
    prune_checkpoints(Config(model_folder=str(tmp_path), keep_epochs=0, keep_last=1,
                             keep_optimizer=0, save_every=1))
    assert {p.name for p in tmp_path.glob("tmodel_0*.pt")} == {
        "tmodel_02.pt", "tmodel_03.pt", "tmodel_04_s0000043.pt"}  # 0: every epoch kept


def test_older_epochs_keep_their_weights_and_lose_the_optimizer_state(tmp_path):
    """Issue 45: every per-epoch checkpoint kept Adam's moments (twice the weights): 12 epochs
    of a 2.9M-parameter model took 419 MB. All but the newest --keep_optimizer per-epoch
    checkpoints are rewritten with the weights only; mid-epoch ones (what a stopped run
    resumes from) and the newest keep theirs; averaging reads the stripped ones as before."""
    moments = {"state": {0: {"exp_avg": torch.ones(1000)}}, "param_groups": []}
    names = ["tmodel_00.pt", "tmodel_01.pt", "tmodel_02.pt", "tmodel_03_s0000035.pt"]
    for epoch, name in enumerate(names):
        save_checkpoint(tiny_state(epoch, optimizer_state_dict=moments, scaler_state_dict={}),
                        tmp_path / name)
    weights = load_checkpoint(tmp_path / "tmodel_00.pt")["model_state_dict"]
    sizes = {name: (tmp_path / name).stat().st_size for name in names}
    config = Config(model_folder=str(tmp_path), keep_optimizer=2)
    prune_checkpoints(config)
    kept = {name: "optimizer_state_dict" in load_checkpoint(tmp_path / name) for name in names}
    assert kept == {"tmodel_00.pt": False, "tmodel_01.pt": True, "tmodel_02.pt": True,
                    "tmodel_03_s0000035.pt": True}
    assert (tmp_path / "tmodel_00.pt").stat().st_size < sizes["tmodel_00.pt"] - 4000
    stripped = load_checkpoint(tmp_path / "tmodel_00.pt")
    assert "scaler_state_dict" not in stripped and stripped["next_epoch"] == 1
    assert all(torch.equal(v, weights[k]) for k, v in stripped["model_state_dict"].items())
    prune_checkpoints(dataclasses.replace(config, keep_optimizer=1))
    assert "optimizer_state_dict" not in load_checkpoint(tmp_path / "tmodel_01.pt")
    assert load_averaged(config, tmp_path / "tmodel_02.pt", 3)[1][0].name == "tmodel_00.pt"
    prune_checkpoints(dataclasses.replace(config, keep_optimizer=0))  # 0: none stripped
    assert "optimizer_state_dict" in load_checkpoint(tmp_path / "tmodel_02.pt")


def test_averaging_holds_one_checkpoint_at_a_time_and_gives_the_mean(tmp_path, monkeypatch):
    """Issue 24: --average N loaded all N checkpoints, Adam moments included, before averaging
    (about 13 GB for paper_big and N = 5). Now a running sum: at most one checkpoint is held
    while the next is read, and the result is the mean."""
    from nmt import checkpoint
    states = []
    for epoch in range(4):
        torch.manual_seed(epoch)
        state = tiny_state(epoch, optimizer_state_dict={"moments": torch.randn(1000)})
        states.append(state)
        save_checkpoint(state, tmp_path / f"tmodel_{epoch:02d}.pt")
    alive, peak = [0], [0]

    class Held:  # lives exactly as long as the state it is put in
        def __init__(self):
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])

        def __del__(self):
            alive[0] -= 1
    real = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint",
                        lambda path, mmap=False: {**real(path, mmap), "held": Held()})
    averaged = checkpoint.average_checkpoints([tmp_path / f"tmodel_{e:02d}.pt" for e in range(4)])
    assert peak[0] == 1
    assert "optimizer_state_dict" not in averaged and averaged["epoch"] == 3
    for k, v in averaged["model_state_dict"].items():
        mean = torch.stack([s["model_state_dict"][k].double() for s in states]).mean(0)
        torch.testing.assert_close(v, mean.to(v.dtype)), k


def test_the_weights_digest_reads_every_tensor_its_type_and_shape():
    """The key of the teachers' translations: the same weights give the same digest, whatever
    the file holds beside them; any change of a tensor, its dtype or its shape another."""
    from nmt.checkpoint import weights_digest
    state = tiny_state()
    same = {"model_state_dict": {k: v.clone() for k, v in state["model_state_dict"].items()},
            "optimizer_state_dict": {}}
    assert weights_digest(same) == weights_digest(state)
    weights = state["model_state_dict"]
    for name in (next(iter(weights)), list(weights)[-1]):
        changed = {k: v.clone() for k, v in weights.items()}
        changed[name].view(-1)[0] += 1
        assert weights_digest({"model_state_dict": changed}) != weights_digest(state)
    name = next(k for k, v in weights.items() if v.dim() == 2)
    for other in (weights[name].reshape(-1), weights[name].view(torch.int32)):
        changed = {**weights, name: other}  # the same bytes
        assert weights_digest({"model_state_dict": changed}) != weights_digest(state)


def test_the_card_tells_the_step_it_was_written_at_in_any_encoding(tmp_path):
    """train.py reads a finished run's card for the step of its end (`card_step`): a card
    saved again in Latin-1 by an editor (its German samples) gave a traceback on every start."""
    from nmt.checkpoint import card_step
    assert card_step(tmp_path) is None
    card = tmp_path / "MODEL_CARD.md"
    card.write_bytes("# A model\n\n- 40 optimizer steps in 4 epoch(s), 1.0 minutes\n"
                     "Der Mann läuft.\n".encode("latin-1"))
    assert card_step(tmp_path) == 40
    card.write_text("- 12 optimizer steps, a line of another kind\n")
    assert card_step(tmp_path) is None


def test_an_architecture_flag_refused_on_resume_names_what_the_user_typed():
    """Resuming a run with another value of a model field is refused, and the line says what
    to drop: the flag typed, or, where only a --preset set it, that --preset (the user typed
    no --ffn)."""
    from config import parse_config
    from nmt.checkpoint import merge_config
    saved, _ = parse_config(["--preset", "multi30k_modern"])
    for argv, said in (
            (["--ffn", "relu"], "it was trained with --ffn swiglu, not relu; the architecture "
                                "is fixed once trained: drop the flag, or train into another "
                                "--model_folder"),
            (["--preset", "multi30k"], "--ffn relu does not match M: it was trained with --ffn "
                                       "swiglu, not relu; the architecture is fixed once "
                                       "trained: drop --preset multi30k (it sets --ffn), or"),
            (["--preset", "multi30k", "--ffn", "relu"], "drop the flag, or")):
        current, given = parse_config(argv)
        with pytest.raises(CheckpointError) as refused:
            merge_config(saved, current, given, "M", set())
        assert said in str(refused.value), str(refused.value)
    current, given = parse_config(["--preset", "multi30k_modern", "--lr", "1e-4"])
    assert merge_config(saved, current, given, "M", {"lr"}).lr == 1e-4  # the same preset: taken


def test_basenames_read_a_run_by_its_own_name_where_it_ends_in_a_digit(tmp_path):
    """run2's epoch 0 is run200.pt: read with the shortest basename it was "run"'s epoch 200,
    and a new run2 in its own folder was refused as beside "another run's checkpoints"."""
    from nmt.checkpoint import basenames
    for name in ("run200.pt", "run201_s0000040.pt"):
        (tmp_path / name).write_bytes(b"")
    assert basenames(tmp_path) == ["run"]  # (ambiguous without a name to go by)
    assert basenames(tmp_path, ["run2"]) == ["run2"]
    (tmp_path / "run2best.pt").write_bytes(b"")  # a best checkpoint names its run
    assert basenames(tmp_path) == ["run2"]
    (tmp_path / "tmodel_100.pt").write_bytes(b"")
    assert basenames(tmp_path, ["tmodel_"]) == ["run2", "tmodel_"]


def test_train_pys_preload_advice_in_a_folder_without_checkpoints(tmp_path):
    """--preload 3 where there is none: the folders below that hold checkpoints (a preset
    trains into weights/<preset>), else that a run starts there without --preload; no advice
    where the run's other files would refuse that start too."""
    from nmt.checkpoint import resolve_preload
    config = Config(model_folder=str(tmp_path / "weights"), preload="3")
    (tmp_path / "weights" / "multi30k").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"tmodel_03.pt \(it holds no checkpoint: without "
                                              r"--preload a run starts there\)$"):
        resolve_preload(config, training=True)
    (tmp_path / "weights" / "multi30k" / "tmodel_00.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"tmodel_03.pt; these folders below it hold "
                                              r"checkpoints: .*multi30k \(give one as "
                                              r"--model_folder\)$"):
        resolve_preload(config, training=True)
    shutil.rmtree(tmp_path / "weights" / "multi30k")
    (tmp_path / "weights" / "results.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no checkpoint .*tmodel_03.pt$"):
        resolve_preload(config, training=True)


def test_preload_best_before_any_validation_says_when_it_is_written(tmp_path):
    """--preload best where the run has checkpoints but no best one yet: it is written at the
    first validation; in a folder without checkpoints, how to train one into it."""
    from nmt.checkpoint import resolve_preload
    (tmp_path / "tmodel_00.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"--preload best: no checkpoint .*tmodel_best\.pt "
                                              r"\(it is written after the first validation\)$"):
        resolve_preload(Config(model_folder=str(tmp_path), preload="best"))
    empty = tmp_path / "empty"
    with pytest.raises(CheckpointError, match=r"tmodel_best\.pt \(train a model into it"):
        resolve_preload(Config(model_folder=str(empty), preload="best"))


def test_pruning_keeps_mid_epoch_saves_past_an_epochs_end_with_the_weights_only(tmp_path):
    """--keep_last N keeps the newest N mid-epoch saves, also those an epoch's end came after
    (--average_saves averages them: the paper's last 5 fall across epochs); all but the run's
    newest checkpoint (what --preload latest resumes from) lose the optimizer state, which no
    resume reads; --keep_optimizer 0 keeps it in all."""
    moments = {"state": {0: {"exp_avg": torch.ones(1000)}}, "param_groups": []}
    names = ["tmodel_00.pt", "tmodel_01_s0000012.pt", "tmodel_01_s0000015.pt",
             "tmodel_01_s0000018.pt", "tmodel_01.pt", "tmodel_02_s0000025.pt"]
    for name in names:
        save_checkpoint(tiny_state(optimizer_state_dict=moments), tmp_path / name)
    config = Config(model_folder=str(tmp_path), keep_epochs=0, keep_last=3, keep_optimizer=0,
                    save_every=1)
    prune_checkpoints(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[:1] + names[2:])
    assert all("optimizer_state_dict" in load_checkpoint(tmp_path / n) for n in names[2:])
    prune_checkpoints(dataclasses.replace(config, keep_optimizer=1))
    kept = {n: "optimizer_state_dict" in load_checkpoint(tmp_path / n) for n in names[2:]}
    assert kept == {"tmodel_01_s0000015.pt": False, "tmodel_01_s0000018.pt": False,
                    "tmodel_01.pt": True, "tmodel_02_s0000025.pt": True}  # (the newest)
    (tmp_path / "tmodel_02_s0000025.pt").unlink()  # an epoch's end the newest: it keeps its own
    prune_checkpoints(dataclasses.replace(config, keep_optimizer=1))
    assert "optimizer_state_dict" in load_checkpoint(tmp_path / "tmodel_01.pt")


def test_average_saves_takes_the_checkpoints_save_every_wrote_evenly_spaced(tmp_path):
    """--average_saves N: the newest N checkpoints at multiples of the run's --save_every up to
    the one loaded, mid-epoch or an epoch's end (a save due at an epoch's last step is the
    epoch's file), one a step, and the run's end between saves; a stop (Ctrl-C) between saves
    and an epoch's end off the beat take no part."""
    run = Config(save_every=20).to_dict()
    config = Config(model_folder=str(tmp_path))
    files = {"tmodel_00_s0000020.pt": (0, 20, False), "tmodel_00.pt": (0, 30, True),
             "tmodel_01_s0000040.pt": (1, 40, False), "tmodel_01_s0000047.pt": (1, 47, False),
             "tmodel_01.pt": (1, 60, True), "tmodel_02_s0000080.pt": (2, 80, False),
             "tmodel_02.pt": (2, 90, True), "tmodel_03_s0000100.pt": (3, 100, False),
             "tmodel_03_s0000110.pt": (3, 110, False)}
    for name, (epoch, step, end) in files.items():
        save_checkpoint(tiny_state(epoch, step=None if end else step, global_step=step,
                                   config=run, schedule_steps=110), tmp_path / name)
    newest = tmp_path / "tmodel_03_s0000110.pt"
    ended_at(tmp_path, 110)
    assert [p.name for p in load_averaged(config, newest, 4, saves=True)[1]] == [
        "tmodel_01.pt", "tmodel_02_s0000080.pt", "tmodel_03_s0000100.pt", newest.name]
    best = tmp_path / "tmodel_best.pt"  # a validation at step 80: the saves up to it
    save_checkpoint(tiny_state(2, global_step=80, config=run), best)
    assert [p.name for p in load_averaged(config, best, 3, saves=True)[1]] == [
        "tmodel_01_s0000040.pt", "tmodel_01.pt", "tmodel_02_s0000080.pt"]
    assert [p.name for p in load_averaged(config, newest, 3)[1]] == [  # (per-epoch: as before)
        "tmodel_01.pt", "tmodel_02.pt", newest.name]
    with pytest.raises(CheckpointError, match=r"^--average_saves 7: only 6 checkpoint\(s\) "
                       r"saved every 20 steps up to tmodel_03_s0000110\.pt in .* \(the run keeps "
                       r"the newest --keep_last 3 saves: train with --keep_last 7 to "
                       r"average 7\)$"):
        load_averaged(config, newest, 7, "--average_saves", saves=True)
    save_checkpoint(tiny_state(3, step=110, config=Config().to_dict()), newest)
    with pytest.raises(CheckpointError, match=r"^--average_saves: .*tmodel_03_s0000110\.pt comes "
                       r"from a run trained without --save_every, .* --average N averages "
                       r"per-epoch checkpoints$"):
        load_averaged(config, newest, 2, "--average_saves", saves=True)


def test_average_saves_from_a_best_at_the_runs_end_and_the_keep_last_advice(tmp_path):
    """--preload best --average_saves N where the last validation, at the run's end between two
    saves, made the best: that end is among the saves (each file's own schedule_steps says where
    its schedule ended; the best holds none). The advice to train with a larger --keep_last comes
    only where the run kept fewer than N, never for --average (per-epoch checkpoints)."""
    run = Config(save_every=20, keep_last=5).to_dict()
    config = Config(model_folder=str(tmp_path))
    for step in (20, 40, 60, 70):  # (70: --max_steps, between two saves)
        save_checkpoint(tiny_state(0, step=step, config=run, schedule_steps=70),
                        tmp_path / f"tmodel_00_s{step:07d}.pt")
    best = tmp_path / "tmodel_best.pt"  # as best_checkpoint writes it: no schedule_steps
    save_checkpoint(tiny_state(0, global_step=70, config=run), best)
    ended_at(tmp_path, 70)
    assert [p.name for p in load_averaged(config, best, 3, saves=True)[1]] == [
        "tmodel_00_s0000040.pt", "tmodel_00_s0000060.pt", "tmodel_00_s0000070.pt"]
    with pytest.raises(CheckpointError, match=r"^--average_saves 5: only 4 checkpoint\(s\) saved "
                       r"every 20 steps up to tmodel_best\.pt in [^(]*$"):  # (--keep_last 5 kept)
        load_averaged(config, best, 5, "--average_saves", saves=True)
    with pytest.raises(CheckpointError, match=r"^--average 7: only 1 per-epoch checkpoint\(s\) up "
                       r"to tmodel_00_s0000070\.pt in [^(]*$"):
        load_averaged(config, tmp_path / "tmodel_00_s0000070.pt", 7)


def test_a_lengthened_runs_old_end_and_a_stop_past_it_are_no_saves(tmp_path):
    """A run that ended off the beat (step 50, --save_every 20) and was lengthened (--max_steps
    raised; its inverse square root keeps schedule_steps 50 in every later file): its old end
    and a stop after it (63) take no part in --average_saves, whose saves stay evenly spaced;
    the new end (70) does, once the run has ended there."""
    run = Config(save_every=20).to_dict()
    config = Config(model_folder=str(tmp_path))
    for step in (20, 40, 50, 60, 63):
        save_checkpoint(tiny_state(0, step=step, config=run, schedule_steps=50),
                        tmp_path / f"tmodel_00_s{step:07d}.pt")
    ended_at(tmp_path, 50)  # (the card of the first end, until the next)
    stop = tmp_path / "tmodel_00_s0000063.pt"
    assert [p.name for p in load_averaged(config, stop, 3, saves=True)[1]] == [
        "tmodel_00_s0000020.pt", "tmodel_00_s0000040.pt", "tmodel_00_s0000060.pt"]
    end = tmp_path / "tmodel_00_s0000070.pt"
    save_checkpoint(tiny_state(0, step=70, config=run, schedule_steps=50), end)
    ended_at(tmp_path, 70)
    assert [p.name for p in load_averaged(config, end, 2, saves=True)[1]] == [
        "tmodel_00_s0000060.pt", end.name]
    assert [p.name for p in load_averaged(config, stop, 1, saves=True)[1]] == [
        "tmodel_00_s0000060.pt"]  # (--average_saves 1: the newest save, not the stop)


def test_pruning_keeps_saves_in_keep_last_and_a_stop_only_while_it_is_the_newest(tmp_path):
    """--keep_last N counts the saves --save_every wrote: a stop (Ctrl-C, preemption) between
    them takes no place, so that --average_saves N finds N saves; the stop stays while it is
    the newest checkpoint (a resume starts there), and goes once another follows it; a pruned
    file's temporary copy (a strip or save killed) goes with it."""
    config = Config(model_folder=str(tmp_path), save_every=10, keep_last=3, keep_optimizer=0)
    for step in (10, 20, 30, 35):
        (tmp_path / f"tmodel_00_s{step:07d}.pt").write_bytes(b"x")
    prune_checkpoints(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tmodel_00_s0000010.pt", "tmodel_00_s0000020.pt", "tmodel_00_s0000030.pt",
        "tmodel_00_s0000035.pt"]
    (tmp_path / "tmodel_00.pt").write_bytes(b"x")  # the epoch's end, at step 38: the newest
    prune_checkpoints(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tmodel_00.pt", "tmodel_00_s0000010.pt", "tmodel_00_s0000020.pt",
        "tmodel_00_s0000030.pt"]
    (tmp_path / "tmodel_01_s0000040.pt").write_bytes(b"x")
    (tmp_path / ".tmodel_00_s0000010.pt.tmp").write_bytes(b"x")  # (a strip of it, killed)
    prune_checkpoints(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tmodel_00.pt", "tmodel_00_s0000020.pt", "tmodel_00_s0000030.pt",
        "tmodel_01_s0000040.pt"]
    (tmp_path / "tmodel_01_s0000044.pt").write_bytes(b"x")  # --save_every 0: each is a stop,
    prune_checkpoints(dataclasses.replace(config, save_every=0))  # kept while the newest
    assert sorted(p.name for p in tmp_path.glob("*_s*")) == ["tmodel_01_s0000044.pt"]


def test_a_save_reaches_the_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """Atomic is not enough after a power cut: the file's bytes are flushed to disk before the
    rename makes it the checkpoint, and the folder after it (else the rename can be lost)."""
    import os
    import stat
    from nmt import checkpoint
    events, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        events.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", synced)
    monkeypatch.setattr(checkpoint.os, "replace",
                        lambda a, b: events.append("rename") or replace(a, b))
    save_checkpoint(small_state(), tmp_path / "tmodel_00.pt")
    assert events == ["file", "rename", "folder"]


def test_a_dict_lacking_a_checkpoints_keys_is_refused(tmp_path):
    """Any key of the format missing (not all of them) is not a checkpoint of this project."""
    state = small_state()
    del state["global_step"]
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"partial\.pt is not a checkpoint of this project "
                                              r"\(it lacks model_state_dict, config, epoch, "
                                              r"global_step\)"):
        load_checkpoint(tmp_path / "partial.pt")
    (tmp_path / "list.json").write_text('["a JSON list"]')
    with pytest.raises(CheckpointError, match="list.json is a JSON file, not a checkpoint"):
        load_checkpoint(tmp_path / "list.json")


def test_averaging_refuses_other_architectures_and_keeps_the_newests_record(tmp_path):
    """Checkpoints whose weights differ in shape (another vocabulary) are not averaged; the
    average keeps the newest's config, position, corpus and tokenizers' fingerprints (what
    translate.py checks the tokenizer files with)."""
    from nmt.checkpoint import average_checkpoints
    paths = [tmp_path / f"tmodel_{e:02d}.pt" for e in range(3)]
    for e, path in enumerate(paths):
        save_checkpoint(small_state(vocab=(20, 31) if e == 2 else (20, 30), epoch=e,
                                    next_epoch=e + 1, corpus={"fingerprint": str(e)},
                                    tokenizers=[f"s{e}", f"t{e}"]), path)
    averaged = average_checkpoints(paths[:2])
    assert (averaged["epoch"], averaged["next_epoch"], averaged["corpus"],
            averaged["tokenizers"]) == (1, 2, {"fingerprint": "1"}, ["s1", "t1"])
    with pytest.raises(CheckpointError, match=r"cannot average .*tmodel_02\.pt with .*"
                                              r"tmodel_00\.pt: different architectures"):
        average_checkpoints(paths)
