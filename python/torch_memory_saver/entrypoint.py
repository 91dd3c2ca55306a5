"""``TorchMemorySaver``: torch_memory_saver's object API over tms's shared Saver."""

import os
from typing import Literal, Optional

from tms.saver import DEFAULT_TAG, check_region_arguments, shared

from .binary_wrapper import BinaryWrapper
from .hooks.base import HookMode
from .utils import is_xpu

CpuBackupBackend = Literal["mmap", "pinned"]


class _Impl:
    """What torch_memory_saver keeps in ``_impl``; slime and upstream's tests reach into it
    (``_binary_wrapper.cdll``, ``_mem_pools``, ``_with_region_config``)."""

    def __init__(self, saver):
        self._saver = saver
        self._binary_wrapper = BinaryWrapper.of(saver.handle)

    @property
    def _hook_mode(self):
        return self._saver.hook_mode

    @property
    def _mem_pools(self):
        return self._saver.mem_pools

    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend=None, enable_disk_backup=False):
        return self._saver.with_region_config(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup)


def _validate(enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
    check_region_arguments(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
    if cpu_backup_backend is None:
        return
    if is_xpu():
        raise ValueError("cpu_backup_backend is not supported on XPU")
    import torch  # noqa: PLC0415

    if cpu_backup_backend == "mmap" and getattr(torch.version, "hip", None):
        raise ValueError("cpu_backup_backend='mmap' is not supported on ROCm")


def _default_hook_mode():
    """Upstream's default, "preload", unless TMS_HOOK_MODE says otherwise: torch_memory_saver's
    Ascend build (sgl-kernel-npu) takes its default from that variable, and its users set it."""
    mode = os.environ.get("TMS_HOOK_MODE", "")
    if mode == "":
        return "preload"
    if mode not in ("preload", "torch"):
        raise ValueError(f"TMS_HOOK_MODE={mode!r}: use 'preload' or 'torch', or unset it (preload)")
    return mode


class TorchMemorySaver:
    """torch_memory_saver's API, argument for argument. Defaults as upstream: hook mode
    "preload" (``TMS_HOOK_MODE``, or ``hook_mode`` set before first use, for "torch"), CPU backup
    retention off."""

    def __init__(self):
        self._impl_ctor_kwargs = {}
        self._impl: Optional[_Impl] = None

    def _ensure_initialized(self):
        if self._impl is None:
            mode = self._impl_ctor_kwargs.get("hook_mode") or _default_hook_mode()
            self._impl = _Impl(shared(mode))
        return self._impl

    @property
    def _saver(self):
        return self._ensure_initialized()._saver

    def region(
        self,
        tag: str = DEFAULT_TAG,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ):
        _validate(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        return self._saver.region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)

    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode="global",
        tag: str = DEFAULT_TAG,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ):
        _validate(enable_cpu_backup, False, cpu_backup_backend)
        return self._saver.cuda_graph(cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup, cpu_backup_backend)

    def disable(self):
        return self._saver.disable()

    def pause(self, tag: Optional[str] = None):
        """Pause ``tag`` (None: every tag). Raises ``tms.TmsError`` if anything stays mapped."""
        self._saver.pause_report(tag)

    def resume(self, tag: Optional[str] = None):
        """Resume ``tag`` (None: every tag). Raises ``tms.TmsError`` if anything stays paused
        (its contents are kept; call again once memory is free)."""
        self._saver.resume_report(tag)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self) -> HookMode:
        impl = self._impl
        return impl._hook_mode if impl is not None else self._impl_ctor_kwargs.get("hook_mode") or _default_hook_mode()

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode):
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode must be 'preload' or 'torch', not {hook_mode!r}")
        if self._impl is not None:
            if self._impl._hook_mode != hook_mode:
                raise RuntimeError(
                    f"hook_mode={hook_mode!r} set after torch_memory_saver started in {self._impl._hook_mode!r} "
                    "mode: set it before the first region/pause/resume"
                )
            return
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        return self._saver.memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        self._saver.memory_margin_bytes = value

    @property
    def retain_cpu_backup(self) -> bool:
        return self._saver.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._saver.retain_cpu_backup = value

    def get_cpu_backup(self, x, zero_copy: bool = False):
        return self._saver.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        self._saver.set_disk_backup_dir(path)
