"""nmt/translator.py: the Translator library class (loaded once, translating as translate.py's
command line does, with its one-line errors as config.UserError) and the checks it shares with
the command line."""

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
