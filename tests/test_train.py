"""Training pieces in-process: the command line, schedules, accumulation, metrics, checkpoints."""

import math
import pickle

import pytest
import torch

from checkpoint import (CheckpointError, check_vocab, latest_checkpoint_path, load_checkpoint,
                        save_checkpoint)
from config import Config
from config import parse_config as parse_config_and_given
from dataset import BilingualDataset, Collator
from model import build_transformer
from train import learning_rate, train_step
from translate import edit_distance, error_rate


def parse_config(argv):
    return parse_config_and_given(argv)[0]


def test_every_config_field_is_a_flag_and_batch_size_alone_means_sentence_batches():
    config = parse_config(["--d_model", "256", "--h", "4", "--tie_embeddings", "decoder",
                           "--lr_schedule", "inverse_sqrt"])
    assert (config.d_model, config.h, config.tie_embeddings) == (256, 4, "decoder")
    assert config.lr_schedule == "inverse_sqrt" and config.max_tokens == 4096
    assert parse_config(["--batch_size", "32"]).max_tokens == 0
    both = parse_config(["--batch_size", "32", "--max_tokens", "2000"])
    assert (both.batch_size, both.max_tokens) == (32, 2000)


@pytest.mark.parametrize("argv, message", [
    (["--d_model", "100", "--h", "3"], "--d_model (100) must be divisible by --h (3)"),
    (["--N", "-2"], "--N must be positive"),
    (["--lang_src", "de", "--lang_tgt", "de"], "two different languages"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--d_model", "big"], "invalid int value: 'big'"),
    (["--lr_schedule", "linear"], "invalid choice: 'linear'"),
    (["--preload", "yesterday"], "--preload must be latest, none or an epoch number"),
    (["--device", "gpu"], "--device must be auto, cpu, cuda, cuda:N or mps"),
])
def test_bad_flags_are_refused_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_a_missing_accelerator_is_a_clear_error():
    from config import UserError
    from runtime import get_device
    with pytest.raises(UserError, match="--device cuda: CUDA is not available"):
        get_device("cuda")
    assert get_device("cpu").type == "cpu"


def test_inverse_sqrt_schedule_matches_the_paper_formula():
    paper_lr = (512 * 4000) ** -0.5  # --lr for the paper's exact values
    config = Config(lr_schedule="inverse_sqrt", d_model=512, warmup=4000, lr=paper_lr)
    for step in (1, 100, 3999, 4000, 4001, 20000, 100000):
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert learning_rate(config, step, 0) == pytest.approx(expected, rel=1e-9)
    assert learning_rate(config, 4000, 0) == pytest.approx(7.0e-4, rel=0.01)
    config.lr = 1e-3  # --lr sets the peak
    assert learning_rate(config, 4000, 0) == pytest.approx(1e-3)
    assert learning_rate(config, 16000, 0) == pytest.approx(0.5e-3)


def test_cosine_and_constant_schedules():
    config = Config(lr_schedule="cosine", lr=1e-3, warmup=10)
    assert learning_rate(config, 5, 109) == pytest.approx(0.5e-3)
    assert learning_rate(config, 10, 109) == pytest.approx(1e-3)
    assert learning_rate(config, 60, 109) == pytest.approx(0.5e-3)
    # the cosine reaches 0 one step after the run: its last step still learns
    assert 0 < learning_rate(config, 109, 109) < 1e-6
    assert learning_rate(config, 110, 109) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(Config(lr=3e-4, lr_schedule="constant"), 12345, 0) == 3e-4


def test_accumulating_k_batches_gives_the_gradients_of_one_k_times_batch():
    torch.manual_seed(0)
    src = [torch.randint(4, 30, (n,)).tolist() for n in (3, 7, 2, 5, 6, 4)]
    tgt = [torch.randint(4, 30, (n,)).tolist() for n in (4, 2, 6, 3, 5, 7)]
    ds = BilingualDataset(src, tgt, [""] * 6, [""] * 6)
    collate = Collator(pad_id=1)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=1, label_smoothing=0.1, reduction="sum")

    def grads(groups):
        torch.manual_seed(1)
        model = build_transformer(30, 30, 32, 32, d_model=16, N=1, h=2, d_ff=32, dropout=0.0)
        losses = [float(train_step(model, g, loss_fn, 1, "cpu")[0]) for g in groups]
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}

    # three micro-batches of different sizes and paddings, accumulated in one step ...
    micro = [collate([ds[0], ds[1]]), collate([ds[2]]), collate([ds[3], ds[4], ds[5]])]
    (loss_k,), grads_k = grads([micro])
    # ... equal one batch of all six
    (loss_1,), grads_1 = grads([[collate([ds[i] for i in range(6)])]])
    assert loss_k == pytest.approx(loss_1, rel=1e-5)
    for name in grads_1:
        torch.testing.assert_close(grads_k[name], grads_1[name], atol=1e-6, rtol=1e-4)


def test_bf16_autocast_step_matches_fp32_closely():
    from contextlib import nullcontext
    torch.manual_seed(0)
    ds = BilingualDataset([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], ["", ""], ["", ""])
    batch = Collator(pad_id=1)([ds[0], ds[1]])
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=1, reduction="sum")
    losses = []
    for amp in (nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        torch.manual_seed(1)
        model = build_transformer(30, 30, 16, 16, d_model=16, N=1, h=2, d_ff=32, dropout=0.0)
        losses.append(float(train_step(model, [batch], loss_fn, 1, "cpu", amp)[0]))
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


def test_edit_distance_cer_and_wer():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance([], ["a"]) == 1
    assert error_rate(["a b c"], ["a x c"], words=True) == pytest.approx(1 / 3)
    assert error_rate(["abcd", "xy"], ["abcd", "xz"], words=False) == pytest.approx(1 / 6)


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


class Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_checkpoint_holding_a_pickled_object_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save(small_state(extra=Exploit()), path)
    with pytest.raises(CheckpointError, match=r"evil.pt refused: it holds more than tensors"):
        load_checkpoint(path)
    assert "this must never run" not in capsys.readouterr().out
    path2 = tmp_path / "pickle.pt"
    path2.write_bytes(pickle.dumps({"model_state_dict": Exploit()}))
    with pytest.raises(CheckpointError, match="pickle.pt"):
        load_checkpoint(path2)


def test_truncated_corrupt_foreign_and_mismatched_checkpoints_are_refused(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(small_state(), good)
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="truncated.pt is truncated or corrupt"):
        load_checkpoint(tmp_path / "truncated.pt")
    with pytest.raises(CheckpointError, match="garbage.pt is truncated or corrupt"):
        load_checkpoint(tmp_path / "garbage.pt")
    with pytest.raises(CheckpointError, match="foreign.pt is not a checkpoint of this project"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="missing.pt not found"):
        load_checkpoint(tmp_path / "missing.pt")
    state = load_checkpoint(good)
    check_vocab(state, good, 20, 30)
    with pytest.raises(CheckpointError, match="target vocabulary of 30 but the tokenizer file "
                                              "has 31"):
        check_vocab(state, good, 20, 31)


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


def test_the_readme_documents_every_flag_with_its_default():
    import dataclasses

    from conftest import ROOT
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for f in dataclasses.fields(Config):
        default = '""' if f.default == "" else f.default
        assert f"| `--{f.name}` | `{default}` |" in readme, f.name


def test_ci_runs_the_readme_test_command():
    from conftest import ROOT
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text()
    command = "pip install -r requirements-dev.txt && python -m pytest -q"
    assert f"```bash\n{command}\n```" in readme
    assert f"\n{command}\n" in ci
