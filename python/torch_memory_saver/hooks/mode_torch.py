"""Torch mode: MemPools allocate through the hook's tms_torch_malloc/tms_torch_free."""

from tms import preloaded_hook

from ..utils import get_binary_path_from_package
from .base import HookUtilBase


class HookUtilModeTorch(HookUtilBase):
    def __init__(self):
        from torch.cuda.memory import CUDAPluggableAllocator  # noqa: PLC0415

        self.allocator = CUDAPluggableAllocator(self.get_path_binary(), "tms_torch_malloc", "tms_torch_free")

    def get_path_binary(self):
        # A hook already preloaded serves torch mode too (one copy, one set of allocations).
        return preloaded_hook() or str(get_binary_path_from_package("torch_memory_saver_hook_mode_torch"))

    def get_allocator(self):
        return self.allocator.allocator()
