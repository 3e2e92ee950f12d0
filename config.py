"""Every knob of the project, in one dataclass, and the command line built from it.

`python train.py --help` lists every field below with its default. A checkpoint stores the
`Config` it was trained with (as a plain dict), so `translate.py` rebuilds the model from it.
"""

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


def _f(default, help, choices=None, group="train"):
    """A dataclass field with its --help text; `group` says which script uses it."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclass
class Config:
    # ---- data -------------------------------------------------------------------------------
    datasource: str = _f("Helsinki-NLP/opus_books",
                         "Hugging Face dataset (hub name, or a local folder laid out like a hub "
                         "repo); its subset is '{lang_src}-{lang_tgt}'", group="data")
    data_dir: str = _f("", "folder of local parallel files (train.en/train.de, pairs.tsv or "
                           "train.jsonl); empty = load `datasource` from the hub", group="data")
    lang_src: str = _f("en", "source language code", group="model")
    lang_tgt: str = _f("it", "target language code", group="model")
    seq_len: int = _f(350, "longest sequence in tokens, [SOS]/[EOS] included; longer training "
                           "pairs are dropped, translations stop there", group="model")
    tokenizer_type: str = _f("bpe", "bpe: byte-level subwords, no unknown words; word: the "
                                    "write-ups' word-level tokenizer", ["bpe", "word"], "model")
    vocab_size: int = _f(8000, "vocabulary size per language (bpe; word keeps words seen twice "
                               "up to this many)", group="model")
    tokenizer_file: str = _f("tokenizer_{0}.json",
                             "tokenizer file per language ({0} = language), inside model_folder "
                             "unless absolute", group="model")
    val_fraction: float = _f(0.1, "share of train held out for validation when the corpus has no "
                                  "validation split")
    # ---- model ------------------------------------------------------------------------------
    d_model: int = _f(512, "model width", group="model")
    N: int = _f(6, "encoder and decoder layers", group="model")
    h: int = _f(8, "attention heads", group="model")
    d_ff: int = _f(2048, "feed-forward inner width", group="model")
    dropout: float = _f(0.1, "dropout rate")
    tie_embeddings: bool = _f(False, "share the target embedding and output projection weights "
                                     "(the paper does)", group="model")
    # ---- optimisation -----------------------------------------------------------------------
    batch_size: int = _f(8, "sentences per batch (used when max_tokens is 0; giving --batch_size "
                            "alone switches to sentence batches)")
    max_tokens: int = _f(4096, "padded tokens per batch, length-bucketed (0 = use batch_size)")
    num_epochs: int = _f(20, "epochs to train")
    max_steps: int = _f(0, "stop after this many optimizer steps in all, saving a checkpoint "
                           "(0 = no limit)")
    lr: float = _f(1e-4, "peak learning rate (inverse_sqrt: scale on the paper's formula)")
    lr_schedule: str = _f("constant", "learning-rate schedule",
                          ["constant", "inverse_sqrt", "cosine"])
    warmup: int = _f(4000, "warm-up steps (inverse_sqrt, cosine)")
    label_smoothing: float = _f(0.1, "label smoothing of the cross-entropy")
    clip_grad: float = _f(1.0, "clip the gradient norm to this (0 = off)")
    max_bad_steps: int = _f(10, "non-finite updates in a row that stop training")
    accum_steps: int = _f(1, "batches whose gradients are summed per optimizer step")
    precision: str = _f("auto", "auto: bf16 autocast on CUDA (fp16 + scaler without bf16), "
                                "fp32 elsewhere", ["auto", "fp32", "bf16", "fp16"])
    compile: bool = _f(False, "torch.compile the model")
    num_workers: int = _f(0, "DataLoader worker processes")
    seed: int = _f(42, "random seed (data split, batch order, initialisation, dropout)")
    device: str = _f("auto", "auto picks cuda, then mps, then cpu", group="run")
    # ---- validation -------------------------------------------------------------------------
    val_max_sentences: int = _f(0, "sentences greedily decoded for BLEU each epoch (0 = all)")
    val_examples: int = _f(3, "SOURCE/TARGET/PREDICTED examples printed each epoch")
    # ---- checkpoints and logs ---------------------------------------------------------------
    model_folder: str = _f("weights", "folder of checkpoints and tokenizers", group="run")
    model_basename: str = _f("tmodel_", "checkpoint file prefix: tmodel_05.pt is epoch 5",
                             group="run")
    preload: str = _f("latest", "checkpoint to start from: latest, none, or an epoch (05)",
                      group="run")
    save_every: int = _f(0, "also save every this many optimizer steps mid-epoch (0 = off)")
    keep_last: int = _f(3, "mid-epoch checkpoints kept on disk (per-epoch ones are kept apart)")
    keep_epochs: int = _f(0, "per-epoch checkpoints kept on disk (0 = all)")
    experiment_name: str = _f("runs/tmodel", "TensorBoard log folder")
    log_every: int = _f(1, "log train loss and learning rate every this many steps")

    # ---- derived helpers --------------------------------------------------------------------
    def validate(self):
        """Return an error message for an invalid combination of values, or None."""
        positive = ["seq_len", "d_model", "N", "h", "d_ff", "vocab_size", "num_epochs",
                    "accum_steps", "log_every", "max_bad_steps"]
        for name in positive:
            if getattr(self, name) <= 0:
                return f"--{name} must be positive (got {getattr(self, name)})"
        for name in ["batch_size", "max_tokens", "warmup", "max_steps", "save_every", "keep_last",
                     "keep_epochs", "val_max_sentences", "val_examples", "num_workers",
                     "clip_grad"]:
            if getattr(self, name) < 0:
                return f"--{name} must not be negative (got {getattr(self, name)})"
        if self.max_tokens == 0 and self.batch_size == 0:
            return "one of --max_tokens and --batch_size must be positive"
        if self.d_model % self.h:
            return f"--d_model ({self.d_model}) must be divisible by --h ({self.h})"
        if self.seq_len < 3:
            return f"--seq_len must be at least 3 ([SOS], one token, [EOS]), got {self.seq_len}"
        if self.max_tokens and self.max_tokens < self.seq_len:
            return f"--max_tokens ({self.max_tokens}) must be at least --seq_len ({self.seq_len})"
        if not 0 <= self.dropout < 1:
            return f"--dropout must be in [0, 1), got {self.dropout}"
        if not 0 <= self.label_smoothing < 1:
            return f"--label_smoothing must be in [0, 1), got {self.label_smoothing}"
        if not 0 < self.val_fraction < 1:
            return f"--val_fraction must be in (0, 1), got {self.val_fraction}"
        if self.lr <= 0:
            return f"--lr must be positive, got {self.lr}"
        if not self.lang_src or not self.lang_tgt or self.lang_src == self.lang_tgt:
            return (f"--lang_src and --lang_tgt must be two different languages "
                    f"(got '{self.lang_src}' and '{self.lang_tgt}')")
        if "{0}" not in self.tokenizer_file:
            return "--tokenizer_file must contain {0} (replaced by the language code)"
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            return f"--device must be auto, cpu, cuda, cuda:N or mps, got '{self.device}'"
        if self.preload not in ("latest", "none") and not self.preload.isdigit():
            return f"--preload must be latest, none or an epoch number, got '{self.preload}'"
        return None

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild a Config from a checkpoint's dict; unknown keys (newer code) are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


MODEL_FIELDS = [f.name for f in dataclasses.fields(Config) if f.metadata["group"] == "model"]


class UserError(Exception):
    """A problem the user can fix (a path, a flag, a file, a sentence). The scripts print it as
    one line on stderr and exit with code 2, never a traceback."""


# ---- checkpoint paths ---------------------------------------------------------------------------

def tokenizer_path(config: Config, lang: str) -> Path:
    p = Path(config.tokenizer_file.format(lang))
    return p if p.is_absolute() else Path(config.model_folder) / p


def epoch_checkpoint_path(config: Config, epoch: int) -> Path:
    """weights/tmodel_05.pt: the state after epoch 5 (epochs count from 0)."""
    return Path(config.model_folder) / f"{config.model_basename}{epoch:02d}.pt"


def step_checkpoint_path(config: Config, epoch: int, global_step: int) -> Path:
    """weights/tmodel_05_s0012345.pt: a mid-epoch save during epoch 5 at that optimizer step."""
    return Path(config.model_folder) / f"{config.model_basename}{epoch:02d}_s{global_step:07d}.pt"


def list_checkpoints(config: Config):
    """All checkpoints of this run, oldest first, as (path, epoch, global_step or None).

    A per-epoch file sorts after every mid-epoch file of the same epoch."""
    folder = Path(config.model_folder)
    if not folder.is_dir():
        return []
    pattern = re.compile(re.escape(config.model_basename) + r"(\d+)(?:_s(\d+))?\.pt$")
    found = []
    for p in folder.iterdir():
        m = pattern.fullmatch(p.name)
        if m:
            step = int(m.group(2)) if m.group(2) else None
            found.append((p, int(m.group(1)), step))
    found.sort(key=lambda t: (t[1], t[2] is None, t[2] or 0))
    return found


def latest_checkpoint_path(config: Config):
    found = list_checkpoints(config)
    return found[-1][0] if found else None


def epoch_checkpoints(config: Config):
    return [p for p, _, step in list_checkpoints(config) if step is None]


def resolve_preload(config: Config):
    """The checkpoint `--preload` names, or None for a fresh start or an empty folder."""
    if config.preload == "none":
        return None
    if config.preload == "latest":
        return latest_checkpoint_path(config)
    path = epoch_checkpoint_path(config, int(config.preload))
    if not path.exists():
        raise CheckpointError(f"--preload {config.preload}: no checkpoint {path}")
    return path


# ---- command line -------------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def add_config_arguments(parser, visible=None, helps=None):
    """One --flag per Config field (same name, same type, default from the dataclass).
    `visible`: the fields --help lists (default all); `helps`: other help texts by name."""
    for f in dataclasses.fields(Config):
        hidden = visible is not None and f.name not in visible
        kind = _bool if f.type in (bool, "bool") else {"int": int, "float": float,
                                                         "str": str}.get(f.type, f.type)
        parser.add_argument(f"--{f.name}", type=kind, default=None, metavar=f.name.upper(),
                            choices=f.metadata["choices"],
                            help=argparse.SUPPRESS if hidden else
                            (helps or {}).get(f.name, f"{f.metadata['help']} "
                                                      f"(default: {f.default})"))


def config_from_args(args, base: Config = None):
    """Config with the flags the user gave on top of `base` (or the defaults).

    Returns (config, names of the flags given)."""
    config = dataclasses.replace(base) if base else Config()
    given = set()
    for f in dataclasses.fields(Config):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(config, f.name, value)
            given.add(f.name)
    # --batch_size on its own means sentence batches, as in the write-ups.
    if "batch_size" in given and "max_tokens" not in given:
        config.max_tokens = 0
    return config, given


def parse_config(argv=None, description=None):
    """The train.py command line: every Config field as a flag. Exits 2 on a bad value."""
    parser = ArgumentParser(description=description)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    config, _ = config_from_args(args)
    problem = config.validate()
    if problem:
        parser.error(problem)
    return config


# ---- checkpoints --------------------------------------------------------------------------------

class CheckpointError(UserError):
    """A checkpoint that cannot be found, saved or used."""


def build_model(config: Config, src_vocab_size: int, tgt_vocab_size: int):
    """The Transformer that `config` describes (what a checkpoint's config rebuilds)."""
    from model import build_transformer
    return build_transformer(src_vocab_size, tgt_vocab_size, config.seq_len, config.seq_len,
                             d_model=config.d_model, N=config.N, h=config.h,
                             dropout=config.dropout, d_ff=config.d_ff,
                             tie_embeddings=config.tie_embeddings)


def save_checkpoint(state: dict, path: Path):
    """Atomic save: a temporary file in the same folder, flushed to disk, then renamed over
    `path`. A crash at any instant leaves either the old file or the new one, never half."""
    import torch
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write checkpoint {path}: {e.strerror or e}; the "
                              f"checkpoints already saved are untouched") from None


CHECKPOINT_KEYS = ("model_state_dict", "config", "epoch", "global_step")


def load_checkpoint(path: Path) -> dict:
    """Loads with weights_only=True: only tensors and plain values, so a crafted file cannot run
    code. Raises CheckpointError naming the file for anything unusable."""
    import pickle

    import torch
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        unsafe = next((line for line in lines if "global" in line.lower()), None)
        if unsafe:  # a class or function reference: code that would run on load
            raise CheckpointError(f"checkpoint {path} refused: it holds more than tensors and "
                                  f"plain values ({unsafe})") from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt "
                              f"({lines[0] if lines else 'unreadable'})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({first})") from None
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        raise CheckpointError(f"checkpoint {path} is not a checkpoint of this project "
                              f"(expected keys {', '.join(CHECKPOINT_KEYS)})")
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"checkpoint {path} has no config dict")
    return state


def check_vocab(state: dict, path: Path, src_vocab_size: int, tgt_vocab_size: int):
    """Refuses a checkpoint whose embedding sizes differ from the tokenizer files'."""
    weights = state["model_state_dict"]
    for name, key, size in (("source", "src_embed.embedding.weight", src_vocab_size),
                            ("target", "tgt_embed.embedding.weight", tgt_vocab_size)):
        if key not in weights:
            raise CheckpointError(f"checkpoint {path} has no {key}: not a model of this project")
        if weights[key].shape[0] != size:
            raise CheckpointError(f"checkpoint {path} has a {name} vocabulary of "
                                  f"{weights[key].shape[0]} but the tokenizer file has {size}; "
                                  f"the tokenizers in --model_folder do not belong to it")


def load_model_weights(model, state: dict, path: Path):
    """load_state_dict, with an architecture mismatch as one CheckpointError line."""
    try:
        model.load_state_dict(state["model_state_dict"])
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        raise CheckpointError(f"checkpoint {path} does not fit this architecture: "
                              f"{detail[:300]}") from None
