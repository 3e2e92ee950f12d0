"""A trained model loaded once, to translate from Python code: the library under translate.py
(the command line over it), with the checks both make, worded for both (a keyword argument and
its flag have the same name).

    from nmt.translator import Translator
    translator = Translator("weights/multi30k_modern", average=5)
    translator.translate(["A dog runs.", "Two men talk."], beam=5)   # ["Ein Hund ...", ...]
"""

from pathlib import Path

from config import AVERAGE_ONE_WAY, LENGTH_PENALTY, Config, UserError, not_positive
from nmt.attention_map import attention_blocks, check_layer_and_head
from nmt.decoding import clean, translate
from nmt.trained_model import load_translator


class InputError(UserError):
    """A bad sentence, setting, input or output file."""


def check_settings(beam: int = 1, nbest: int = 1, average: int = 1, batch_size: int = None,
                   average_saves: int = None):
    """The search and loading settings in their ranges (an InputError line naming the one that
    is not): translate.py checks its flags with it before any model is loaded."""
    problem = not_positive(beam=beam, nbest=nbest, average=average, batch_size=batch_size,
                           average_saves=average_saves)
    if problem:
        raise InputError(problem)
    if nbest > beam > 1:
        raise InputError(f"--nbest {nbest} must be at most --beam {beam}")


def check_sentence(sentence: str) -> str:
    """One sentence to translate, refused if it is empty (nothing but spaces and control
    characters)."""
    if not clean(sentence):
        raise InputError("the sentence is empty")
    return sentence


def check_attention(model, view: str, layer: int, head: str):
    """--attention_layer and --attention_head against the model's layers and heads of `view`:
    checked before any sentence is decoded (or any output file written)."""
    blocks = attention_blocks(model)[view]
    check_layer_and_head(view, len(blocks), blocks[0].h if blocks else 0, layer, head)


class Translator:
    """A trained model loaded once (what translate.py does for a command line, with the same
    results for the same settings):

        translator = Translator("weights/multi30k_modern", average=5)
        translator.translate(["A dog runs.", "Two men talk."], beam=5)

    `model`: a model folder (at `preload`: latest, best or an epoch number; None, as translate.py
    without --preload: the best where there is one, else the newest) or a checkpoint file (that
    file, not its folder's newest); `average`: the newest N per-epoch checkpoints averaged, or
    `average_saves`: the newest N saved --save_every apart; `device` (auto, cpu, cuda, cuda:N, mps)
    and `threads` (CPU threads, 0: torch's default) as translate.py's flags. Where translate.py
    would print one line and exit 2, this raises config.UserError (a subclass:
    nmt.checkpoint.CheckpointError, InputError) with that line. `model`, `config`, `tokenizer_src`
    and `tokenizer_tgt` are there for more."""

    def __init__(self, model: str, preload: str = None, average: int = 1,
                 device: str = "auto", threads: int = 0, average_saves: int = None):
        check_settings(average=average, average_saves=average_saves)
        if average > 1 and average_saves is not None:
            raise InputError(AVERAGE_ONE_WAY)
        config = Config(device=device, threads=threads, preload=str(preload or "latest"))
        problem = config.validate(training=False)
        if problem:
            raise InputError(problem)
        given = {"device", "threads"} | ({"preload"} if preload is not None else set())
        checkpoint = None
        if Path(model).is_file():
            checkpoint = model
        else:
            config.model_folder = str(model)
            given.add("model_folder")
        saves = average_saves is not None
        self.model, self.config, self.tokenizer_src, self.tokenizer_tgt = load_translator(
            config, given, checkpoint, average_saves if saves else average, saves)

    @classmethod
    def of(cls, model, config: Config, tokenizer_src, tokenizer_tgt) -> "Translator":
        """A Translator of a model already loaded (translate.py's: one checkpoint, an ensemble
        with a source tokenizer each, or an exported model on its engine)."""
        translator = cls.__new__(cls)
        translator.model, translator.config = model, config
        translator.tokenizer_src, translator.tokenizer_tgt = tokenizer_src, tokenizer_tgt
        return translator

    def translate(self, sentences, beam: int = 1, alpha: float = LENGTH_PENALTY, nbest: int = 1,
                  batch_size: int = None, sampling=None, numbers=None, early_stop: bool = True):
        """Translations of a list of sentences (a list of strings), or of one sentence (a
        string, refused if empty); `beam` 1 is greedy; with nbest > 1, each an n-best list of
        (translation, score) pairs, best first (score: the length-penalized log-probability
        beam search ranks by; nbest alone searches with a beam of that width, as translate.py
        --nbest does); with `sampling` (nmt.decoding.Sampling), each its samples as
        (translation, log-probability) pairs. `numbers`: the sentences' numbers in their file,
        which a warning names (from 1 by default). `early_stop`: beam search's stop
        (nmt.decoding.beam_search; False: fairseq's rule)."""
        check_settings(beam, nbest, batch_size=batch_size)
        one = isinstance(sentences, str)
        texts = [check_sentence(sentences)] if one else list(sentences)
        outputs = translate(self.model, self.config, self.tokenizer_src, self.tokenizer_tgt,
                            texts, beam, alpha, 1 if sampling else nbest, batch_size,
                            sampling=sampling, numbers=numbers, early_stop=early_stop)
        return outputs[0] if one else outputs
