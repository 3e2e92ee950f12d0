"""Every knob of the project, in one dataclass, and the command line built from it.

`python train.py --help` lists every field below with its default. A checkpoint stores the
`Config` it was trained with (as a plain dict), so `translate.py` rebuilds the model from it;
`nmt.checkpoint.merge_config` decides, from each field's group, which values a resumed or loaded
run takes from the checkpoint and which from the command line.
"""

import argparse
import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field


LR_AT_512 = 1e-3  # the default peak learning rate at d_model 512 (Config.peak_lr)

# Sentences decoded at once by translate.py, the Python API and the decoders, unless
# --batch_size (translate.py's) says otherwise: greedy decoding took a seventh less time at 128
# than at 64; beam search, whose rows are several a sentence, no less (an ensemble's a fifth
# more). The outputs are the same at any size (dev/LOG.md).
GREEDY_BATCH_SIZE, DECODE_BATCH_SIZE = 128, 64

# Beam search's length penalty alpha, ((5 + length) / 6) ^ alpha (Wu et al., 2016): the paper's
# value, translate.py's default, the test sets' beam at a run's end and the teachers'.
LENGTH_PENALTY = 0.6


def decode_batch_size(beam: int = 1, nbest: int = 1, sampling=None) -> int:
    """The sentences decoded at once by default: GREEDY_BATCH_SIZE for greedy decoding (beam 1,
    one output, no sampling), DECODE_BATCH_SIZE for beam search, and for sampling its rows
    (sentences times samples)."""
    return GREEDY_BATCH_SIZE if beam == 1 and nbest == 1 and not sampling else DECODE_BATCH_SIZE


def _f(default, help, choices=None, group="train", translate=False):
    """A dataclass field with its --help text and its group:
    data   where the corpus comes from;
    model  the architecture and its tokenizers: fixed once trained, rebuilt from a checkpoint;
    train  how to train: on resume, a flag given wins over the checkpoint's value;
    run    where and on what this run works: never taken from a checkpoint.
    `translate`: translate.py accepts the flag too (its value wins over the checkpoint's)."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                            "translate": translate})


@dataclass
class Config:
    # ---- data -------------------------------------------------------------------------------
    datasource: str = _f("Helsinki-NLP/opus_books",
                         "Hugging Face dataset (hub name, or a local folder laid out like a hub "
                         "repo): its subset '{lang_src}-{lang_tgt}' with a translation column, "
                         "or one column per language", group="data", translate=True)
    data_dir: str = _f("", "folder of local parallel files (train.en/train.de, train.tsv or "
                           "train.jsonl); empty = load `datasource` from the hub", group="data",
                           translate=True)
    extra_data_dir: str = _f("", "folder of extra training pairs, such as back-translations "
                                 "(train.xx/train.yy, train.tsv or train.jsonl, the same "
                                 "languages): added to the training split, never to validation",
                             group="data")
    extra_tag: str = _f("", "a tag put before each source of --extra_data_dir's pairs (tagged "
                            "back-translation, e.g. '<BT>'; one token of the source vocabulary; "
                            "empty: none)", group="data")
    upsample: int = _f(1, "with --extra_data_dir: the corpus's own training pairs repeated this "
                          "many times", group="data")
    max_len_ratio: float = _f(0.0, "drop training pairs whose longer side has more than this "
                                   "many times the tokens of the shorter (misaligned pairs of "
                                   "a web-crawled corpus; fairseq prepares WMT with 1.5); 0 = "
                                   "off; validation and test pairs are kept", group="data")
    distill_from: str = _f("", "sequence-level knowledge distillation: teacher models (model "
                               "folders at their newest checkpoint, or checkpoint files), "
                               "comma-separated; they translate the training split's sources "
                               "once, as one ensemble, and the student trains on their "
                               "translations (kept in model_folder/distilled)", group="data")
    distill_data: str = _f("distilled", "with --distill_from: the student trains on the "
                                        "teachers' translations alone, or on both them and "
                                        "the corpus's own references",
                           ["distilled", "both"], "data")
    distill_beam: int = _f(5, "with --distill_from: the teachers' beam size", group="data")
    distill_average: int = _f(1, "with --distill_from: each teacher's newest N per-epoch "
                                 "checkpoints averaged", group="data")
    lang_src: str = _f("en", "source language code", group="model")
    lang_tgt: str = _f("it", "target language code", group="model")
    seq_len: int = _f(350, "longest sequence in tokens, [SOS]/[EOS] included; longer training "
                           "pairs are dropped, translations stop there", group="model",
                           translate=True)
    tokenizer_type: str = _f("bpe", "bpe: byte-level subwords, no unknown words; word: the "
                                    "write-ups' word-level tokenizer", ["bpe", "word"], "model")
    vocab_size: int = _f(8000, "vocabulary size per language (bpe; word keeps words seen twice "
                               "up to this many)", group="model")
    tokenizer_file: str = _f("tokenizer_{0}.json",
                             "tokenizer file per language ({0} = language), inside model_folder "
                             "unless absolute", group="model", translate=True)
    val_fraction: float = _f(0.1, "share of train held out for validation when the corpus has no "
                                  "validation split")
    tokenizer_sample: int = _f(1_000_000, "training sentences (per language) the tokenizers are "
                                          "trained on, evenly spaced through the corpus (0 = all)",
                               group="model")  # (the tokenizers are the model's)
    # ---- model ------------------------------------------------------------------------------
    d_model: int = _f(512, "model width", group="model")
    N: int = _f(6, "encoder layers, and decoder layers unless --N_dec", group="model")
    N_dec: int = _f(0, "decoder layers (0 = N); fewer than the encoder's make decoding "
                       "faster (Kasai et al., 2021)", group="model")
    h: int = _f(8, "attention heads", group="model")
    d_ff: int = _f(2048, "feed-forward inner width", group="model")
    dropout: float = _f(0.1, "dropout of each sublayer's output and of the embeddings plus "
                             "positions (the paper's residual dropout)")
    attention_dropout: float = _f(0.1, "dropout of the attention weights")
    activation_dropout: float = _f(0.1, "dropout of the feed-forward's hidden activations")
    norm_first: bool = _f(True, "pre-norm (the write-ups; a final norm ends each stack); false: "
                                "the paper's post-norm (Add & Norm)", group="model")
    norm: str = _f("layer", "layer: LayerNorm; rms: RMSNorm (no centring, no bias)",
                   ["layer", "rms"], "model")
    ffn: str = _f("relu", "feed-forward: relu (the paper); swiglu: SiLU-gated, hidden width "
                          "2/3 of d_ff (the same parameters)", ["relu", "swiglu"], "model")
    pos: str = _f("sinusoidal", "positions: sinusoidal (added to the embeddings) or rope "
                                "(rotary, in self-attention)", ["sinusoidal", "rope"], "model")
    n_kv_heads: int = _f(0, "key/value heads, each shared by h/n_kv_heads query heads "
                            "(grouped-query attention); 0 = h", group="model")
    tie_embeddings: str = _f("none", "share weights: decoder = target embedding and output "
                                     "projection (the paper); all = also the source "
                                     "embedding (needs shared_vocab)",
                             ["none", "decoder", "all"], "model")
    shared_vocab: bool = _f(False, "one tokenizer trained on both languages and one embedding "
                                   "table (vocab_size is then the joint size)", group="model")
    # ---- optimisation -----------------------------------------------------------------------
    batch_size: int = _f(8, "sentences per batch (used when max_tokens is 0; giving --batch_size "
                            "alone switches to sentence batches; with --max_tokens, the fewest "
                            "validation decodes at once); in translate.py the sentences "
                            f"decoded at once, {GREEDY_BATCH_SIZE} greedy and "
                            f"{DECODE_BATCH_SIZE} with beam search unless given", translate=True)
    max_tokens: int = _f(4096, "padded tokens per batch (per process under torchrun), "
                               "length-bucketed (0 = use batch_size)")
    num_epochs: int = _f(20, "epochs to train (not with --time_budget, which sets them)")
    time_budget: float = _f(0.0, "train for this many minutes in all (every start together, "
                                 "validations and test scoring included): the run's "
                                 "length in steps, and so its learning-rate schedule, is set "
                                 "from the throughput the run measures and corrected as it "
                                 "goes, in place of --num_epochs; a resume keeps what is left "
                                 "(0 = off)")
    max_steps: int = _f(0, "stop after this many optimizer steps in all, saving a checkpoint "
                           "(0 = no limit)")
    lr: float = _f(0.0, f"peak learning rate; 0 = by model width, {LR_AT_512:g} · 512 / d_model "
                        f"({LR_AT_512 * 4:g} at d_model 128)")
    lr_schedule: str = _f("inverse_sqrt", "learning-rate schedule",
                          ["constant", "inverse_sqrt", "cosine"])
    warmup: int = _f(0, "warm-up steps of the inverse_sqrt and cosine schedules; 0 = min(4000, "
                        "a tenth of the run); a value given is used as it is")
    label_smoothing: float = _f(0.1, "label smoothing of the cross-entropy")
    clip_grad: float = _f(1.0, "clip the gradient norm to this (0 = off)")
    max_bad_steps: int = _f(10, "non-finite updates in a row that stop training (on a GPU the "
                                "count is read at --log_every steps: a streak ended between two "
                                "is not seen)")
    accum_steps: int = _f(1, "batches whose gradients are summed per optimizer step")
    precision: str = _f("auto", "auto: bf16 autocast on CUDA (fp16 + scaler without bf16) and "
                                "on a CPU that computes bf16 (AVX512-BF16, AMX), fp32 elsewhere "
                                "(the start line says which and why)",
                        ["auto", "fp32", "bf16", "fp16"])
    compile: bool = _f(False, "torch.compile the model's training step (for GPUs: on CPU, "
                              "training measured slower than eager, docs/performance.md), once "
                              "per batch shape (--fixed_shapes)")
    fixed_shapes: int = _f(0, "fixed batch shapes: each token batch padded to one of N lengths, "
                              "chosen from the training pairs' to pad the least, and to "
                              "max_tokens // length rows (filler rows weightless); 0: 16 under "
                              "--compile (compiled once per shape, no dynamic shapes), none "
                              "without it")
    cuda_graphs: bool = _f(False, "with --compile on CUDA: capture each shape's forward and "
                                  "backward as CUDA graphs (torch.compile's reduce-overhead "
                                  "mode), so the host launches one graph instead of each kernel")
    num_workers: int = _f(0, "DataLoader worker processes", group="run")
    seed: int = _f(42, "random seed (data split, batch order, initialisation, dropout)")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps; auto picks cuda, then mps, then cpu",
                     group="run", translate=True)
    threads: int = _f(0, "CPU threads of training or translating (0: torch's default, the cores "
                         "available; this repo's decoding in float32 on CPU takes that many "
                         "batches at once, one thread each, and the --ctranslate2 engine that "
                         "many threads a batch); give each run its share when two share a "
                         "machine",
                      group="run", translate=True)
    # ---- decoding (validation, test scoring, translate.py, export.py) -----------------------
    max_len_a: float = _f(1.2, "decoding: at most max_len_a · source tokens + max_len_b output "
                               "tokens (fairseq's rule; seq_len caps it)", translate=True)
    max_len_b: int = _f(10, "decoding: see max_len_a", translate=True)
    min_len: int = _f(1, "decoding: at least this many output tokens (1: never an empty "
                         "translation)", translate=True)
    # ---- validation -------------------------------------------------------------------------
    val_max_sentences: int = _f(0, "sentences greedily decoded for BLEU at each validation "
                                   "(0 = all)")
    eval_every: int = _f(0, "also validate every this many optimizer steps, besides the end of "
                            "each epoch (0 = off)")
    val_examples: int = _f(3, "SOURCE/TARGET/PREDICTED examples printed at each validation")
    patience: int = _f(0, "stop after this many validations without a better one (higher BLEU; "
                          "equal BLEU: lower loss) (0 = off)")
    # ---- checkpoints and logs ---------------------------------------------------------------
    model_folder: str = _f("weights", "folder of checkpoints and tokenizers", group="run",
                           translate=True)
    model_basename: str = _f("tmodel_", "checkpoint file prefix: tmodel_05.pt is epoch 5, "
                                        "tmodel_best.pt the best by validation BLEU",
                             group="run", translate=True)
    preload: str = _f("latest", "checkpoint to start from: latest, none, or an epoch (05); "
                                "translate.py also takes best", group="run", translate=True)
    bpe_dropout: float = _f(0.0, "subword regularization (BPE-dropout): each merge skipped "
                                 "with this probability as training pairs are batched, so each "
                                 "epoch sees other segmentations; validation, test and "
                                 "translation keep the plain one (0 = off; bpe tokenizers)")
    init_from: str = _f("", "start a new run from a trained model's weights (fine-tuning): "
                            "its folder (the best checkpoint) or a checkpoint file; its "
                            "architecture and tokenizers are kept, the optimizer, schedule, "
                            "steps and history start afresh")
    save_every: int = _f(0, "also save every this many optimizer steps mid-epoch (0 = off)")
    keep_last: int = _f(3, "mid-epoch checkpoints kept on disk, at least 1: the newest that "
                           "--save_every wrote (translate.py --average_saves N averages N), "
                           "and a stop's while it is the newest (per-epoch ones are kept "
                           "apart; --save_every 0 saves one only where a run stops mid-epoch)")
    keep_epochs: int = _f(0, "per-epoch checkpoints kept on disk (0 = all)")
    keep_optimizer: int = _f(1, "per-epoch checkpoints, newest first, that keep the optimizer "
                             "state --preload N needs to resume from them; older ones, and "
                             "mid-epoch ones but the newest, keep the weights only, a third of "
                             "the size (0 = all keep it)")
    experiment_name: str = _f("runs/tmodel", "TensorBoard log folder", group="run")
    log_every: int = _f(10, "log train loss and learning rate every this many steps (and at "
                        "each epoch's end); on a GPU the only steps that wait for it")

    # ---- derived helpers --------------------------------------------------------------------
    def decoder_layers(self) -> int:
        """The decoder's depth: --N_dec, or with --N_dec 0 (the default) --N, as in the paper."""
        return self.N_dec or self.N

    def depth(self) -> str:
        """The layers in words: "4" for the paper's equal stacks, "6+2" for 6 encoder and 2
        decoder layers."""
        n_dec = self.decoder_layers()
        return str(self.N) if n_dec == self.N else f"{self.N}+{n_dec}"

    def shape_count(self) -> int:
        """How many fixed batch lengths (nmt.shapes.FixedShapes), or 0 for none: --fixed_shapes,
        or 16 under --compile (not with BPE-dropout, whose batches are cut again)."""
        if self.fixed_shapes or self.bpe_dropout:
            return self.fixed_shapes
        return 16 if self.compile else 0

    def peak_lr(self) -> float:
        """--lr, or with --lr 0 (the default) one chosen by model width, LR_AT_512 · 512 /
        d_model: Adam's learning rate inversely proportional to the width, as muP (Yang et al.,
        2022) prescribes; measured in docs/training.md."""
        return self.lr or LR_AT_512 * 512 / self.d_model

    def teachers(self) -> list:
        """--distill_from's models, in the order given (names trimmed and normalized: "A/, ./B"
        is A and B)."""
        return [os.path.normpath(t.strip()) for t in self.distill_from.split(",") if t.strip()]

    def negative(self, names=None):
        """The message for the first setting (of `names`, else all) that must not be negative and
        is, or None: translate.py checks the flags given before it loads a model."""
        for name in ["batch_size", "max_tokens", "warmup", "max_steps", "save_every", "keep_last",
                     "keep_epochs", "keep_optimizer", "val_max_sentences", "val_examples",
                     "num_workers", "clip_grad", "patience", "eval_every", "tokenizer_sample",
                     "fixed_shapes", "time_budget",
                     "max_len_a", "max_len_b", "min_len", "N_dec", "threads"]:
            if (names is None or name in names) and getattr(self, name) < 0:
                return f"--{name} must not be negative (got {getattr(self, name)})"
        return None

    def validate(self, training: bool = True):
        """An error message for an invalid combination of values, or None (training: the
        batching flags too; translate.py and export.py have none)."""
        for name in (f.name for f in dataclasses.fields(self)):  # (float() reads nan, inf)
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                return f"--{name} must be a finite number (got {value})"
        for name in ["seq_len", "d_model", "N", "h", "d_ff", "vocab_size", "num_epochs",
                     "accum_steps", "log_every", "max_bad_steps"]:
            if getattr(self, name) <= 0:
                return f"--{name} must be positive (got {getattr(self, name)})"
        negative = self.negative()
        if negative:
            return negative
        if self.seq_len < 3:
            return f"--seq_len must be at least 3 ([SOS], one token, [EOS]), got {self.seq_len}"
        if self.min_len > self.seq_len - 2:
            return (f"--min_len {self.min_len} is more than a translation can hold: --seq_len "
                    f"{self.seq_len} leaves {self.seq_len - 2} output tokens ([SOS] and [EOS] "
                    f"take two), and [EOS] would be both required and barred")
        if self.max_len_a + self.max_len_b < 1:  # (--min_len raises a shorter limit to it)
            return (f"--max_len_a {self.max_len_a} and --max_len_b {self.max_len_b} leave no "
                    f"room for an output token")
        if self.data_problem():
            return self.data_problem()
        if self.keep_last < 1:
            return (f"--keep_last must be at least 1 (got {self.keep_last}): the newest saves "
                    f"are what --average_saves averages; --save_every 0 saves none")
        if training and self.max_tokens == 0 and self.batch_size == 0:
            return "one of --max_tokens and --batch_size must be positive"
        if self.d_model % self.h:
            return f"--d_model ({self.d_model}) must be divisible by --h ({self.h})"
        if self.n_kv_heads < 0 or (self.n_kv_heads and self.h % self.n_kv_heads):
            return f"--h ({self.h}) must be divisible by --n_kv_heads ({self.n_kv_heads})"
        if self.pos == "sinusoidal" and self.d_model % 2:
            return (f"--pos sinusoidal needs an even --d_model (sine and cosine pairs), got "
                    f"{self.d_model}")
        if self.pos == "rope" and (self.d_model // self.h) % 2:
            return f"--pos rope needs an even head width (d_model / h = {self.d_model // self.h})"
        if self.tie_embeddings == "all" and not self.shared_vocab:
            return "--tie_embeddings all needs --shared_vocab true (one vocabulary to share)"
        if training and self.max_tokens and self.max_tokens < self.seq_len:
            return f"--max_tokens ({self.max_tokens}) must be at least --seq_len ({self.seq_len})"
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0 <= getattr(self, name) < 1:
                return f"--{name} must be in [0, 1), got {getattr(self, name)}"
        if not 0 <= self.label_smoothing < 1:
            return f"--label_smoothing must be in [0, 1), got {self.label_smoothing}"
        if self.lr < 0:
            return f"--lr must not be negative (0: chosen by model width), got {self.lr}"
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            return f"--device must be auto, cpu, cuda, cuda:N or mps, got '{self.device}'"
        if self.preload not in ("latest", "none", "best") and not self.preload.isdecimal():
            return (f"--preload must be latest, none or an epoch number (translate.py also "
                    f"takes best), got '{self.preload}'")
        return None

    def data_problem(self):
        """validate's checks of the data flags: the corpus, its languages and tokenizers, the
        extra pairs, subword regularization."""
        if not self.lang_src or not self.lang_tgt or self.lang_src == self.lang_tgt:
            return (f"--lang_src and --lang_tgt must be two different languages "
                    f"(got '{self.lang_src}' and '{self.lang_tgt}')")
        if "{0}" not in self.tokenizer_file:
            return "--tokenizer_file must contain {0} (replaced by the language code)"
        if not 0 < self.val_fraction < 1:
            return f"--val_fraction must be in (0, 1), got {self.val_fraction}"
        if (self.extra_tag or self.upsample != 1) and not self.extra_data_dir:
            return "--extra_tag and --upsample go with --extra_data_dir (the extra pairs)"
        if self.extra_tag and self.extra_tag.split() != [self.extra_tag]:
            return f"--extra_tag must be one word, without spaces (got '{self.extra_tag}')"
        if self.upsample < 1:
            return f"--upsample must be at least 1 (got {self.upsample})"
        if self.max_len_ratio and not self.max_len_ratio >= 1:
            return (f"--max_len_ratio must be 0 (off) or at least 1 (got {self.max_len_ratio}): "
                    f"the longer side's tokens over the shorter's")
        if not self.distill_from and (self.distill_data != "distilled" or self.distill_beam != 5
                                      or self.distill_average != 1):
            return ("--distill_data, --distill_beam and --distill_average go with "
                    "--distill_from (the teachers)")
        if self.distill_from and not self.teachers():
            return "--distill_from names no model: give model folders or checkpoint files, " \
                   "comma-separated"
        if self.distill_beam < 1 or self.distill_average < 1:
            return "--distill_beam and --distill_average must be at least 1"
        if not 0 <= self.bpe_dropout < 1:
            return (f"--bpe_dropout must lie in [0, 1) (got {self.bpe_dropout}): the probability "
                    f"of skipping each merge")
        if self.bpe_dropout and self.fixed_shapes:
            return ("--fixed_shapes does not go with --bpe_dropout (its batches are cut again "
                    "as they are segmented)")
        if self.cuda_graphs and not self.compile:
            return "--cuda_graphs goes with --compile true (it is a mode of torch.compile)"
        if self.cuda_graphs and self.bpe_dropout:
            return ("--cuda_graphs captures fixed batch shapes, which --bpe_dropout does not "
                    "have (its batches are cut again as they are segmented): drop --cuda_graphs "
                    "or --bpe_dropout")
        if self.bpe_dropout and self.tokenizer_type != "bpe":
            return "--bpe_dropout needs --tokenizer_type bpe (a word vocabulary has no merges)"
        return None

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild a Config from a checkpoint's dict; unknown keys (newer code) are dropped,
        missing ones (older code) take their defaults, but the attention and activation
        dropout that of --dropout (one rate for all, then), and tie_embeddings true/false
        (before it had three values) reads as decoder/none."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        for name in ("attention_dropout", "activation_dropout"):  # before they were separate
            if name not in d and "dropout" in d:
                d[name] = d["dropout"]
        if isinstance(d.get("tie_embeddings"), bool):
            d["tie_embeddings"] = "decoder" if d["tie_embeddings"] else "none"
        return cls(**d)


# ---- presets: several flags at once; flags given beside --preset win ----------------------------

ARCHITECTURE = dict(norm_first=True, norm="layer", ffn="relu", pos="sinusoidal", n_kv_heads=0)
MULTI30K = dict(datasource="bentrevett/multi30k", lang_src="en", lang_tgt="de", seq_len=128,
                d_model=128, N=4, h=4, d_ff=512, shared_vocab=True, tie_embeddings="all",
                tokenizer_type="bpe", vocab_size=10000, dropout=0.2, attention_dropout=0.1,
                activation_dropout=0.1, lr_schedule="cosine", lr=0.0, warmup=0,
                max_tokens=4096, num_epochs=26, model_folder="weights/multi30k",
                experiment_name="runs/multi30k")
PRESETS = {
    # The step-by-step write-ups: pre-norm, word-level vocabularies per language, seq_len 350,
    # batches of 8 sentences (padded to their longest: the same updates), constant 1e-4.
    "writeups": dict(ARCHITECTURE, tie_embeddings="none", shared_vocab=False,
                     tokenizer_type="word", seq_len=350, d_model=512, N=6, h=8, d_ff=2048,
                     dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, batch_size=8,
                     max_tokens=0, lr_schedule="constant", lr=1e-4),
    # The paper (section 5, table 3): post-norm, one joint BPE vocabulary (37k for WMT14 en-de)
    # shared by both embeddings and the projection, about 25k tokens a step (a process's), warm-up
    # 4000 then inverse square root at its exact values (d_model · warmup)^-0.5; residual dropout
    # only (section 5.4); no gradient clipping (none is named).
    "paper_base": dict(ARCHITECTURE, norm_first=False, tie_embeddings="all", shared_vocab=True,
                       tokenizer_type="bpe", vocab_size=37000, d_model=512, N=6, h=8,
                       d_ff=2048, dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
                       label_smoothing=0.1, max_tokens=25000, clip_grad=0.0,
                       lr_schedule="inverse_sqrt", warmup=4000, lr=6.99e-4),
    "paper_big": dict(ARCHITECTURE, norm_first=False, tie_embeddings="all", shared_vocab=True,
                      tokenizer_type="bpe", vocab_size=37000, d_model=1024, N=6, h=16,
                      d_ff=4096, dropout=0.3, attention_dropout=0.0, activation_dropout=0.0,
                      label_smoothing=0.1, max_tokens=25000, clip_grad=0.0,
                      lr_schedule="inverse_sqrt", warmup=4000, lr=4.94e-4),
    # Issue 25's small-corpus recipe (Multi30k en->de from the hub, about 4M training tokens;
    # chosen on the validation split, docs/results.md): one joint BPE vocabulary of 10k shared by
    # both embeddings and the projection, 4,096-token batches, residual dropout 0.2, a cosine
    # schedule to zero, about an hour on 2 CPU cores with validations; each design in its own
    # folders. The pre-norm and modern designs: a small model (128/4 layers/4 heads/512, about
    # 3M parameters), 26 epochs; the modern one at twice the width's default peak learning rate
    # (8e-3), the pre-norm one at the default (4e-3), each what won for it (swept on a GPU at the
    # same steps). The post-norm design learns two to three times slower at that shape, so it
    # keeps the earlier 256/3/4/1024 (8M) for 15 epochs with a longer warm-up.
    "multi30k": dict(ARCHITECTURE, **MULTI30K),
    "multi30k_paper": {**ARCHITECTURE, **MULTI30K, "norm_first": False, "warmup": 400,
                       "d_model": 256, "N": 3, "d_ff": 1024, "num_epochs": 15,
                       "model_folder": "weights/multi30k_paper",
                       "experiment_name": "runs/multi30k_paper"},
    "multi30k_modern": {**ARCHITECTURE, **MULTI30K, "norm": "rms", "ffn": "swiglu",
                        "pos": "rope", "n_kv_heads": 2, "lr": 8e-3,
                        "model_folder": "weights/multi30k_modern",
                        "experiment_name": "runs/multi30k_modern"},
    # The modern encoder-decoder write-up: RMSNorm pre-norm, rotary positions, 8 query heads
    # sharing 4 key/value heads, SwiGLU, linear warm-up then cosine decay, clipping.
    "modern_small": dict(norm_first=True, norm="rms", ffn="swiglu", pos="rope", n_kv_heads=4,
                         tie_embeddings="decoder", shared_vocab=False, tokenizer_type="bpe",
                         d_model=128, N=4, h=8, d_ff=512, dropout=0.1, attention_dropout=0.1,
                         activation_dropout=0.1, lr_schedule="cosine",
                         warmup=0, lr=0.0, clip_grad=1.0),
}


def fields_where(**metadata) -> set:
    """Names of the Config fields whose metadata matches, e.g. fields_where(group="model")."""
    return {f.name for f in dataclasses.fields(Config)
            if all(f.metadata[k] == v for k, v in metadata.items())}


# Config fields translate.py and export.py take from the command line; the rest describe training.
TRANSLATE_FIELDS = fields_where(translate=True)


class UserError(Exception):
    """A problem the user can fix (a path, a flag, a file, a sentence). The scripts print it as
    one line on stderr and exit with code 2, never a traceback."""


def is_main() -> bool:
    """Rank 0, which alone writes files, logs and progress bars and says what went wrong: under
    torchrun the process whose RANK is 0 (torchrun gives each its rank in the environment, as
    the process group reads it), and always the one process of a plain run."""
    return os.environ.get("RANK", "0") == "0"


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def add_config_arguments(parser, visible=None, helps=None, skip=()):
    """One --flag per Config field (same name, same type, default from the dataclass), and
    --preset. `visible`: the fields --help lists (default all, and then --preset);
    `helps`: other help texts by name; `skip`: fields whose flag the script defines itself."""
    if visible is None:
        parser.add_argument("--preset", choices=sorted(PRESETS), help="set several flags at "
                            "once (flags given beside it win): " + "; ".join(
                                f"{name}: " + " ".join(f"--{k} {v}" for k, v in values.items())
                                for name, values in PRESETS.items()))
    for f in dataclasses.fields(Config):
        if f.name in skip:
            continue
        hidden = visible is not None and f.name not in visible
        switch = f.type in (bool, "bool")  # --compile alone means --compile true
        kind = _bool if switch else {"int": int, "float": float, "str": str}.get(f.type, f.type)
        choices = f.metadata["choices"]
        parser.add_argument(f"--{f.name}", type=kind, default=None, choices=choices,
                            nargs="?" if switch else None, const=True if switch else None,
                            metavar="{" + ",".join(choices) + "}" if choices else
                            "[true|false]" if switch else f.name.upper(),
                            help=argparse.SUPPRESS if hidden else
                            (helps or {}).get(f.name, f"{f.metadata['help']} "
                                                      f"(default: {f.default})"))


class Given(set):
    """The names of the flags a command line sets, typed or by its --preset; `preset`: the
    names its --preset alone set, and the preset's name, for a refusal to name what was typed."""

    def __init__(self, names=(), preset: str = None, by_preset=()):
        super().__init__(names)
        self.preset, self.by_preset = preset, frozenset(by_preset)


def drop_flag(given: set, name: str) -> str:
    """What to drop where --name's value is refused: the flag, or the --preset that set it."""
    if name in getattr(given, "by_preset", ()):
        return f"drop --preset {given.preset} (it sets --{name})"
    return "drop the flag"


def config_from_args(args, base: Config = None, training: bool = True):
    """Config with the flags the user gave on top of `base` (or the defaults). `training`:
    train.py's line, where --batch_size alone asks for sentence batches (translate.py's
    --batch_size is the sentences decoded at once, and it has no --max_tokens).

    Returns (config, names of the flags given: a Given)."""
    config = dataclasses.replace(base) if base else Config()
    preset = set()
    for name, value in PRESETS.get(getattr(args, "preset", None), {}).items():
        setattr(config, name, value)
        preset.add(name)
    flags = set()
    for f in dataclasses.fields(Config):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(config, f.name, value)
            flags.add(f.name)
    # --batch_size without --max_tokens means sentence batches (as in the write-ups), over a
    # preset's token batches too: the flag given wins
    if training and "batch_size" in flags and "max_tokens" not in flags:
        config.max_tokens = 0
        flags.add("max_tokens")
    return config, Given(preset | flags, getattr(args, "preset", None), preset - flags)


class RaisingParser(argparse.ArgumentParser):
    """parse_config's parser when none is given (a notebook, a test, your code): a bad flag is
    a UserError of one line, for the caller to catch or a script's run_main to print (argparse's
    own would print the usage and exit). The scripts give nmt.cli.ArgumentParser."""

    def error(self, message):
        raise UserError(f"{message} (see python train.py --help)")

    def refuse(self, message):
        raise UserError(message)


def parse_config(argv=None, parser=None, settings=None):
    """The train.py command line: every Config field as a flag. Returns (config, names of the
    flags given). A bad value is one line: `parser`'s error (the scripts': exit 2), or without
    one a UserError. `settings(config, given)`: the settings the run will train with, checked
    in place of the command line's with the defaults (train.py's: a resumed run's own, with
    the flags given over them); a UserError it raises (a checkpoint the start would refuse) is
    `parser.refuse`d: its one line, without --help's pointer."""
    parser = parser or RaisingParser()
    add_config_arguments(parser)
    config, given = config_from_args(parser.parse_args(argv))
    try:
        checked = settings(config, given) if settings else config
    except UserError as e:
        parser.refuse(str(e))
    problem = checked.validate() or unused(checked, given)
    if problem:
        parser.error(problem)
    return config, given


def unused(config: Config, given: set):
    """The message for a flag typed where the run would not use it, or None: an option that
    would do nothing is refused rather than ignored (a preset's values are not typed)."""
    typed = given - getattr(given, "by_preset", set())
    if "num_epochs" in typed and config.time_budget:
        return ("--num_epochs with --time_budget: the budget sets the run's length from the "
                "speed it measures; give one of them")
    if "warmup" in typed and config.lr_schedule == "constant":
        return "--warmup with --lr_schedule constant: a constant rate has no warm-up"
    if "datasource" in typed and config.data_dir:
        return (f"--datasource with --data_dir: the run reads the files of --data_dir "
                f"{config.data_dir}; give one of them")
    return None


# ---- the command line of translate.py and export.py -------------------------------------------

def add_locating_arguments(parser, own=()):
    """The flags that find a trained model (--model_folder, --preload, --checkpoint, --average,
    --average_saves) and the translate-time settings (decoding limits, device, batch size), with the
    architecture flags (checked against the checkpoint) hidden from --help. `own`: the names of
    training settings the script uses for a flag of its own (translate.py's --seed: the samples',
    stored under another name; the checkpoint's stays the config's)."""
    parser.add_argument("--checkpoint", help="checkpoint file (default: --preload in "
                        "--model_folder)")
    parser.add_argument("--average", type=int, default=1, help="average the weights of the "
                        "newest N per-epoch checkpoints")
    parser.add_argument("--average_saves", type=int, metavar="N", help="average the weights of "
                        "the newest N checkpoints saved --save_every steps apart (the paper's "
                        "last 5, written 10 minutes apart), not per-epoch ones")
    model_fields = fields_where(group="model")
    from_checkpoint = {name: f"{Config.__dataclass_fields__[name].metadata['help']} (default: "
                       f"the checkpoint's{'' if name in TRANSLATE_FIELDS else '; must match'})"
                       for name in (TRANSLATE_FIELDS | model_fields) - fields_where(group="run")
                       - {"batch_size"}}
    add_config_arguments(parser, visible=TRANSLATE_FIELDS | model_fields, skip=own, helps={
        **from_checkpoint,
        "batch_size": f"sentences translated at once, with --sample N sentences times N "
                      f"(default: {GREEDY_BATCH_SIZE} greedy, {DECODE_BATCH_SIZE} with beam "
                      f"search or sampling)",
        "seq_len": "longest source and output in tokens (default: the checkpoint's)",
        "preload": "checkpoint in --model_folder: latest, best or an epoch (default: best "
                   "where there is one, else latest; with --average or --average_saves, "
                   "latest)"})


AVERAGE_ONE_WAY = ("--average and --average_saves each pick the checkpoints averaged (the newest "
                   "per-epoch ones, or those saved --save_every apart): give one")


def checkpoint_config(parser, args):
    """(config of the flags given, names of the flags given); training-only flags refused."""
    config, given = config_from_args(args, training=False)
    if "preload" in given and config.preload not in ("best", "latest", "none") \
            and not config.preload.isdecimal():  # (none: nmt.checkpoint says why not)
        parser.error(f"--preload must be best, latest or an epoch number, got "
                     f"'{config.preload}'")
    for name in sorted(given - TRANSLATE_FIELDS - fields_where(group="model")):
        parser.error(f"--{name} is a training setting; translate.py takes its model from the "
                     f"checkpoint")
    if args.average > 1 and args.average_saves is not None:
        parser.error(AVERAGE_ONE_WAY)
    if args.checkpoint:  # the file named: nothing left to pick (but --average's epochs, by
        averaged = args.average > 1 or args.average_saves is not None  # name)
        picking = {"preload"} | ({"model_basename"} if not averaged else set())
        for name in sorted(given & picking):
            parser.error(f"--checkpoint names its file: not with --{name}, which picks one in "
                         f"--model_folder")
    problem = not_positive(average=args.average, average_saves=args.average_saves,
                           batch_size=args.batch_size) or \
        config.negative(given)  # (before the model is loaded)
    if problem:
        parser.error(problem)
    return config, given


def averaging(args) -> dict:
    """The averaging translate.py's and export.py's flags ask for, as load_translator's
    keywords: the newest `average` per-epoch checkpoints, or with `saves` those saved
    --save_every apart."""
    if args.average_saves is not None:
        return {"average": args.average_saves, "saves": True}
    return {"average": args.average, "saves": False}


def not_positive(**values):
    """The message for the first of these settings (None: not given) below 1, or None: the
    words of translate.py's, export.py's and nmt.translator.Translator's checks."""
    for name, value in values.items():
        if value is not None and value < 1:
            return f"--{name} must be positive (got {value})"
    return None


# ---- the configuration reference (docs/configuration.md) ----------------------------------------

def reference_markdown() -> str:
    """docs/configuration.md: every Config field with its group, default and help, and the
    presets, made from the dataclass itself (`python config.py > docs/configuration.md`)."""
    groups = {"data": "where the corpus comes from", "model": "the architecture and its "
              "tokenizers: fixed once trained, rebuilt from a checkpoint", "train": "how to "
              "train: on resume, a flag given wins over the checkpoint's value", "run": "where "
              "and on what this run works: never taken from a checkpoint"}
    lines = ["# Configuration reference", "",
             "Generated from `Config` in `config.py` by `python config.py > "
             "docs/configuration.md` (a test keeps it current). Every field is a flag of "
             "train.py; translate.py and export.py take the ones marked *translate* (the rest "
             "come from the checkpoint).", "",
             "Groups: " + "; ".join(f"*{k}*, {v}" for k, v in groups.items()) + ".", "",
             "| flag | default | group | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        meta = f.metadata
        choices = f" ({', '.join(meta['choices'])})" if meta["choices"] else ""
        where = meta["group"] + (", translate" if meta["translate"] else "")
        text = meta["help"].replace("|", "\\|")
        lines.append(f"| `--{f.name}` | `{f.default!r}` | {where} | {text}{choices} |")
    lines += ["", "## Presets", "", "`--preset NAME` sets these flags at once; flags given "
              "beside it win.", "", "| preset | sets |", "|---|---|"]
    for name, values in PRESETS.items():
        lines.append(f"| `{name}` | " + " ".join(f"`--{k} {v}`" for k, v in values.items())
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
