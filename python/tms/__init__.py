"""tms: pause and resume tagged device memory (CUDA and Ascend) from Python.

``import torch_memory_saver`` (installed with this package) is torch_memory_saver's API, argument
for argument. This module is the same machinery with tms's extras:

- errors raise ``TmsError`` with the hook's code and what was done, instead of being ignored;
- ``pause_report``/``resume_report`` return what happened (counts, bytes, timings, free memory);
- pauses back up only the blocks PyTorch's caching allocator has in use (``set_backup_live_only``);
- ``status()`` lists each tag's active and paused allocations and backup bytes;
- ``library_path()``/``hook_mode()`` say which library serves the process, and how.

Both share one library and one set of MemPools per process (``tms.saver.shared()``, the public
core that ``torch_memory_saver`` is a facade over; docs/architecture.md). The hook
mode is "preload" when LD_PRELOAD names the hook, else "torch" (PyTorch's pluggable allocator).
torch is imported only when a function needs it.
"""

import contextlib
import os
import sys

try:
    import _tms_install_check
except ImportError:  # not installed by the wheel (scripts/install.sh, a checkout)
    _tms_install_check = None
if _tms_install_check is not None:
    # A framework's pin of torch_memory_saver installed over the wheel's files, or
    # `pip uninstall torch_memory_saver` removed them: say so and how to repair, instead of
    # failing later on another library.
    # Not under `python -m tms` (sys.argv[0] is "-m" while Python finds the module): its doctor
    # and library commands must run to diagnose and repair exactly this.
    if sys.argv[:1] != ["-m"]:
        _tms_install_check.refuse_import(os.path.dirname(__file__))

from ._lib import (  # noqa: F401  (re-exported)
    TMS_ERR_CORRUPT,
    TMS_ERR_DRIVER,
    TMS_ERR_INTERNAL,
    TMS_ERR_INVALID,
    TMS_ERR_IO,
    TMS_ERR_NO_DRIVER,
    TMS_ERR_OUT_OF_MEMORY,
    TMS_OK,
    TmsError,
    change_env,
    packaged_hook,
    preload_with,
    preloaded_hook,
)
from .saver import DEFAULT_TAG, shared


__all__ = [
    "TmsError",
    "region",
    "disable",
    "pause",
    "resume",
    "pause_report",
    "resume_report",
    "status",
    "cuda_graph",
    "get_cpu_backup",
    "configure_subprocess",
    "set_memory_margin_bytes",
    "set_retain_cpu_backup",
    "set_verify_restore",
    "set_backup_live_only",
    "set_managed_by",
    "set_disk_backup_dir",
    "library_path",
    "hook_mode",
    "version",
]


def library_path():
    """The path of the hook library serving this process."""
    return shared().library_path


def hook_mode():
    """"preload" (the hook is in LD_PRELOAD) or "torch" (PyTorch's pluggable allocator)."""
    return shared().hook_mode


def version():
    """The hook's version string."""
    return shared().cdll.tms_version().decode()


def region(tag=DEFAULT_TAG, enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
    """Device allocations this thread makes inside the block are tracked under ``tag``: paused
    memory is released, and its contents kept in host memory (``enable_cpu_backup``, backend
    "pinned" or "mmap") or in a file (``enable_disk_backup``) when asked."""
    return shared().region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)


def disable():
    """Allocations inside the block are plain device memory, even inside a region."""
    return shared().disable()


def cuda_graph(
    cuda_graph,
    pool=None,
    stream=None,
    capture_error_mode="global",
    tag=DEFAULT_TAG,
    enable_cpu_backup=False,
    cpu_backup_backend=None,
):
    """Capture ``cuda_graph`` (``torch.cuda.graph``) with its memory tracked under ``tag``."""
    return shared().cuda_graph(cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup, cpu_backup_backend)


def pause_report(tag=None, live_only=None):
    """Pause ``tag`` (None: every tag); returns the report, raises TmsError on failure.
    ``live_only`` (default: ``set_backup_live_only``, from ``TMS_BACKUP_LIVE_ONLY``, on): with
    PyTorch, backups copy only the blocks its caching allocator has in use (``backup_bytes``);
    its free blocks are not copied (``backup_bytes_skipped``) and are undefined after resume."""
    return shared().pause_report(tag, live_only)


def resume_report(tag=None):
    """Resume ``tag`` (None: every tag); returns the report, raises TmsError on failure (nothing
    is lost: what could not be resumed stays paused with its contents, and a later call
    completes it)."""
    return shared().resume_report(tag)


def pause(tag=None):
    shared().pause_report(tag)


def resume(tag=None):
    shared().resume_report(tag)


def status():
    """Per tag: allocations and bytes active/paused, and backup bytes."""
    return shared().status()


def get_cpu_backup(x, zero_copy=False):
    """A CPU tensor holding the backup of device tensor ``x`` (None if it has none)."""
    return shared().get_cpu_backup(x, zero_copy)


def set_memory_margin_bytes(value):
    """Device memory a region allocation must leave free (checked at allocation, as
    torch_memory_saver does; also at resume with TMS_RESUME_KEEPS_MARGIN=1)."""
    shared().memory_margin_bytes = value


def set_retain_cpu_backup(value):
    """Keep the CPU backup readable after resume (default off, as torch_memory_saver)."""
    shared().retain_cpu_backup = value


def set_backup_live_only(value):
    """Whether pauses from Python back up only the live blocks of PyTorch's caching allocator
    (default ``TMS_BACKUP_LIVE_ONLY``, on); off: whole segments, as a pause from outside."""
    shared().backup_live_only = bool(value)


def set_verify_restore(value):
    """Check every restore byte for byte (default TMS_VERIFY_RESTORE, off): pauses made while it
    is on take checksums of their backups, and the next resume compares the restored bytes with
    them and raises TmsError (code TMS_ERR_CORRUPT) naming the allocation, tag and offset where
    they differ. A debugging mode: it reads every restored byte back."""
    shared().verify_restore = value


def set_managed_by(manager):
    """Declare who pauses and resumes this process (a launcher's name and pid; None clears it):
    `tms-ctl pause`/`resume` from anyone else is then refused, naming it, unless `--force`."""
    shared().cdll.tms_set_managed_by(None if manager is None else os.fsencode(manager))


def set_disk_backup_dir(path):
    """The folder of disk backups for the whole process (created if missing; use a real disk)."""
    shared().set_disk_backup_dir(path)


def _hook_for_children():
    """The library a child process should preload: the one serving this process if it is loaded,
    else one in LD_PRELOAD, else the installed one."""
    s = shared()
    if s._handle is not None:
        return s._handle.path
    return preloaded_hook() or packaged_hook("preload")


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside the block preload the hook (exactly one copy)."""
    path = _hook_for_children()
    if path is None:
        raise TmsError(TMS_ERR_NO_DRIVER, "libtms_hook.so not found: set LD_PRELOAD or TMS_LIBRARY")
    with change_env("LD_PRELOAD", preload_with(path, os.environ.get("LD_PRELOAD"))):
        yield


def __getattr__(name):
    if name == "control":
        # Public API, loaded on first use rather than with the package: imported eagerly,
        # `python -m tms.control` found it already loaded and warned on every run.
        import importlib  # noqa: PLC0415

        return importlib.import_module(".control", __name__)
    if name == "memory_margin_bytes":
        return shared().memory_margin_bytes
    if name == "torch_memory_saver":
        # Older code imported the object from here; it is the same singleton.
        import torch_memory_saver  # noqa: PLC0415

        return torch_memory_saver.torch_memory_saver
    raise AttributeError(name)
