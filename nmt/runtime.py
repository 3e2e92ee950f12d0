"""Where and how the model runs: the device, its precision, CPU allocator tuning, and the
processes of a data-parallel (torchrun) run. Used by train.py, translate.py and the benchmarks."""

import atexit
import ctypes
import datetime
import inspect
import os
import platform
import sys
import time
from contextlib import contextmanager, nullcontext, suppress

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from config import Config, UserError, is_main
from nmt.cli import ReportedElsewhere


def get_device(name: str = "auto") -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise UserError("--device mps: MPS is not available on this machine")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if name.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise UserError(f"--device {name} under torchrun would put every process on one GPU; "
                        f"use --device cuda (each process takes the GPU of its LOCAL_RANK) and "
                        f"choose the GPUs with CUDA_VISIBLE_DEVICES")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)  # under torchrun, each process its own GPU
    if name != "auto":
        return torch.device(name)
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def use_threads(threads: int):
    """--threads: torch's CPU threads for this process (0: torch's default, the cores
    available). Two runs that share cores, each with the default, slow each other several times
    over (issue 45 measured 5.9 s a step against 1.2 s with one thread each)."""
    if threads:
        torch.set_num_threads(threads)


def busy_note(device: torch.device):
    """A warning when other work already keeps this machine's cores busy (the 1-minute load
    average, less this process's own core): torch's threads on top of it slow every process
    sharing the cores several times over. None when it fits, off CPU, or where the load average
    is not known."""
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    others, threads = max(os.getloadavg()[0] - 1, 0), torch.get_num_threads()
    if others < 1 or others + threads <= cores:
        return None
    return (f"warning: this machine is busy (load {others + 1:.1f} on {cores} cores, this run "
            f"takes {threads} thread{'s' * (threads != 1)}): processes sharing cores slow each "
            f"other several times over; give each --threads N so that they fit")


def setup_device(name: str = "auto") -> torch.device:
    """The device, made ready: TF32 matmuls on CUDA (Ampere and newer), the allocator setting
    below on CPU."""
    device = get_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # cuDNN's attention builds a plan for every new batch shape (about a second each on an
        # H100, measured), and token batches come in many shapes: use the flash and
        # memory-efficient kernels, which have no such cost and run as fast (0.996x the step with
        # cuDNN on an H200, one shape: docs/scaling.md).
        torch.backends.cuda.enable_cudnn_sdp(False)
    if device.type == "cpu":
        tune_cpu_allocator()
    return device


def tune_cpu_allocator():
    """On Linux/glibc, keep freed memory for reuse instead of handing each large activation
    buffer back to the OS and page-faulting it in again next step (docs/performance.md gives
    the speed-up). Memory stays reserved by the process; elsewhere this does nothing."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and
                libc.mallopt(m_trim_threshold, 1 << 31))


def native_bf16(device: torch.device) -> bool:
    """Whether the GPU computes in bf16 itself: NVIDIA from Ampere (compute capability 8.0)
    on, and AMD GPUs. Older NVIDIA GPUs (T4, V100) only emulate it, slowly, although
    torch.cuda.is_bf16_supported() says yes unless told to exclude emulation."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device)[0] >= 8


def note_precision(device: torch.device, precision: str):
    """A word where a precision is a poor choice for the device (said, not refused)."""
    if device.type == "cpu" and precision == "fp16":
        print("note: --precision fp16 on a CPU: float16 autocast and the gradient scaler, which "
              "most CPUs run without hardware support; bf16 or fp32 is the usual choice there",
              file=sys.stderr)


# ---- bf16 on a CPU: only where the CPU computes it (docs/performance.md#bf16-training-on-a-cpu) --

CPU_KINDS = (("amx", "Intel AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512", "AVX-512"),
             ("avx2", "AVX2"))  # most capable first; none of them: "no AVX2"
NATIVE_BF16 = {"amx", "avx512_bf16"}  # the kinds whose instructions compute bf16 products


def cpu_features() -> frozenset:
    """Which of CPU_KINDS' instruction sets this CPU has, by torch's own CPU probe (cpuinfo:
    any OS), or where this torch lacks it, Linux's /proc/cpuinfo flags. NMT_CPU_FEATURES in the
    environment (comma-separated: avx2,avx512,avx512_bf16,amx) says which to assume instead:
    the test suite runs as on a CPU without bf16 (avx2), its processes too."""
    assumed = os.environ.get("NMT_CPU_FEATURES")
    if assumed is not None:
        return frozenset(name for name in assumed.split(",") if name)
    probes = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported"}
    try:
        return frozenset(name for name, probe in probes.items() if getattr(torch.cpu, probe)())
    except (AttributeError, RuntimeError):
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
    except OSError:
        return frozenset()
    named = {"avx2": "avx2", "avx512": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}
    return frozenset(name for name, flag in named.items() if flag in flags)


def cpu_kind(features=None) -> str:
    """The CPU in the words of the docs' tables: Intel AMX, AVX512-BF16, AVX-512, AVX2."""
    features = cpu_features() if features is None else features
    return next((name for flag, name in CPU_KINDS if flag in features), "no AVX2")


def cpu_computes_bf16(features=None) -> bool:
    """Whether bf16 trains faster than fp32 here: the CPU has bf16 instructions (AVX512-BF16,
    or AMX's tiles). Without them every bf16 product is converted and computed in fp32: an
    AVX2 CPU took 15 to 40 times fp32's time a step (docs/performance.md)."""
    return bool((cpu_features() if features is None else features) & NATIVE_BF16)


def precision_reason(config: Config, device: torch.device) -> str:
    """Why --precision auto chose what it did, for the start line ("" where it was given)."""
    if config.precision != "auto":
        return ""
    if device.type == "cuda":
        return " (--precision auto: " + ("the GPU computes bf16)" if native_bf16(device) else
                                          "the GPU has no native bf16)")
    if device.type != "cpu":
        return " (--precision auto: fp32 off CPU and CUDA)"
    kind = cpu_kind()
    if cpu_computes_bf16():
        return f" (--precision auto: this CPU computes bf16 itself, {kind})"
    return (f" (--precision auto: this CPU, {kind}, has no bf16 instructions, where bf16 "
            f"trains many times slower)")


def bf16_slowdown(config: Config, repeats: int = 3) -> float:
    """bf16's time over fp32's for a matrix product at the model's shapes (up to 1,024 rows of
    the batch by d_model, times d_model by d_ff), each the best of `repeats` after one warm-up:
    what --precision bf16 costs here, measured in well under a second where the CPU computes
    bf16 and in a few seconds at most where it does not."""
    rows = min(config.max_tokens or config.batch_size * config.seq_len, 1024)
    x, w = torch.randn(rows, config.d_model), torch.randn(config.d_model, config.d_ff)
    seconds = []
    for a, b in ((x, w), (x.bfloat16(), w.bfloat16())):
        a @ b
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
        seconds.append(best)
    return seconds[1] / max(seconds[0], 1e-9)


def bf16_warning(config: Config, device: torch.device):
    """One line where --precision bf16 was asked for on a CPU without bf16 instructions and a
    probe (bf16_slowdown) measures it slower: the ratio, and that training goes on. None where
    it is not slower, or not asked for."""
    if device.type != "cpu" or config.precision != "bf16" or cpu_computes_bf16():
        return None
    ratio = bf16_slowdown(config)
    if ratio <= 1.0:
        return None
    return (f"warning: --precision bf16 on a CPU without bf16 instructions ({cpu_kind()}): a "
            f"bf16 matrix product at this model's shapes took {ratio:.1f}x fp32's time; "
            f"training goes on in bf16, that much slower (--precision auto: fp32 here)")


def autocast_dtype(config: Config, device: torch.device):
    """The dtype of mixed precision, or None for fp32. auto: bf16 on GPUs that have it, else
    fp16 (with the gradient scaler); on a CPU bf16 where it computes bf16 itself
    (cpu_computes_bf16), else fp32; fp32 on MPS."""
    if config.precision == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_computes_bf16() else None
        if device.type != "cuda":
            return None
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]


def say_device(config: Config, device: torch.device, amp_dtype, rank: int, world: int):
    """The start line: the device, the precision and why --precision auto chose it; and where
    bf16 was asked for on a CPU without bf16 instructions, how much slower it measured."""
    print(f"device {device}" + (f", {amp_dtype} autocast" if amp_dtype else ", fp32")
          + precision_reason(config, device)
          + (f", {world} processes (torchrun)" if world > 1 else ""))
    slower = bf16_warning(config, device) if rank == 0 else None
    if slower:
        print(slower, file=sys.stderr)


def autocast(device: torch.device, dtype):
    """A function returning the autocast context of `dtype` (nullcontext for fp32)."""
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


# ---- data-parallel training: torchrun + DistributedDataParallel ---------------------------------

_flags_group = None  # a Gloo group for small host-side numbers (no GPU synchronisation)
WAIT_TIMEOUT = datetime.timedelta(hours=2)  # the longest wait of one rank for the others


def start_distributed(device_name: str = "auto"):
    """Under torchrun (WORLD_SIZE in the environment), joins the process group: NCCL between
    GPUs, Gloo on CPU. Returns (rank, world_size); (0, 1) for a plain `python train.py`."""
    global _flags_group
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        device = get_device(device_name)  # on GPUs, this process's own (LOCAL_RANK)
        gpu = device.type == "cuda"
        if gpu:
            torch.cuda.set_device(device)
        # rank 0 prepares the data while the others wait (in the Gloo group):
        # both groups allow WAIT_TIMEOUT for it, not torch's 30-minute default
        dist.init_process_group("nccl" if gpu else "gloo", timeout=WAIT_TIMEOUT)
        _flags_group = (dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT) if gpu
                        else dist.group.WORLD)
    return dist.get_rank(), dist.get_world_size()


def data_parallel(model, device: torch.device):
    """The model wrapped to average its gradients over the ranks during backward (DDP): buffers
    not synchronized at each forward (the positional tables are the same on every rank),
    gradients kept as views of the buckets, not copied. torch 2.13 renames broadcast_buffers to
    forward_sync_buffers (and syncs the buffers once at the start, which changes nothing here)."""
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **{"forward_sync_buffers" if renamed else "broadcast_buffers": False})


def in_group() -> bool:
    """Whether this process has joined a process group (under torchrun)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world():
    if in_group():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def main_first():
    """Rank 0 runs the block first (training tokenizers, preparing data, moving files), the
    other ranks after it, to find its results. Yields a dict: what rank 0 puts in it, the
    others find in theirs. If rank 0 fails in the block (a bad path, a bad checkpoint), it says
    why and the others, told so, exit without a word."""
    if rank_and_world()[1] == 1:
        yield {}
        return
    if is_main():
        shared = {}
        try:
            yield shared
        except BaseException:
            _broadcast_from_main(None)
            raise
        _broadcast_from_main(shared)
    else:
        shared = _broadcast_from_main(None)
        if shared is None:  # rank 0 failed
            try:  # returns when rank 0 has exited, its line printed
                dist.barrier(group=_flags_group)
            except Exception:
                pass
            raise ReportedElsewhere()
        yield shared


def _broadcast_from_main(obj):
    """Rank 0's `obj`, on every rank (rank 0 sends; the others wait for it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_flags_group)
    return box[0]


def sum_over_ranks(*values: float):
    """The sums over all ranks of a few numbers held on the host (token counts, flags), through
    Gloo: no GPU synchronisation."""
    if rank_and_world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=_flags_group)
    return tuple(t.tolist())


def max_over_ranks(value: int) -> int:
    """The largest of an integer held on every rank (a stop reason), through Gloo: no GPU
    synchronisation."""
    if rank_and_world()[1] == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_flags_group)
    return int(t.item())


def gather_to_main(obj):
    """A list of every rank's `obj` on rank 0 (None elsewhere)."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=_flags_group)
    return out


class NoWriter:
    """The TensorBoard writer of ranks other than 0, and of a run with nothing to do."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def gather_to_all(obj):
    """A list of every rank's `obj`, on every rank."""
    if rank_and_world()[1] == 1:
        return [obj]
    out = [None] * rank_and_world()[1]
    dist.all_gather_object(out, obj, group=_flags_group)
    return out


@contextmanager
def exit_distributed():
    """The end of a script that may run under torchrun. Alone, nothing changes: the block's
    SystemExit, or a bug's exception, goes on. Under torchrun the process leaves its group and
    ends here, with the code Python would give (a SystemExit's: run_main's 1, 2, 130, 143; 0 at
    the block's end; 1 after a bug's traceback; 130 after Ctrl-C's): exit handlers run, but not
    the interpreter's teardown, nor joins of threads that are not daemons (none of ours at the
    end). A process group outlives destroy_process_group while anything holds it
    (DistributedDataParallel does), and so do its Gloo threads; one that frees a tensor Python
    made needs the GIL, and where it meets the teardown under way it aborts the process
    (std::terminate, exit -6): a run that had saved everything reported as failed
    (pytorch/pytorch#190489; here once in about twenty loaded test runs, the tensor of
    exit_code's last exchange)."""
    try:
        yield
    except BaseException as error:
        if not in_group():
            raise
        if isinstance(error, SystemExit):
            code = error.code
        else:  # as Python would (but 130, the shell's, for Ctrl-C, where Python dies by SIGINT)
            error.with_traceback(error.__traceback__.tb_next)  # (from the block, not `yield`)
            sys.excepthook(type(error), error, error.__traceback__)
            code = 130 if isinstance(error, KeyboardInterrupt) else 1
    else:
        if not in_group():
            return
        code = 0
    if code is not None and not isinstance(code, int):  # sys.exit("a message")
        sys.stderr.write(f"{code}\n")
        code = 1
    with suppress(Exception):  # (a group that cannot be torn down changes nothing now)
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # (flushing logs, removing temporary files)
    for stream in sys.stdout, sys.stderr:  # (a stream replaced by a buffered one, or closed)
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code or 0)


# ---- a step that does not fit ---------------------------------------------------------------

class OutOfMemory(UserError):
    """A training step that did not fit the device's memory."""


def is_out_of_memory(error: Exception) -> bool:
    """Whether a step's error is the device's memory running out (torch.OutOfMemoryError on a
    GPU; a RuntimeError "... out of memory" on MPS)."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def out_of_memory(config: Config, device: torch.device, group, resume) -> OutOfMemory:
    """A training step's out-of-memory error as one line (docs/troubleshooting.md): the step's
    size (its batches), what to lower, and how to go on from the checkpoints saved, as
    `resume(config)` says (nmt.resume.after_smaller_batches)."""
    padded = sum(b["encoder_input"].numel() + b["label"].numel() for b in group)
    size = (f"--max_tokens {config.max_tokens}" if config.max_tokens else
            f"--batch_size {config.batch_size}")
    return OutOfMemory(
        f"out of memory on {device} in a step of {padded:,} padded tokens ({size}, "
        f"--accum_steps {config.accum_steps}): lower --max_tokens (or --batch_size) and "
        f"raise --accum_steps to keep the update's size; {resume(config)}")
