"""Where and how the model runs: the device, its precision, and CPU allocator tuning. Used by
train.py, translate.py and both benchmarks."""

import ctypes
import platform
from contextlib import nullcontext

import torch

from config import Config, UserError


def get_device(name: str = "auto") -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise UserError("--device mps: MPS is not available on this machine")
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def setup_device(name: str = "auto") -> torch.device:
    """The device, made ready: TF32 matmuls on CUDA (Ampere and newer), the allocator setting
    below on CPU."""
    device = get_device(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":
        tune_cpu_allocator()
    return device


def tune_cpu_allocator():
    """On Linux/glibc, keep freed memory for reuse instead of handing each large activation
    buffer back to the OS and page-faulting it in again next step (see the README for the
    speed-up). Memory stays reserved by the process; elsewhere this does nothing."""
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


def autocast_dtype(config: Config, device: torch.device):
    """The dtype of mixed precision, or None for fp32. auto: bf16 on GPUs that have it, else
    fp16 (with the gradient scaler); fp32 on CPU and MPS."""
    if config.precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]


def autocast(device: torch.device, dtype):
    """A function returning the autocast context of `dtype` (nullcontext for fp32)."""
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)
