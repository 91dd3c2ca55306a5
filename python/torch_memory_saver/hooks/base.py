"""Hook modes: "preload" (LD_PRELOAD interposes cudaMalloc/aclrtMalloc) or "torch" (PyTorch's
pluggable allocator calls tms_torch_malloc/tms_torch_free)."""

from typing import Literal

HookMode = Literal["preload", "torch"]


class HookUtilBase:
    """Which library a hook mode uses, and the allocator torch mode hands to MemPools."""

    @staticmethod
    def create(hook_mode: HookMode) -> "HookUtilBase":
        from .mode_preload import HookUtilModePreload  # noqa: PLC0415
        from .mode_torch import HookUtilModeTorch  # noqa: PLC0415

        if hook_mode == "preload":
            return HookUtilModePreload()
        if hook_mode == "torch":
            return HookUtilModeTorch()
        raise ValueError(f"hook_mode must be 'preload' or 'torch', not {hook_mode!r}")

    def get_path_binary(self):
        raise NotImplementedError

    def get_allocator(self):
        return None
