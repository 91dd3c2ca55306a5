"""Finding libtms_hook.so and binding its C API with ctypes.

The hook is one library for every CUDA major and for Ascend; the wheel installs it under each file
name torch_memory_saver's users look for (slime builds LD_PRELOAD from these names), and
scripts/install.sh links the same names to ``libtms_hook.so``.
"""

import contextlib
import ctypes
import os
import threading
from pathlib import Path

# Substrings that mark an LD_PRELOAD entry as the hook (ours, or a copy under upstream's names).
HOOK_MARKERS = ("tms_hook", "torch_memory_saver")

# torch_memory_saver's library names, in the order we look for them (the copies are identical).
PRELOAD_NAMES = (
    "torch_memory_saver_hook_mode_preload.abi3.so",
    "torch_memory_saver_hook_mode_preload_cu13.abi3.so",
    "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
)
TORCH_NAMES = (
    "torch_memory_saver_hook_mode_torch.abi3.so",
    "torch_memory_saver_hook_mode_torch_cu13.abi3.so",
    "torch_memory_saver_hook_mode_torch_cu12.abi3.so",
)

# include/tms.h's codes (held to tms-proto/src/abi.rs by tests/tests/abi.rs).
TMS_OK = 0
TMS_ERR_INVALID = 1
TMS_ERR_OUT_OF_MEMORY = 2
TMS_ERR_DRIVER = 3
TMS_ERR_NO_DRIVER = 4
TMS_ERR_INTERNAL = 5
TMS_ERR_IO = 6
TMS_ERR_CORRUPT = 7

ERRORS = {
    TMS_ERR_INVALID: "invalid argument",
    TMS_ERR_OUT_OF_MEMORY: "out of device memory",
    TMS_ERR_DRIVER: "a driver call failed",
    TMS_ERR_NO_DRIVER: "no CUDA or Ascend driver could be loaded",
    TMS_ERR_INTERNAL: "internal error in tms",
    TMS_ERR_IO: "a disk backup could not be read or written",
    TMS_ERR_CORRUPT: "a resume did not bring back the bytes the pause saved (restore verification)",
}


class TmsError(RuntimeError):
    """A tms call failed. ``code`` is TMS_ERR_*; ``report`` (when present) says what was done."""

    def __init__(self, code, message, report=None):
        super().__init__(message)
        self.code = code
        self.report = report


class Report(ctypes.Structure):
    """``tms_report`` of include/tms.h (tests/tests/abi.rs holds it to tms-proto/src/abi.rs)."""

    _fields_ = [
        ("error", ctypes.c_int32),
        ("driver_error", ctypes.c_int32),
        ("allocations_done", ctypes.c_uint64),
        ("bytes_done", ctypes.c_uint64),
        ("allocations_skipped", ctypes.c_uint64),
        ("bytes_skipped", ctypes.c_uint64),
        ("allocations_failed", ctypes.c_uint64),
        ("bytes_failed", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
        ("elapsed_ns", ctypes.c_uint64),
        ("device_free_before", ctypes.c_uint64),
        ("device_free_after", ctypes.c_uint64),
        ("device_total", ctypes.c_uint64),
        ("backup_ns", ctypes.c_uint64),
        ("backup_bytes_skipped", ctypes.c_uint64),
    ]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class TagStatus(ctypes.Structure):
    """``tms_tag_status`` of include/tms.h (held to tms-proto/src/abi.rs as ``Report`` is)."""

    _fields_ = [
        ("tag", ctypes.c_char_p),
        ("allocations_active", ctypes.c_uint64),
        ("allocations_paused", ctypes.c_uint64),
        ("bytes_active", ctypes.c_uint64),
        ("bytes_paused", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
    ]


class MemRange(ctypes.Structure):
    """``tms_range`` of include/tms.h: bytes at a device address, as ``tms_mark_dead`` takes them."""

    _fields_ = [
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
    ]


_c_bool, _c_char_p, _c_int, _c_uint64 = ctypes.c_bool, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64
_u8p = ctypes.POINTER(ctypes.c_uint8)

# torch_memory_saver's functions, typed exactly as its Python wrapper types them: what a library
# must serve for torch_memory_saver to import and run (tests/python/tms_ctypes_check.py binds
# only these).
TORCH_MEMORY_SAVER_API = {
    "tms_set_interesting_region": ([_c_bool], None),
    "tms_get_interesting_region": ([], _c_bool),
    "tms_set_current_tag": ([_c_char_p], None),
    "tms_get_current_tag": ([], _c_char_p),
    "tms_get_enable_cpu_backup": ([], _c_bool),
    "tms_set_enable_cpu_backup": ([_c_bool], None),
    "tms_get_cpu_backup_backend": ([], _c_char_p),
    "tms_set_cpu_backup_backend": ([_c_char_p], None),
    "tms_get_enable_disk_backup": ([], _c_bool),
    "tms_set_enable_disk_backup": ([_c_bool], None),
    "tms_set_disk_backup_dir": ([_c_char_p], None),
    "set_memory_margin_bytes": ([_c_uint64], None),
    "tms_set_retain_cpu_backup": ([_c_bool], None),
    "tms_get_retain_cpu_backup": ([], _c_bool),
    "tms_pause": ([_c_char_p], _c_int),
    "tms_resume": ([_c_char_p], _c_int),
    "tms_get_cpu_backup_pointer": ([_u8p, _c_uint64], _u8p),
}

# tms's own functions (include/tms.h).
TMS_API = {
    "tms_get_memory_margin_bytes": ([], _c_uint64),
    "tms_set_verify_restore": ([_c_bool], None),
    "tms_set_managed_by": ([_c_char_p], None),
    "tms_get_verify_restore": ([], _c_bool),
    "tms_pause_report": ([_c_char_p, ctypes.POINTER(Report)], _c_int),
    "tms_resume_report": ([_c_char_p, ctypes.POINTER(Report)], _c_int),
    "tms_status": ([ctypes.POINTER(TagStatus), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)], _c_int),
    "tms_release_cpu_backups": ([ctypes.POINTER(_c_uint64)], _c_int),
    "tms_mark_dead": ([ctypes.POINTER(MemRange), ctypes.c_size_t], _c_int),
    "tms_strerror": ([_c_int], _c_char_p),
    "tms_version": ([], _c_char_p),
}


def _preload_entries():
    # ld.so splits LD_PRELOAD on colons and spaces.
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def preloaded_hook():
    """The hook named in LD_PRELOAD, or None. Two entries naming different files are refused:
    each would be a separate copy of the hook with its own state, and which one a cudaMalloc
    reaches is not what the program asked for."""
    hits = [p for p in _preload_entries() if any(m in os.path.basename(p) for m in HOOK_MARKERS)]
    distinct = {os.path.realpath(p) for p in hits}
    if len(distinct) > 1:
        raise TmsError(
            TMS_ERR_INVALID,
            f"LD_PRELOAD names {len(hits)} different tms/torch_memory_saver libraries: {hits}. "
            "Keep exactly one (configure_subprocess() replaces any it finds instead of adding another).",
        )
    return hits[0] if hits else None


def _search_dirs():
    here = Path(__file__).resolve().parent
    return [
        here,  # a copy next to the package
        here.parent,  # site-packages itself, where the wheel puts torch_memory_saver's names
        here.parent.parent,  # PREFIX/lib/python/tms -> PREFIX/lib (scripts/install.sh)
        here.parent.parent.parent,  # PREFIX/lib/pythonX.Y/site-packages/tms -> PREFIX/lib
    ]


def packaged_hook(mode="preload"):
    """The installed hook for ``mode`` ("preload" or "torch"): ``$TMS_LIBRARY`` if set, else the
    wheel's copy under torch_memory_saver's names, else ``libtms_hook.so`` of an install prefix."""
    explicit = os.environ.get("TMS_LIBRARY")
    if explicit:
        if not os.path.isfile(explicit):
            raise TmsError(TMS_ERR_NO_DRIVER, f"TMS_LIBRARY={explicit!r} is not a file")
        return os.path.abspath(explicit)
    names = (PRELOAD_NAMES if mode == "preload" else TORCH_NAMES) + ("libtms_hook.so",)
    for d in _search_dirs():
        for n in names:
            if (d / n).is_file():
                return str(d / n)
    return None


def preload_with(path, current):
    """LD_PRELOAD with ``path`` first and no other hook entry: two copies of the hook in one
    process would each keep their own allocations."""
    others = [
        p
        for p in (current or "").replace(" ", ":").split(":")
        if p and p != path and not any(m in os.path.basename(p) for m in HOOK_MARKERS)
    ]
    return ":".join([path] + others)


@contextlib.contextmanager
def change_env(key, value):
    """``os.environ[key] = value`` for the block, restored (or removed) afterwards."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


_libs = {}
_libs_lock = threading.Lock()


def load(path):
    """The hook at ``path`` with its C API typed. A library already in the process (LD_PRELOAD)
    is the same instance: dlopen hands back the loaded copy."""
    with _libs_lock:
        lib = _libs.get(path)
        if lib is None:
            lib = ctypes.CDLL(path)
            bind(lib, {**TORCH_MEMORY_SAVER_API, **TMS_API})
            _libs[path] = lib
        return lib


def bind(lib, api):
    """Types ``api``'s functions of ``lib`` and returns it. A function ``lib`` lacks raises
    AttributeError, which is what breaks torch_memory_saver's import on a library without it."""
    for name, (args, res) in api.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib
