"""Issue 17: every design exports to CTranslate2 and decodes there as it does here."""

import pytest
import torch
from conftest import make_corpus, run_here

from config import Config
from dataset import get_ds
from nmt.decoding import translate_ids
from nmt.engine import ExportError, export, load_engine  # noqa: E402
from nmt.trained_model import build_model
from tokenizer import EOS, PAD, SOS, UNK

ctranslate2 = pytest.importorskip("ctranslate2")


DESIGNS = {
    "default": {},
    "post-norm": {"norm_first": False},
    "paper": {"norm_first": False, "shared_vocab": True, "tie_embeddings": "all"},
    "modern": {"norm": "rms", "ffn": "swiglu", "pos": "rope", "n_kv_heads": 2,
               "tie_embeddings": "decoder"},
    "rope, multi-query": {"pos": "rope", "n_kv_heads": 1},
    "rms post-norm, swiglu, joint": {"norm": "rms", "norm_first": False, "ffn": "swiglu",
                                     "shared_vocab": True},
    "deep encoder, shallow decoder": {"N_dec": 1},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    make_corpus(folder / "c", n=80, seed=1, val=12)
    return folder


def random_model(config):
    """A model with random weights, its norms' gains and biases random too (so that a norm
    exported in the wrong place changes the outputs)."""
    data = get_ds(config)
    torch.manual_seed(0)
    model = build_model(config, data.tokenizer_src.get_vocab_size(),
                        data.tokenizer_tgt.get_vocab_size()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.5)
    sources = [[int(i) for i in data.train.src_ids[n]] for n in range(40)]
    return model, data, sources


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_every_design_decodes_on_the_engine_as_here(corpus, design, capsys):
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / design),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300,
                    **DESIGNS[design])
    model, data, sources = random_model(config)
    export(model, config, data.tokenizer_src, data.tokenizer_tgt, corpus / f"{design}.ct2")
    engine, loaded, _, _ = load_engine(corpus / f"{design}.ct2", Config())
    assert loaded.to_dict() == {**config.to_dict(), "model_folder": str(corpus / f"{design}.ct2"),
                                "tokenizer_file": "tokenizer_{0}.json"}
    for limits in ({}, {"max_len_a": 0.5, "max_len_b": 2}, {"min_len": 3}):
        ours = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK, **limits)
        theirs = engine.translate_ids(sources, SOS, EOS, PAD, 40, unk_id=UNK, **limits)
        assert theirs == ours, limits
    with pytest.raises(ValueError, match="min_len 39 is more than a translation can hold"):
        engine.translate_ids(sources, SOS, EOS, PAD, 40, min_len=39)  # (as model.py's searches)


def test_quantized_exports_and_refusals(corpus, tmp_path, monkeypatch):
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / "default"),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300)
    model, data, sources = random_model(config)
    ours = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK)
    for quantization in ("float32", "int8"):
        export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / quantization,
               quantization)
    engines = {q: load_engine(tmp_path / q, Config())[0] for q in ("float32", "int8")}
    theirs = engines["int8"].translate_ids(sources, SOS, EOS, PAD, 40, unk_id=UNK)
    assert len(theirs) == len(ours) and all(theirs)  # it loads and translates
    # nbest alone searches with a beam of that width, as this repo's translate_ids does
    alone, wide = (engines["float32"].translate_ids(sources[:6], SOS, EOS, PAD, 40, beam=b,
                                                    nbest=3) for b in (1, 3))
    assert alone == wide and all(len(hyps) == 3 for hyps in alone)
    # A random model's next-token distribution is nearly flat, so int8's rounding may change
    # any argmax (it does on CPUs without AVX-512): compare the log-probabilities the two give
    # our outputs instead, token by token.
    src = [[data.tokenizer_src.id_to_token(i) for i in s] for s in sources]
    tgt = [[data.tokenizer_tgt.id_to_token(i) for i in o] for o in ours]
    exact, rounded = (torch.tensor([p for r in engines[q].translator.score_batch(src, tgt)
                                    for p in r.log_probs]) for q in ("float32", "int8"))
    assert (exact - rounded).abs().mean() < 0.3, (exact - rounded).abs().mean()
    with pytest.raises(ExportError, match="already exists and is not an empty folder"):
        export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "int8")
    monkeypatch.setitem(__import__("sys").modules, "ctranslate2", None)  # not installed
    with pytest.raises(ExportError, match="pip install 'ctranslate2>=4.7'"):
        export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "other")


def test_exporting_leaves_the_model_untouched(corpus, tmp_path):
    """The engine quantizes the arrays it is given in place: they must be copies, or an int8
    export corrupts the model it was made from."""
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / "default"),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300)
    model, data, _ = random_model(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for quantization in ("float32", "int8"):
        export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / quantization,
               quantization)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_engine_decodes_batches_at_once_as_one_after_the_other(corpus, tmp_path):
    """Engine(at_once=2): two replicas of the model (the engine's inter_threads), each call
    queued while the one before it decodes, at most two calls ahead of the one read; the same
    outputs, in the same places, as one call after the other (greedy: a call a batch; beam
    search: a call an output-length limit)."""
    from types import SimpleNamespace

    from nmt.engine import Engine
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / "default"),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300)
    model, data, sources = random_model(config)
    export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "ct2")

    class Window:  # the calls made, and how many were made when each call's results are read
        def __init__(self, translator):
            self.translator, self.made, self.read = translator, 0, []

        def translate_batch(self, batch, **options):
            call, self.made = self.made, self.made + 1
            results = self.translator.translate_batch(batch, **options)
            return [SimpleNamespace(result=lambda r=r, c=call: self.read.append(
                (c, self.made)) or r.result()) for r in results]
    ours = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK, batch_size=8)
    outputs = {}
    for at_once in (1, 2):
        engine = Engine(tmp_path / "ct2", data.tokenizer_src, data.tokenizer_tgt, "cpu", 1,
                        at_once)
        assert engine.translator.num_translators == at_once
        for beam in (1, 2):
            engine.translator = window = Window(engine.translator)
            outputs[at_once, beam] = engine.translate_ids(sources, SOS, EOS, PAD, 40, beam=beam,
                                                          batch_size=8, unk_id=UNK)
            calls = window.made
            assert calls >= 3 and {c for c, _ in window.read} == set(range(calls))
            assert all(made == min(c + at_once, calls) for c, made in window.read), window.read
            engine.translator = window.translator
    assert outputs[1, 1] == outputs[2, 1] == ours
    assert outputs[1, 2] == outputs[2, 2]


def test_the_engine_takes_each_searchs_default_batch():
    """Without batch_size, the engine's calls get config.decode_batch_size's batches (greedy's,
    beam search's) as their max_batch_size, as this repo's decoders take them; a given
    batch_size wins. (The engine's translator is a stand-in that records its calls.)"""
    from types import SimpleNamespace

    from config import DECODE_BATCH_SIZE, GREEDY_BATCH_SIZE
    from nmt.engine import Engine
    sizes = []

    def translate_batch(batch, max_batch_size, **options):
        sizes.append(max_batch_size)
        done = SimpleNamespace(hypotheses=[["w"]], scores=[0.0])
        return [SimpleNamespace(result=lambda: done) for _ in batch]
    engine = Engine.__new__(Engine)  # no model loaded
    engine.tokens, engine.ids, engine.at_once = ["w"] * 8, {"w": 5}, 1
    engine.translator = SimpleNamespace(translate_batch=translate_batch)
    for options, size in (({}, GREEDY_BATCH_SIZE), ({"beam": 2}, DECODE_BATCH_SIZE),
                          ({"nbest": 2}, DECODE_BATCH_SIZE),
                          ({"batch_size": 3}, 3), ({"beam": 2, "batch_size": 3}, 3)):
        sizes.clear()
        out = engine.translate_ids([[5, 6], [7]], SOS, EOS, PAD, 40, **options)
        assert len(out) == 2 and set(sizes) == {size}, (options, sizes)


def test_the_engine_refuses_fairseqs_stop():
    """The engine's beam search stops as early_stop=True does (its default); early_stop=False
    (fairseq's rule, which it has not) is a user's error before any call, not a search by
    another rule than the one asked for (nbest alone is a search too); greedy decoding, with no
    stop to choose, takes either."""
    from types import SimpleNamespace

    from config import UserError
    from nmt.engine import Engine
    calls = []

    def translate_batch(batch, **options):
        calls.append(options["beam_size"])
        done = SimpleNamespace(hypotheses=[["w"]], scores=[0.0])
        return [SimpleNamespace(result=lambda: done) for _ in batch]
    engine = Engine.__new__(Engine)  # no model loaded
    engine.tokens, engine.ids, engine.at_once = ["w"] * 8, {"w": 5}, 1
    engine.translator = SimpleNamespace(translate_batch=translate_batch)
    with pytest.raises(UserError, match="^--early_stop false: CTranslate2 searches by its own "
                                        r"rule \(a sentence ends once its best hypothesis ends\)$"):
        engine.translate_ids([[5, 6]], SOS, EOS, PAD, 40, beam=2, early_stop=False)
    with pytest.raises(UserError, match="^--early_stop false"):
        engine.translate_ids([[5, 6]], SOS, EOS, PAD, 40, nbest=2, early_stop=False)
    assert calls == []
    for options in ({"beam": 2}, {"beam": 2, "early_stop": True}, {"early_stop": False}):
        assert engine.translate_ids([[5, 6]], SOS, EOS, PAD, 40, **options) == [[5]]
    assert calls == [2, 2, 1]


def test_export_then_translate_a_file_on_the_engine(trained, tmp_path, capsys):
    """Issue 17: train, export, translate with CTranslate2 as the README says."""
    pytest.importorskip("ctranslate2")
    home, _ = trained
    t = run_here("export.py", "--output", tmp_path / "ct2", "--preload", "01", cwd=home)
    assert t.returncode == 0 and "translate.py --ctranslate2" in t.stderr.decode(), \
        t.stderr.decode()
    files = ["corpus/val.en", "--reference", "corpus/val.it"]
    ours = run_here("translate.py", "--preload", "01", "--input", *files, cwd=home)
    theirs = run_here("translate.py", "--ctranslate2", tmp_path / "ct2", "--threads", "1",
                      "--input", *files, cwd=home)
    assert theirs.returncode == 0, theirs.stderr.decode()
    # one line each (split on newlines only: a byte-level token may decode to \x85 or \u2028)
    a, b = ours.stdout.decode().split("\n"), theirs.stdout.decode().split("\n")
    assert len(a) == len(b) == 9 and sum(x == y for x, y in zip(a, b)) >= 8, (a, b)
    assert "BLEU = " in theirs.stderr.decode() and "tmodel_01.pt" in theirs.stderr.decode()
    t = run_here("translate.py", "--ctranslate2", tmp_path / "ct2", "--beam", "3",
                 "--nbest", "2", "one two.", cwd=home)
    assert t.returncode == 0 and [line.split("\t")[0] for line in
                                  t.stdout.decode().splitlines()] == ["0", "0"]

    import export
    import translate
    from nmt.cli import run_main
    for script, args, message in (
            (translate, ["--ctranslate2", str(tmp_path / "ct2"), "--checkpoint", "x.pt", "hi"],
             "not with --checkpoint"),
            (translate, ["--ctranslate2", str(tmp_path / "ct2"), "--device", "mps", "hi"],
             "CTranslate2 runs on cpu or cuda"),
            (export, ["--model_folder", str(home / "weights"), "--output", str(tmp_path / "ct2")],
             "already exists")):
        with pytest.raises(SystemExit) as e:
            run_main(script.__name__, lambda s=script, a=args: s.main(a))
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    # the engine's beam search stops as --early_stop true: false is refused (as the flags are
    # read; the engine's own refusal: test_the_engine_refuses_fairseqs_stop)
    t = run_here("translate.py", "--ctranslate2", tmp_path / "ct2", "--beam", "2",
                 "--early_stop", "false", "one two.", cwd=home)
    assert t.returncode == 2 and t.stderr.decode() == (  # (before the engine loads)
        "translate.py: error: --early_stop false: CTranslate2 searches by its own rule (a "
        "sentence ends once its best hypothesis ends) (see --help)\n"), t.stderr.decode()
    assert run_here("translate.py", "--ctranslate2", tmp_path / "ct2", "--beam", "2",
                    "--early_stop", "true", "one two.", cwd=home).returncode == 0


@pytest.mark.parametrize("flags, message", [
    (["--preload", "lates"], "--preload must be best, latest or an epoch number, got 'lates' "
                             "(see --help)"),
    (["--preload", "3.5"], "--preload must be best, latest or an epoch number, got '3.5' (see "
                           "--help)"),
    (["--preload", "none"], "--preload none loads no checkpoint, and a trained model comes from "
                            "one: leave --preload out, or give best, latest or an epoch number"),
    # what the export would not use (it decodes nothing; the file is named): refused
    (["--batch_size", "16"], "--batch_size is the translating command's: give it to translate.py "
                             "--ctranslate2 "),
    (["--threads", "2"], "--threads is the translating command's"),
    (["--threads", "0"], "--threads is the translating command's"),
    (["--checkpoint", "weights/tmodel_00.pt", "--preload", "best"], "--checkpoint names its "
     "file: not with --preload, which picks one in --model_folder (see --help)"),
    # the saves --save_every wrote, which a run without it has not (the averaging reaches it)
    (["--average_saves", "2"], "--average_saves: weights/tmodel_01.pt comes from a run trained "
     "without --save_every")])
def test_export_refuses_a_preload_that_names_no_checkpoint(trained, tmp_path, flags, message):
    """--preload lates or 3.5 ended in int()'s traceback; none, in "no checkpoint in" a folder
    of checkpoints; --batch_size and --threads were written into export.json and never read,
    --preload beside --checkpoint ignored."""
    home, _ = trained
    t = run_here("export.py", "--output", tmp_path / "ct2", *flags, cwd=home)
    assert t.returncode == 2 and t.stderr.decode().startswith(f"export.py: error: {message}")
    assert t.stderr.decode().count("\n") == 1 and not (tmp_path / "ct2").exists()


def test_export_average_exports_the_averaged_weights(trained, tmp_path, monkeypatch):
    """Issue 56 (an untested promise): `export.py --average 2` writes the mean of the last two
    epochs' weights, as translate.py --average 2 decodes with them: export.json names both
    checkpoints, and the engine's greedy outputs are this repo's with the same average."""
    import json

    import export as export_script
    from nmt.checkpoint import average_checkpoints, load_checkpoint
    home, _ = trained
    exported = {}
    real = export_script.export

    def capturing(model, *args, **kwargs):  # the weights export.py hands to the engine
        exported.update({k: v.clone() for k, v in model.state_dict().items()})
        return real(model, *args, **kwargs)
    monkeypatch.setattr(export_script, "export", capturing)
    t = run_here("export.py", "--output", tmp_path / "avg", "--average", "2", cwd=home)
    assert t.returncode == 0, t.stderr.decode()
    # issue 63, 14: the exported weights are the mean of the two epochs', not the last one's
    weights = home / "weights"
    mean = average_checkpoints([weights / "tmodel_00.pt", weights / "tmodel_01.pt"])
    last = load_checkpoint(weights / "tmodel_01.pt")["model_state_dict"]
    for k, v in mean["model_state_dict"].items():
        torch.testing.assert_close(exported[k], v.float(), msg=k)
    key = "projection_layer.proj.weight"
    assert not torch.allclose(exported[key], last[key].float())
    note = json.loads((tmp_path / "avg" / "export.json").read_text())
    assert "tmodel_00.pt" in note["source"] and "tmodel_01.pt" in note["source"]
    # the corpus the weights were trained on, which translate.py --example checks its own by
    from translate import trained_on
    corpus = load_checkpoint(weights / "tmodel_01.pt")["corpus"]
    assert note["corpus"] == corpus and corpus["validation"]
    assert trained_on(load_engine(tmp_path / "avg", Config(), threads=1)[0]) == corpus
    files = ["--input", "corpus/val.en"]
    ours = run_here("translate.py", "--average", "2", *files, cwd=home).stdout.decode()
    theirs = run_here("translate.py", "--ctranslate2", tmp_path / "avg", "--threads", "1",
                      *files, cwd=home).stdout.decode()
    a, b = ours.splitlines(), theirs.splitlines()
    assert len(a) == 8 and a == b, (a, b)  # the engine decodes the averaged model as we do


def test_the_engine_never_generates_what_decoding_here_never_does_and_cuts_long_sources(
        corpus, tmp_path):
    """The engine is told to ban [PAD] and [SOS] (suppress_sequences) and, with unk_id, [UNK]
    (disable_unk), and sources go to it cut to seq_len - 2 tokens, as translate_ids does. A
    random model never favours those tokens nor meets a long source, so losing either went
    unseen: here the projection's bias makes [UNK], [PAD] and [SOS] the likeliest tokens at
    every step, and one source is longer than seq_len allows."""
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / "default"),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300)
    model, data, sources = random_model(config)
    with torch.no_grad():
        model.projection_layer.proj.bias[[UNK, PAD, SOS]] = 30.0
    long = [i for s in sources for i in s][:70]  # more than seq_len - 2 = 38 tokens
    sources = sources[:8] + [long]
    export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "ct2")
    engine = load_engine(tmp_path / "ct2", Config())[0]
    ours = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK)
    assert not {UNK, PAD, SOS} & {t for out in ours for t in out}
    assert engine.translate_ids(sources, SOS, EOS, PAD, 40, unk_id=UNK) == ours


@pytest.mark.parametrize("design, scale", [("default", 1.0), ("modern", 1.0), ("modern", 1e-3)])
def test_the_engine_gives_the_models_own_log_probabilities(corpus, tmp_path, design, scale):
    """Greedy outputs alike can hide a small difference (a random model's attention is nearly
    uniform, so a position scheme rotating the wrong dimensions, or a norm's epsilon, rarely
    moves an argmax): the engine's log-probabilities of the model's own greedy outputs, token
    by token, are the model's, to float32 rounding. Embeddings made small (scale 1e-3, no
    position added: RoPE) make the norms' epsilon (1e-6, as model.py's) count."""
    from dataset import source_batch
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / design),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300,
                    **DESIGNS[design])
    model, data, sources = random_model(config)
    sources = sources[:10]
    with torch.no_grad():
        for embed in (model.src_embed, model.tgt_embed):
            embed.embedding.weight.mul_(scale)
    export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "ct2")
    engine = load_engine(tmp_path / "ct2", Config())[0]
    outputs = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK)
    for src_ids, out in zip(sources, outputs):
        src, mask = source_batch([src_ids], 40, SOS, EOS, PAD)
        with torch.no_grad():
            x = model.decode(model.encode(src, mask), mask, torch.tensor([[SOS] + out]))
            ours = model.projection_layer(x).log_softmax(-1)[0]
        ours = ours[torch.arange(len(out) + 1), torch.tensor(out + [EOS])]
        [theirs] = engine.translator.score_batch(
            [[data.tokenizer_src.id_to_token(i) for i in src_ids]],
            [[data.tokenizer_tgt.id_to_token(i) for i in out]])
        torch.testing.assert_close(torch.tensor(theirs.log_probs), ours, atol=2e-4, rtol=0)


def test_export_writes_the_quantization_asked_for(trained, tmp_path):
    """export.py --quantization int8 hands int8 to the engine (export.json says so, and the
    model's weights take about a quarter of float32's bytes), not the default float32."""
    import json
    home, _ = trained
    for quantization in ("float32", "int8"):
        t = run_here("export.py", "--output", tmp_path / quantization, "--quantization",
                     quantization, "--preload", "01", cwd=home)
        assert t.returncode == 0, t.stderr.decode()
        note = json.loads((tmp_path / quantization / "export.json").read_text())
        assert note["quantization"] == quantization
    sizes = {q: (tmp_path / q / "model.bin").stat().st_size for q in ("float32", "int8")}
    assert sizes["int8"] < 0.6 * sizes["float32"], sizes
