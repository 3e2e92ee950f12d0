"""Fixed batch shapes and the compiled training step (train.py --fixed_shapes, --compile,
--cuda_graphs): which shapes a run uses, what they cost, and torch.compile of the step's model
once per shape. The shapes themselves are nmt.shapes.FixedShapes; this is train.py's use of them."""

import torch

from config import Config, UserError
from dataset import Data
from nmt.batching import TokenBatchSampler
from nmt.shapes import FixedShapes, best_lengths


def choose_shapes(config: Config, data: Data, say: bool = False):
    """The run's fixed batch shapes, as many lengths as Config.shape_count decides
    (--fixed_shapes, 16 under --compile, none without either), or None: the lengths that pad the
    training pairs the least (best_lengths). `say`: print what they cost (`shapes_note`)."""
    count = config.shape_count()
    if not count:
        return None
    shapes = FixedShapes(best_lengths(data.train.lengths(), count), config.max_tokens,
                         config.batch_size)
    if say:
        print(shapes_note(shapes, data, config))
    return shapes


def shapes_note(shapes: FixedShapes, data: Data, config: Config) -> str:
    """What the fixed shapes cost the first epoch (of one process): its distinct shapes and
    its padding, against the same epoch's batches without them."""
    def epoch(with_shapes):
        return TokenBatchSampler(data.train.lengths(), config.max_tokens, config.batch_size,
                                 seed=config.seed, shapes=with_shapes).batches(0)
    found = shapes.report(data.train.src_ids.lengths() + 2, data.train.tgt_ids.lengths() + 1,
                          epoch(shapes), epoch(None))
    return (f"fixed shapes: {len(shapes.lengths)} lengths ({', '.join(map(str, shapes.lengths))}"
            f"), {found['shapes']} shapes in epoch 0; {found['steps']} steps padded "
            f"{100 * found['fixed_padding']:.1f}%, against {found['plain_steps']} padded "
            f"{100 * found['plain_padding']:.1f}% without them ({100 * found['added']:+.1f}% "
            f"tokens)")


def check_cuda_graphs(config: Config, device):
    """--cuda_graphs needs a CUDA device: refused when the run starts, before anything is
    written, with the command line's flags and again with a resumed checkpoint's (its pairing
    with --compile and fixed shapes: Config.validate). Every caller of `compiled` checks first."""
    if config.cuda_graphs and device.type != "cuda":
        raise UserError(f"--cuda_graphs needs a CUDA device (this run is on {device}): drop "
                        f"--cuda_graphs or run on CUDA")


def compiled(model, config: Config, device, shapes):
    """torch.compile of the training step's model: static shapes, compiled once per fixed
    shape (the recompile limit raised to their number), or with BPE-dropout's free shapes
    dynamic; --cuda_graphs (CUDA, fixed shapes: checked before) adds CUDA graphs (mode
    reduce-overhead)."""
    if shapes is None:
        return torch.compile(model, dynamic=True)
    import torch._dynamo as dynamo
    limit = 2 * (len(shapes.lengths) + 2)  # every shape, in train and eval modes
    for name in ("recompile_limit", "cache_size_limit"):  # (the name of torch >= 2.6, before)
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), limit))
    return torch.compile(model, dynamic=False,
                         mode="reduce-overhead" if config.cuda_graphs else None)
