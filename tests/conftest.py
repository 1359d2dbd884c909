"""Shared test setup.

Without a GPU, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set
before any kernel is defined, i.e. before `fp8linear.ops.*` is imported (they are imported
lazily on first use). The `auto` backend never picks the interpreter, so only tests that
force `backend="triton"` pay for it.
"""

import os
import socket

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The device Triton kernels run on in this session: the GPU, or the CPU interpreter.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def kernel_device() -> str:
    return KERNEL_DEVICE


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, hand its cached blocks back to the driver: with several pytest-xdist
    workers on one GPU, memory one worker's allocator keeps reserved (16 GB after the large
    tests) made others run out (H100, -n 8: 7 OutOfMemoryErrors in the experts tests)."""
    yield
    if HAS_CUDA and "gpu" in request.keywords:
        torch.cuda.empty_cache()



@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection fails; the hub is offline (for tests that build transformers models)."""

    def refuse(*args, **kwargs):
        raise OSError("network access is blocked in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module: its tensors are tiny, and OpenMP spinning hurts on busy 2-core CI boxes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
