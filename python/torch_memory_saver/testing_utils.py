"""Helpers for tests of torch_memory_saver programs (upstream's tests import them)."""

import torch

from .utils import is_xpu  # noqa: F401  (upstream's tests import it from here)


def get_device() -> str:
    return "cuda"


def empty_cache():
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    """Device memory in use on ``gpu_id`` (as NVML reports it), printed with ``message``."""
    used = torch.cuda.device_memory_used(gpu_id)
    print(f"GPU {gpu_id} memory: {used / 1024 ** 3:.2f} GB ({message})")
    return used
