"""nmt/translator.py: the Translator library class (loaded once, translating as translate.py's
command line does, with its one-line errors as config.UserError) and the checks it shares with
the command line; nmt/trained_model.py's loading of a model, or of several as an ensemble."""

import pytest
from conftest import run_here, tiny_model


def test_the_sentences_decoded_at_once_are_one_setting_everywhere():
    """The default of --batch_size (translate.py), of Translator.translate, of the decoders and of
    the CTranslate2 engine's is config.decode_batch_size's, one rule (greedy's batches larger
    than beam search's and sampling's): the API's and the decoders' defaults leave it to the
    rule, and --help names both sizes."""
    import argparse
    import inspect

    from config import DECODE_BATCH_SIZE, GREEDY_BATCH_SIZE, add_locating_arguments, \
        decode_batch_size
    from nmt import decoding
    from nmt.engine import Engine
    from nmt.translator import Translator, check_settings
    for function in (Translator.translate, check_settings, decoding.translate_ids,
                     Engine.translate_ids):
        assert inspect.signature(function).parameters["batch_size"].default is None
    assert GREEDY_BATCH_SIZE > DECODE_BATCH_SIZE
    assert decode_batch_size() == decode_batch_size(1, 1) == GREEDY_BATCH_SIZE
    assert decode_batch_size(4) == decode_batch_size(1, 2) == DECODE_BATCH_SIZE
    assert decode_batch_size(1, 1, sampling=object()) == DECODE_BATCH_SIZE
    parser = argparse.ArgumentParser()
    add_locating_arguments(parser)
    assert (f"sentences translated at once, with --sample N sentences times N (default: "
            f"{GREEDY_BATCH_SIZE} greedy, {DECODE_BATCH_SIZE} with beam search or sampling)") in \
        " ".join(parser.format_help().split())


def test_each_attention_view_is_checked_against_its_own_layers():
    """--attention_layer K is checked against the layers of the view asked for: a deep encoder
    (3 layers) with a shallow decoder (N_dec 1) takes encoder layer 3, and refuses decoder and
    cross-attention layer 2; the heads are each view's too."""
    from config import UserError
    from nmt.translator import check_attention
    model = tiny_model(N=3, N_dec=1)  # 4 heads
    for view, layers in (("encoder", 3), ("decoder", 1), ("cross", 1)):
        check_attention(model, view, layers, "4")
        check_attention(model, view, 0, "all")
        with pytest.raises(UserError, match=f"^--attention_layer {layers + 1}: the .* has "
                                            f"{layers} layers? \\(1 to {layers};"):
            check_attention(model, view, layers + 1, "mean")
        with pytest.raises(UserError, match="^--attention_head 5: .* has 4 heads"):
            check_attention(model, view, 1, "5")


def test_the_python_api_translates_as_the_command_line(trained, monkeypatch):
    """Issue 64: a folder loaded once from Python, three sentences translated in three lines
    of user code, equal to translate.py's output for the same flags (greedy, beam, n-best);
    a folder with no model raises the CLI's one line as config.UserError."""
    from config import UserError
    from nmt.checkpoint import CheckpointError
    from nmt.translator import Translator
    home, _ = trained
    monkeypatch.chdir(home)
    sentences = ["one two three", "four five", "six"]
    translator = Translator("weights", average=2)                      # the three lines
    beam = translator.translate(sentences, beam=3)                     # of a user's code
    cli = run_here("translate.py", "--model_folder", "weights", "--average", "2", "--beam", "3",
                   input="".join(s + "\n" for s in sentences).encode(), cwd=home)
    assert cli.returncode == 0 and beam == cli.stdout.decode().splitlines()
    greedy = run_here("translate.py", "--model_folder", "weights", "--preload", "best",
                      input="".join(s + "\n" for s in sentences).encode(), cwd=home)
    best = Translator("weights", preload="best")
    assert best.translate(sentences) == greedy.stdout.decode().splitlines()
    assert best.translate("one two three") == greedy.stdout.decode().splitlines()[0]
    nbest = best.translate(sentences, beam=3, nbest=2)
    listed = run_here("translate.py", "--model_folder", "weights", "--preload", "best",
                      "--beam", "3", "--nbest", "2",
                      input="".join(s + "\n" for s in sentences).encode(), cwd=home)
    assert [f"{n}\t{s:.4f}\t{t}" for n, hyps in enumerate(nbest) for t, s in hyps] == \
        listed.stdout.decode().splitlines()
    Translator(str(home / "weights" / "tmodel_00.pt"))  # a checkpoint file
    with pytest.raises(CheckpointError) as error:
        Translator("corpus")
    cli = run_here("translate.py", "--model_folder", "corpus", "hi", cwd=home)
    assert cli.stderr.decode().strip() == f"translate.py: error: {error.value}"
    with pytest.raises(UserError, match="--nbest 3 must be at most --beam 2"):
        best.translate(sentences, beam=2, nbest=3)


def test_the_python_api_keeps_the_command_lines_promises(trained, monkeypatch):
    """docs/translating.md (issue 70: untested): Translator takes the checkpoint choice
    (a file: that file, not its folder's newest; an epoch), the averaging, the device and the
    threads as the flags have them, and raises the command line's one-line errors (another
    tokenizer, a bad --beam); issue 70, 5: an empty sentence, average=0 and batch_size=0 are
    refused as translate.py refuses them (they returned '', named --batch_size, became 64)."""
    import shutil

    import torch

    from conftest import swap_two_tokens
    from config import UserError
    from nmt.checkpoint import average_checkpoints, load_checkpoint
    from nmt.translator import InputError, Translator
    home, _ = trained
    monkeypatch.chdir(home)
    weights = {name: load_checkpoint(home / "weights" / name)["model_state_dict"]
               for name in ("tmodel_00.pt", "tmodel_01.pt")}
    key = "projection_layer.proj.weight"
    assert not torch.equal(weights["tmodel_00.pt"][key], weights["tmodel_01.pt"][key])

    def weight(translator):
        return translator.model.state_dict()[key]
    assert torch.equal(weight(Translator("weights/tmodel_00.pt")), weights["tmodel_00.pt"][key])
    assert torch.equal(weight(Translator("weights", preload="0")), weights["tmodel_00.pt"][key])
    best = load_checkpoint(home / "weights" / "tmodel_best.pt")["model_state_dict"]
    assert torch.equal(weight(Translator("weights")), best[key])  # as translate.py: the best
    assert torch.equal(weight(Translator("weights", preload="latest")),
                       weights["tmodel_01.pt"][key])
    averaged = average_checkpoints([home / "weights" / n for n in weights])["model_state_dict"]
    torch.testing.assert_close(weight(Translator("weights", average=2)), averaged[key])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        one = Translator("weights", device="cpu", threads=2)
        assert torch.get_num_threads() == 2 and weight(one).device.type == "cpu"
    finally:
        torch.set_num_threads(threads)
    for kwargs, flags in (({"device": "cuda"}, ["--device", "cuda"]),
                          ({"average_saves": 2}, ["--average_saves", "2"]),  # (no --save_every)
                          ({"average": 2, "average_saves": 2},
                           ["--average", "2", "--average_saves", "2"]),
                          ({"average_saves": 0}, ["--average_saves", "0"]),
                          ({"average": 0}, ["--average", "0"])):
        if torch.cuda.is_available() and "device" in kwargs:
            continue
        with pytest.raises(UserError) as error:
            Translator("weights", **kwargs)
        cli = run_here("translate.py", "--model_folder", "weights", *flags, "hi", cwd=home)
        assert cli.returncode == 2 and str(error.value) in cli.stderr.decode(), kwargs
    assert str(error.value) == "--average must be positive (got 0)"
    for kwargs, flags, message in (
            ({"beam": 0}, ["--beam", "0"], "--beam must be positive (got 0)"),
            ({"batch_size": 0}, ["--batch_size", "0"], "--batch_size must be positive (got 0)")):
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            one.translate(["one two"], **kwargs)
        cli = run_here("translate.py", "--model_folder", "weights", *flags, "hi", cwd=home)
        assert cli.returncode == 2 and message in cli.stderr.decode(), cli.stderr.decode()
    with pytest.raises(InputError, match="^the sentence is empty$"):
        one.translate("  \t ")
    assert one.translate(["one", ""])[1] == run_here(  # an empty line of a list: as of a file
        "translate.py", "--model_folder", "weights", input=b"one\n\n", cwd=home
    ).stdout.decode().splitlines()[1]
    other = home / "other_tokenizer"
    shutil.copytree(home / "weights", other, ignore=shutil.ignore_patterns("*.pt", "prepared"))
    shutil.copy(home / "weights" / "tmodel_01.pt", other)
    swap_two_tokens(home / "weights" / "tokenizer_it.json", other / "tokenizer_it.json")
    with pytest.raises(UserError) as error:
        Translator(str(other))
    cli = run_here("translate.py", "--model_folder", str(other), "hi", cwd=home)
    assert cli.stderr.decode().strip().splitlines()[-1] == f"translate.py: error: {error.value}"
    shutil.rmtree(other)


def test_nbest_alone_searches_that_wide_and_the_defaults_are_translate_pys(trained, monkeypatch):
    """nbest alone (beam 1) searches with a beam of its width, as translate.py --nbest does (not
    refused, not a beam of 1); Translator's defaults are translate.py's flags': device auto,
    threads 0 (torch's threads left as they are), alpha config.LENGTH_PENALTY."""
    import inspect

    import torch

    from config import LENGTH_PENALTY, Config
    from nmt.translator import Translator
    home, _ = trained
    monkeypatch.chdir(home)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        translator = Translator("weights", preload="best")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    sentences = ["one two three", "four five"]
    assert translator.translate(sentences, nbest=2) == \
        translator.translate(sentences, beam=2, nbest=2)
    assert inspect.signature(Translator).parameters["device"].default == Config().device
    assert inspect.signature(Translator.translate).parameters["alpha"].default == LENGTH_PENALTY


# ---- nmt/trained_model.py ----------------------------------------------------------------------

def test_weights_that_do_not_fit_the_architecture_are_one_short_line():
    """A checkpoint whose weights do not fit the model its config rebuilds (another width, fewer
    or more layers) is one CheckpointError line naming the first misfit, cut short where torch
    lists every missing key, never torch's RuntimeError."""
    import dataclasses

    from config import Config
    from nmt.checkpoint import CheckpointError
    from nmt.trained_model import build_model, load_model_weights
    config = Config(d_model=16, N=2, h=2, d_ff=32, seq_len=16)
    model = build_model(config, 20, 20)
    for change, detail in (({"d_ff": 64}, "size mismatch for encoder.layers.0.feed_forward_block"),
                           ({"N": 1}, "Missing key(s) in state_dict: \"encoder.layers.1."),
                           ({"N": 3}, "Unexpected key(s) in state_dict: \"encoder.layers.2.")):
        other = build_model(dataclasses.replace(config, **change), 20, 20)
        with pytest.raises(CheckpointError) as error:
            load_model_weights(model, {"model_state_dict": other.state_dict()}, "w/tmodel_03.pt")
        message = str(error.value)
        assert message.startswith("checkpoint w/tmodel_03.pt does not fit this architecture: "
                                  + detail), message
        assert "\n" not in message and len(message) <= 370, message


def test_an_ensembles_models_translate_between_the_same_two_languages():
    """Issue 56, 2: members that share the source language but not the target (en->de beside
    en->it, one joint vocabulary) are refused as opposite directions are."""
    from config import Config
    from nmt.checkpoint import CheckpointError
    from nmt.trained_model import check_languages
    en_it, en_de = Config(lang_src="en", lang_tgt="it"), Config(lang_src="en", lang_tgt="de")
    check_languages("b", en_it, "a", Config(lang_src="en", lang_tgt="it"), "why")
    for other in (en_de, Config(lang_src="de", lang_tgt="it")):
        with pytest.raises(CheckpointError, match=f"^b translates {other.lang_src}->"
                                                  f"{other.lang_tgt}, a en->it: why$"):
            check_languages("b", other, "a", en_it, "why")


def test_an_ensembles_config_is_its_first_models_with_the_shortest_seq_len(tmp_path,
                                                                           monkeypatch):
    """load_ensemble: the config is its first model's (not the last loaded's) with the shortest
    seq_len of its models (none is given more positions than it has); the caller's config is
    left as it was."""
    import dataclasses

    import torch

    from config import Config
    from nmt import trained_model
    from tokenizer import build_tokenizer
    tok = build_tokenizer("word", 30, ["one two"] * 2)
    configs = {"a": Config(seq_len=32, d_model=16), "b": Config(seq_len=12, d_model=24),
               "c": Config(seq_len=20, d_model=8)}

    def load(config, given, checkpoint=None, average=1, saves=False):  # as each folder saved it
        saved = dataclasses.replace(configs[config.model_folder.rpartition("/")[2]])
        return torch.nn.Linear(1, 1), saved, tok, tok
    monkeypatch.setattr(trained_model, "load_translator", load)
    for name in configs:
        (tmp_path / name).mkdir()
    caller = Config()
    _, config, sources, _ = trained_model.load_ensemble(caller, set(),
                                                        [str(tmp_path / n) for n in "abc"])
    assert (config.d_model, config.seq_len) == (16, 12) and len(sources) == 3
    assert caller == Config()


def test_an_ensemble_finds_each_models_tokenizers_where_it_lies(trained, tmp_path, monkeypatch):
    """--ensemble A,B/tmodel_00.pt from a folder without the default --model_folder: a model
    folder's tokenizers are in it, a checkpoint file's beside it (the folder named first did not
    become the file's); the caller's set of flags given is left as it was."""
    import shutil

    from config import Config
    from nmt.trained_model import load_ensemble
    home, _ = trained
    for name in ("a", "b"):
        shutil.copytree(home / "weights", tmp_path / name)
    monkeypatch.chdir(tmp_path)
    given = set()
    ensemble, config, sources, target = load_ensemble(Config(), given, ["a", "b/tmodel_00.pt"])
    assert len(ensemble.members) == 2 and given == set()


def test_only_rank_0_says_which_checkpoint_it_loaded(trained, monkeypatch, capsys):
    """Under torchrun each process loads its model (distillation's teachers): rank 0 alone says
    so on stderr, not once per process."""
    from config import Config
    from nmt.trained_model import load_translator
    home, _ = trained
    monkeypatch.chdir(home)
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        load_translator(Config(), set())
        assert ("loaded weights/tmodel_best.pt" in capsys.readouterr().err) == said, rank


def test_translate_passes_its_beam_and_nbest_to_the_search(monkeypatch):
    """Translator.translate hands the search its beam as given (beam 3 is a beam search, not
    greedy), nbest alone with a beam of 1 (the search widens it), nbest 1 with sampling, and
    its stopping rule (early_stop, True by default)."""
    from config import Config
    from nmt import translator as module
    from nmt.decoding import Sampling
    seen = []

    def translate(model, config, tok_src, tok_tgt, texts, beam, alpha, nbest, batch_size,
                  sampling=None, numbers=None, early_stop=True):
        seen.append((beam, nbest, sampling, early_stop))
        return texts
    monkeypatch.setattr(module, "translate", translate)
    translator = module.Translator.of(None, Config(), None, None)
    draws = Sampling(n=2)
    for kw in ({"beam": 3}, {"nbest": 2}, {"beam": 4, "nbest": 2}, {"nbest": 2, "sampling": draws},
               {"beam": 2, "early_stop": False}):
        translator.translate(["a b"], **kw)
    assert seen == [(3, 1, None, True), (1, 2, None, True), (4, 2, None, True),
                    (1, 1, draws, True), (2, 1, None, False)]
