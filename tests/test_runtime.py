"""Devices and precision, and the torchrun helpers' settings."""

import pytest
import torch

from config import Config
from nmt.runtime import autocast_dtype


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_a_missing_accelerator_is_a_clear_error():
    from config import UserError
    from nmt.runtime import get_device
    with pytest.raises(UserError, match="--device cuda: CUDA is not available"):
        get_device("cuda")
    assert get_device("cpu").type == "cpu"


def test_auto_precision_uses_fp16_on_gpus_that_only_emulate_bf16(monkeypatch):
    """1. T4 / V100 (compute capability 7.x) only emulate bf16, though torch's
    is_bf16_supported() says yes: the choice goes by the compute capability. (Issue 41: this
    test patched is_bf16_supported, which the code never calls; now that function fails if
    called, and AMD GPUs, which compute bf16, are checked too.)"""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda *a, **k: pytest.fail("is_bf16_supported says yes to emulation"))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda")
    for capability, expected in (((7, 5), torch.float16), ((7, 0), torch.float16),
                                 ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert autocast_dtype(Config(precision="auto"), cuda) == expected, capability
    assert autocast_dtype(Config(precision="auto"), torch.device("cpu")) is None
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: every GPU it runs computes bf16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 4))
    assert autocast_dtype(Config(precision="auto"), cuda) == torch.bfloat16
    assert autocast_dtype(Config(precision="fp16"), cuda) == torch.float16  # as asked


def test_under_torchrun_one_gpu_for_every_rank_is_refused(monkeypatch):
    """19. --device cuda:N under torchrun put every rank on GPU N."""
    from nmt import runtime
    from config import UserError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError, match="would put every process on one GPU"):
        runtime.get_device("cuda:0")
    assert runtime.get_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert runtime.get_device("cuda:0") == torch.device("cuda", 0)


def test_the_host_side_group_waits_as_long_as_the_gpu_group(monkeypatch):
    """17. The Gloo group (flags, rank 0's data preparation and validation) had torch's
    30-minute default timeout, not the NCCL group's hour."""
    import datetime

    from nmt import runtime
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(runtime, "get_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "init_process_group",
                        lambda backend, **kw: calls.setdefault(backend, kw))
    monkeypatch.setattr(runtime.dist, "new_group", lambda backend, **kw: calls.setdefault(
        backend, kw))
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(runtime, "_flags_group", None)
    runtime.start_distributed("cuda")
    assert calls["gloo"]["timeout"] == calls["nccl"]["timeout"] >= datetime.timedelta(hours=1)


def test_a_busy_machine_is_said_before_training(monkeypatch):
    """Issue 45: two trainings on a shared 2-core CPU, each with torch's default threads, ran
    at 5.9 s a step against 1.2 s with one thread each, and nothing warned."""
    import os

    from nmt.runtime import busy_note
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cpu = torch.device("cpu")
    for load, warned in ((1.0, False), (1.8, False), (3.1, True), (2.2, True)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        note = busy_note(cpu)
        assert (note is not None) == warned, (load, note)
    assert "load 2.2 on 2 cores, this run takes 2 threads" in busy_note(cpu)  # the last load set
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 2.0, 2.0))  # one other run, 1 thread
    assert busy_note(cpu) is None and busy_note(torch.device("cuda")) is None
