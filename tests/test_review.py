"""Regression tests for the defects a review found (issue 9), each reproduced first."""

import re
import types

import pytest
import torch
from conftest import ROOT, number_pairs, write_aligned

from checkpoint import (CheckpointError, check_split, load_averaged, resume_state,
                        rng_states, save_checkpoint, set_rng_states)
from config import Config
from dataset import (EOS, PAD, SOS, UNK, DataError, build_tokenizer, detokenize, get_tokenizer,
                     load_corpus)
from model import build_transformer, translate_ids
from runtime import autocast_dtype
from train import Run, learning_rate, warmup_steps
from translate import clean


def test_auto_precision_uses_fp16_on_gpus_that_only_emulate_bf16(monkeypatch):
    """1. T4 / V100 (compute capability 7.x): is_bf16_supported() says yes (emulation)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True:
                        including_emulation)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda")
    for capability, expected in (((7, 5), torch.float16), ((7, 0), torch.float16),
                                 ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert autocast_dtype(Config(precision="auto"), cuda) == expected, capability
    assert autocast_dtype(Config(precision="auto"), torch.device("cpu")) is None


def test_requirements_ask_for_the_versions_whose_apis_the_code_uses():
    """2. torch.amp.GradScaler needs torch 2.3; datasets.config.HF_HUB_OFFLINE datasets 2.21;
    Tokenizer.encode_special_tokens tokenizers 0.15.1 (each checked on the older release)."""
    needed = {"torch": (2, 3), "datasets": (2, 21), "tokenizers": (0, 15, 1)}
    text = (ROOT / "requirements.txt").read_text()
    for name, version in needed.items():
        found = re.search(rf"^{name}>=([\d.]+)$", text, re.M)
        assert found, name
        assert tuple(int(x) for x in found.group(1).split(".")) >= version, name


def state_at(epoch, step=None, **extra):
    model = build_transformer(20, 20, 16, 16, d_model=8, N=1, h=2, d_ff=16)
    return {"model_state_dict": model.state_dict(), "config": Config().to_dict(),
            "epoch": epoch, "global_step": step or epoch * 10 + 10,
            "next_epoch": epoch if step else epoch + 1, "next_batch": 3 if step else 0,
            **extra}


def test_averaging_uses_per_epoch_checkpoints_only(tmp_path):
    """--average N from a mid-epoch latest: the last N per-epoch files, never a mid-epoch one."""
    config = Config(model_folder=str(tmp_path))
    for name, state in (("tmodel_00.pt", state_at(0)), ("tmodel_01.pt", state_at(1)),
                        ("tmodel_02_s0000025.pt", state_at(2, step=25))):
        save_checkpoint(state, tmp_path / name)
    _, paths = load_averaged(config, tmp_path / "tmodel_02_s0000025.pt", 2)
    assert [p.name for p in paths] == ["tmodel_00.pt", "tmodel_01.pt"]
    _, paths = load_averaged(config, tmp_path / "tmodel_00.pt", 1)
    assert [p.name for p in paths] == ["tmodel_00.pt"]
    with pytest.raises(CheckpointError, match="only 1 per-epoch"):
        load_averaged(config, tmp_path / "tmodel_00.pt", 2)


def test_the_cuda_random_state_is_saved_and_restored(monkeypatch):
    """4. On CUDA the device's own generator (dropout) is part of the saved state."""
    saved = torch.tensor([7, 8, 9], dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device=None: restored.append(state))
    states = rng_states(torch.device("cuda"))
    assert torch.equal(states["cuda_rng_state"], saved) and "rng_state" in states
    set_rng_states(states, torch.device("cuda"))
    assert restored and torch.equal(restored[0], saved)
    assert "cuda_rng_state" not in rng_states(torch.device("cpu"))


def test_resume_never_takes_where_the_run_works_from_the_checkpoint(tmp_path):
    """5. A run saved on cuda:3, with workers and its own log folder, resumes here."""
    saved = Config(model_folder=str(tmp_path), device="cuda:3", num_workers=8,
                   experiment_name="runs/elsewhere", lr=5e-4)
    state = {**state_at(0), "config": saved.to_dict()}
    save_checkpoint(state, tmp_path / "tmodel_00.pt")
    (_, _), config = resume_state(Config(model_folder=str(tmp_path)), set())
    assert (config.device, config.num_workers, config.experiment_name) == ("auto", 0,
                                                                           "runs/tmodel")
    assert config.lr == 5e-4  # a training setting still comes from the checkpoint


def test_resuming_with_another_seed_cannot_redraw_a_held_out_validation_split(tmp_path):
    """6. Without a validation split, --seed and --val_fraction choose the validation pairs."""
    write_aligned(tmp_path / "c", "train", number_pairs(50, seed=1))
    config = Config(data_dir=str(tmp_path / "c"), model_folder=str(tmp_path / "w"))
    assert load_corpus(config)["held_out"] is True
    state = {"config": config.to_dict()}
    for change in ({"seed": 7}, {"val_fraction": 0.2}):
        other = Config(**{**config.to_dict(), **change})
        with pytest.raises(CheckpointError, match=f"--{next(iter(change))} "):
            check_split(state, "tmodel_00.pt", other, held_out=True)
        check_split(state, "tmodel_00.pt", other, held_out=False)  # its own split: harmless
    check_split(state, "tmodel_00.pt", config, held_out=True)


def test_the_run_length_counts_max_steps_and_a_given_warmup_is_used_as_given():
    """7. The run length includes --max_steps. Issue 18: only the default warm-up is capped
    at a tenth of the run; a --warmup the user gives is used as given."""
    run = types.SimpleNamespace(batches_per_epoch=100, config=Config(num_epochs=10,
                                                                     accum_steps=1))
    assert Run.total_steps.fget(run) == 1000
    run.config.max_steps = 300
    assert Run.total_steps.fget(run) == 300
    assert warmup_steps(Config(), 500) == 50 and warmup_steps(Config(), 10 ** 6) == 4000
    assert warmup_steps(Config(warmup=2000), 6000) == 2000
    assert learning_rate(Config(lr_schedule="inverse_sqrt", lr=1e-3), 50, 500) == \
        pytest.approx(1e-3)
    assert learning_rate(Config(lr_schedule="inverse_sqrt", lr=1e-3, warmup=2000), 600, 6000) \
        == pytest.approx(0.3e-3)


def test_inference_input_keeps_text_characters():
    """8. Zero-width (non-)joiners, no-break and thin spaces, soft hyphens are text."""
    text = "l\u2019\u00e9t\u00e9\u00a0: \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 " \
           "\U0001F469\u200d\U0001F4BB co\u00adoperate\u2009!"
    assert clean(text) == text
    assert clean(" a\tb\x07c\r\n") == "a b c"


def test_special_token_strings_in_text_are_text(tmp_path):
    """9. "[EOS]" written in a sentence is not the end-of-sentence token."""
    pairs = number_pairs(30)
    for kind in ("bpe", "word"):
        config = Config(model_folder=str(tmp_path / kind), tokenizer_type=kind, vocab_size=300)
        get_tokenizer(config, "en", [s for s, _ in pairs] + ["[EOS] [PAD] [SOS] [UNK] one"] * 2)
        tok = get_tokenizer(config, "en", [])  # loaded from the file
        ids = tok.encode("one [EOS] two [PAD] [SOS]").ids
        assert not {PAD, SOS, EOS} & set(ids), (kind, ids)


def test_word_level_detokenizes_and_shows_unknown_words():
    """10. Word level: "doesn't" comes back as "doesn't", and unknown words are visible."""
    texts = ["He doesn't know (really).", "She doesn't know it, really!"] * 3
    tok = build_tokenizer("word", 100, texts)
    ids = tok.encode("She doesn't know (really).").ids
    assert detokenize(tok, ids) == "She doesn't know (really)."
    ids = tok.encode("He doesn't fly.").ids
    assert UNK in ids and detokenize(tok, ids) == "He doesn't [UNK]."


def test_tokenizer_files_of_another_recipe_are_refused(tmp_path):
    """11. A model folder's tokenizers are reused only for the same type, size and language."""
    texts = [s for s, _ in number_pairs(40)]
    config = Config(model_folder=str(tmp_path), vocab_size=300)
    get_tokenizer(config, "en", texts)
    with pytest.raises(DataError, match="was trained with --vocab_size 300, not 500"):
        get_tokenizer(Config(model_folder=str(tmp_path), vocab_size=500), "en", texts)
    renamed = Config(model_folder=str(tmp_path), vocab_size=300,
                     tokenizer_file=str(tmp_path / "tokenizer_en.json").replace("_en", "_{0}"))
    (tmp_path / "tokenizer_en.json").rename(tmp_path / "tokenizer_fr.json")
    (tmp_path / "tokenizer_en.meta.json").rename(tmp_path / "tokenizer_fr.meta.json")
    with pytest.raises(DataError, match="was trained with --lang_src/--lang_tgt en, not fr"):
        get_tokenizer(renamed, "fr", texts)


def test_decoders_never_emit_pad_sos_or_unk():
    """12. Even a model that prefers them."""
    torch.manual_seed(0)
    model = build_transformer(20, 20, 32, 32, d_model=16, N=1, h=2, d_ff=32).eval()
    with torch.no_grad():
        model.projection_layer.proj.bias[[PAD, SOS, UNK]] = 100.0  # always the top logits
        model.projection_layer.proj.bias[EOS] = -100.0
    sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for beam in (1, 3):
        outputs = translate_ids(model, sources, SOS, EOS, PAD, 32, beam=beam, max_len_a=1,
                                max_len_b=5, unk_id=UNK)
        assert all(out and not {PAD, SOS, UNK} & set(out) for out in outputs), (beam, outputs)
    emitted = translate_ids(model, sources, SOS, EOS, PAD, 32, max_len_a=1,
                            max_len_b=5)  # no unk_id
    assert all(set(out) == {UNK} for out in emitted)  # the bias works: UNK unless banned
