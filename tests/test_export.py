"""Issue 17: every design exports to CTranslate2 and decodes there as it does here."""

import pytest
import torch
from conftest import number_pairs, write_aligned

from checkpoint import build_model
from config import Config
from dataset import EOS, PAD, SOS, UNK, get_ds
from model import translate_ids

ctranslate2 = pytest.importorskip("ctranslate2")
from export import ExportError, export  # noqa: E402
from translate import load_engine  # noqa: E402

DESIGNS = {
    "default": {},
    "post-norm": {"norm_first": False},
    "paper": {"norm_first": False, "shared_vocab": True, "tie_embeddings": "all"},
    "modern": {"norm": "rms", "ffn": "swiglu", "pos": "rope", "n_kv_heads": 2,
               "tie_embeddings": "decoder"},
    "rope, multi-query": {"pos": "rope", "n_kv_heads": 1},
    "rms post-norm, swiglu, joint": {"norm": "rms", "norm_first": False, "ffn": "swiglu",
                                     "shared_vocab": True},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    write_aligned(folder / "c", "train", number_pairs(80, seed=1))
    write_aligned(folder / "c", "val", number_pairs(12, seed=2))
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


def test_quantized_exports_and_refusals(corpus, tmp_path, monkeypatch):
    config = Config(data_dir=str(corpus / "c"), model_folder=str(corpus / "default"),
                    lang_tgt="it", d_model=32, N=2, h=4, d_ff=64, seq_len=40, vocab_size=300)
    model, data, sources = random_model(config)
    ours = translate_ids(model, sources, SOS, EOS, PAD, 40, unk_id=UNK)
    export(model, config, data.tokenizer_src, data.tokenizer_tgt, tmp_path / "int8", "int8")
    engine = load_engine(tmp_path / "int8", Config())[0]
    theirs = engine.translate_ids(sources, SOS, EOS, PAD, 40, unk_id=UNK)
    assert len(theirs) == len(ours) and sum(a == b for a, b in zip(ours, theirs)) >= 20
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
