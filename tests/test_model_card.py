"""nmt/model_card.py, in process, of cards built by hand: each figure of MODEL_CARD.md taken
from its own field (the design, the vocabularies, minutes, device and precision, the best
validation, the schedule and batches, the curve), and the card a run's objects make."""

import types

import torch

from config import Config
from nmt.model_card import card_text, design, plot_curve, write_run_card

HISTORY = [{"step": 10, "epoch": 0, "bleu": 5.0, "loss": 3.0},
           {"step": 20, "epoch": 1, "bleu": 7.0, "loss": 2.5},  # the best
           {"step": 30, "epoch": 2, "bleu": 6.0, "loss": 2.4}]


def card(config, **fields):
    return card_text({"config": config, "folder": "w", "vocab": (300, 500), "parameters": 1e5,
                      "commands": [], "corpus": "c", "sizes": "", "history": HISTORY,
                      "curve": False, "results": None, "samples": [], "steps": 30,
                      "epochs": 3, "seconds": 150.0, "precision": "bf16", "device": "cuda:0",
                      **fields})


def test_the_design_says_each_choice_of_the_architecture():
    assert design(Config()) == "pre-norm, LayerNorm, ReLU feed-forward, sinusoidal positions"
    modern = Config(norm_first=False, norm="rms", ffn="swiglu", pos="rope", h=4, n_kv_heads=2)
    assert design(modern) == ("post-norm (the paper's), RMSNorm, SwiGLU, rotary positions, "
                              "4 query heads sharing 2 key/value heads")
    assert "sharing" not in design(Config(h=4, n_kv_heads=4))  # as many: plain attention


def test_the_cards_figures_are_each_taken_from_their_own_field():
    config = Config(d_model=32, max_tokens=1234, batch_size=8)
    assert config.peak_lr() != config.lr  # (0: by width)
    text = card(config)
    assert "bpe vocabularies of 300 (en) and 500 (it)" in text
    assert "- 30 optimizer steps in 3 epoch(s), 2.5 minutes of training" in text
    assert "- device: cuda:0, precision bf16; torch" in text
    assert f"peak learning rate {config.peak_lr():.2g}, label smoothing" in text
    assert "batches of 1234 padded tokens" in text
    assert "batches of 8 sentences" in card(Config(max_tokens=0, batch_size=8))
    assert "- best validation: BLEU 7.00, loss 2.500 at step 20 (epoch 1)" in text
    assert "best validation" not in card(config, history=[])
    assert "--time_budget" not in text
    assert "![validation BLEU and loss](validation_curve.png)" in card(config, curve=True)
    assert "validation_curve.png" not in text


def test_a_budget_runs_card_says_what_set_its_steps():
    """Under --time_budget the card says what set the steps: the budget (its schedule
    complete), a --max_steps that cut it, or --patience, which stopped it before the end of
    its schedule (the budget did not buy those steps: the learning rate had not decayed). A run
    without a budget that --patience stopped before its epochs' schedule names no budget."""
    budget = Config(time_budget=3, patience=2)
    assert ("- --time_budget 3 minutes bought 30 optimizer steps (the schedule laid out for "
            "them by the speed the run measured); 2.6 minutes spent in all, set-up and test "
            "scoring included") in card(budget, schedule=30, setup=6.0)  # (150 s + 6 s)
    ended = card(budget, schedule=45)  # (the third validation: the second since the best)
    assert ("- --time_budget 3 minutes, ended by --patience 2: 30 optimizer steps of the 45 "
            "its schedule was laid out for") in ended and "bought" not in ended
    assert "bought" in card(Config(time_budget=3), schedule=45)  # (no --patience: no such end)
    assert "--time_budget" not in card(Config(patience=2), schedule=45)  # (no budget: epochs')
    assert "- --time_budget 3 minutes, cut at --max_steps 30: 30 optimizer steps" in card(
        Config(time_budget=3, max_steps=30, patience=2), schedule=30)


def test_the_curve_draws_bleu_on_the_left_and_loss_on_the_right(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # kept to be read
    assert plot_curve(HISTORY, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    bleu_axis, loss_axis = figures[0].axes
    monkeypatch.undo()
    plt.close(figures[0])
    assert list(bleu_axis.lines[0].get_xdata()) == [10, 20, 30]
    assert list(bleu_axis.lines[0].get_ydata()) == [5.0, 7.0, 6.0]
    assert list(loss_axis.lines[0].get_ydata()) == [3.0, 2.5, 2.4]
    assert bleu_axis.get_ylabel() == "validation BLEU (greedy)"
    assert loss_axis.get_ylabel() == "validation loss"
    assert bleu_axis.get_xlabel() == "optimizer step"
    assert not plot_curve([], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_a_runs_card_reads_its_time_epochs_and_data_from_the_run(tmp_path):
    """write_run_card of train.py's Run and Progress, built by hand: the minutes are the
    progress's own seconds, the epochs count the part of the last, a held-out validation split
    is said so."""
    tokenizer = types.SimpleNamespace(get_vocab_size=lambda: 300)
    data = types.SimpleNamespace(train=[0] * 40, validation=[0] * 4, held_out=True,
                                 test={"t": (["a"] * 3, ["b"] * 3)}, corpus={"source": "c"},
                                 tokenizer_src=tokenizer, tokenizer_tgt=tokenizer)
    config = Config(model_folder=str(tmp_path), time_budget=3, patience=2)
    run = types.SimpleNamespace(data=data, config=config, device=torch.device("cpu"),
                                model=torch.nn.Linear(2, 3), batches_per_epoch=10,
                                precision="bf16", steps=lambda: 40)  # (the schedule's length)
    progress = types.SimpleNamespace(commands=["python train.py"], step=25, epoch=2, batch=5,
                                     provenance=lambda: {"seconds": 90.0}, history=[])
    text = write_run_card(run, progress, None, []).read_text(encoding="utf-8")
    assert "- 25 optimizer steps in 2.5 epoch(s), 1.5 minutes of training" in text
    assert "25 optimizer steps of the 40 its schedule was laid out for" in text
    assert ("c: 40 training pairs, 4 validation pairs, 3 test pairs (t) (validation held out "
            "of the training split)") in text
    assert "- device: cpu, " in text and "precision bf16" in text
