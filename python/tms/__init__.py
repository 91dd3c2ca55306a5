"""torch_memory_saver's Python API over libtms_hook.so.

The library is found the way torch_memory_saver finds its own: the one LD_PRELOAD entry naming
``tms_hook`` or ``torch_memory_saver`` (preload mode; ctypes then reuses the preloaded copy, so
settings made here and the interposed allocators share one thread-local state), else
``$TMS_LIBRARY``, else ``libtms_hook.so`` next to this package or in an install prefix (torch
mode, where PyTorch's pluggable allocator calls ``tms_torch_malloc``/``tms_torch_free``).

Differences from torch_memory_saver: errors raise ``TmsError`` with the hook's code instead of
killing the process; pause/resume are idempotent; ``pause_report``/``resume_report``/``status``
tell what happened.
"""

import contextlib
import ctypes
import os
import threading

from . import control  # noqa: F401  (tms.control is part of the public API)

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
    "library_path",
    "hook_mode",
    "torch_memory_saver",
    "TorchMemorySaver",
]

TMS_OK = 0
_ERRORS = {
    1: "invalid argument",
    2: "out of device memory",
    3: "a driver call failed",
    4: "no CUDA or Ascend driver could be loaded",
    5: "internal error in tms",
}


class TmsError(RuntimeError):
    """A tms call failed. ``code`` is TMS_ERR_*; ``report`` (when present) says what was done."""

    def __init__(self, code, message, report=None):
        super().__init__(message)
        self.code = code
        self.report = report


class _Report(ctypes.Structure):
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
    ]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class _TagStatus(ctypes.Structure):
    _fields_ = [
        ("tag", ctypes.c_char_p),
        ("allocations_active", ctypes.c_uint64),
        ("allocations_paused", ctypes.c_uint64),
        ("bytes_active", ctypes.c_uint64),
        ("bytes_paused", ctypes.c_uint64),
        ("backup_bytes", ctypes.c_uint64),
    ]


_COMPAT_NAMES = ("tms_hook", "torch_memory_saver")


def _preloaded():
    entries = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    hits = [p for p in entries if any(n in os.path.basename(p) for n in _COMPAT_NAMES)]
    if len(hits) > 1:
        raise TmsError(1, f"LD_PRELOAD names the hook more than once: {hits}")
    return hits[0] if hits else None


def _installed():
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [
        os.environ.get("TMS_LIBRARY"),
        os.path.join(here, "libtms_hook.so"),
        os.path.join(here, "..", "..", "libtms_hook.so"),  # PREFIX/lib/python/tms (scripts/install.sh)
        os.path.join(here, "..", "..", "..", "libtms_hook.so"),  # PREFIX/lib/pythonX.Y/site-packages/tms
    ]
    for c in candidates:
        if c and os.path.isfile(c):
            return os.path.abspath(c)
    return None


_lock = threading.Lock()
_lib = None
_path = None
_mode = None


def _load():
    global _lib, _path, _mode
    with _lock:
        if _lib is not None:
            return _lib
        path = _preloaded()
        mode = "preload"
        if path is None:
            path = _installed()
            mode = "torch"
        if path is None:
            raise TmsError(
                4,
                "libtms_hook.so not found: set LD_PRELOAD to it (preload mode), or TMS_LIBRARY "
                "(torch mode); scripts/install.sh PREFIX installs it",
            )
        lib = ctypes.CDLL(path)
        _bind(lib)
        _lib, _path, _mode = lib, path, mode
        return lib


def _bind(lib):
    c_bool, c_char_p, c_int, c_uint64 = ctypes.c_bool, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64
    u8p = ctypes.POINTER(ctypes.c_uint8)
    spec = {
        "tms_set_interesting_region": ([c_bool], None),
        "tms_get_interesting_region": ([], c_bool),
        "tms_set_current_tag": ([c_char_p], None),
        "tms_get_current_tag": ([], c_char_p),
        "tms_get_enable_cpu_backup": ([], c_bool),
        "tms_set_enable_cpu_backup": ([c_bool], None),
        "tms_get_cpu_backup_backend": ([], c_char_p),
        "tms_set_cpu_backup_backend": ([c_char_p], None),
        "tms_set_enable_disk_backup": ([c_bool], None),
        "set_memory_margin_bytes": ([c_uint64], None),
        "tms_get_memory_margin_bytes": ([], c_uint64),
        "tms_set_retain_cpu_backup": ([c_bool], None),
        "tms_get_retain_cpu_backup": ([], c_bool),
        "tms_pause": ([c_char_p], c_int),
        "tms_resume": ([c_char_p], c_int),
        "tms_pause_report": ([c_char_p, ctypes.POINTER(_Report)], c_int),
        "tms_resume_report": ([c_char_p, ctypes.POINTER(_Report)], c_int),
        "tms_status": ([ctypes.POINTER(_TagStatus), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)], c_int),
        "tms_release_cpu_backups": ([ctypes.POINTER(c_uint64)], c_int),
        "tms_get_cpu_backup_pointer": ([u8p, c_uint64], u8p),
        "tms_strerror": ([c_int], c_char_p),
        "tms_version": ([], c_char_p),
    }
    for name, (args, res) in spec.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def library_path():
    """The path of the library in use."""
    _load()
    return _path


def hook_mode():
    """"preload" (LD_PRELOAD) or "torch" (pluggable allocator)."""
    _load()
    return _mode


def _tag(tag):
    return None if tag is None else tag.encode()


@contextlib.contextmanager
def region(tag="default", enable_cpu_backup=False):
    """Device allocations made by this thread inside the block are tracked under ``tag`` (and
    copied to host memory on pause when ``enable_cpu_backup``)."""
    lib = _load()
    prev = (lib.tms_get_interesting_region(), lib.tms_get_current_tag(), lib.tms_get_enable_cpu_backup())
    lib.tms_set_current_tag(_tag(tag))
    lib.tms_set_interesting_region(True)
    lib.tms_set_enable_cpu_backup(bool(enable_cpu_backup))
    try:
        with _region_pool((tag, bool(enable_cpu_backup))):
            yield
    finally:
        lib.tms_set_interesting_region(prev[0])
        lib.tms_set_current_tag(prev[1])
        lib.tms_set_enable_cpu_backup(prev[2])


@contextlib.contextmanager
def disable():
    """Allocations inside the block are not tracked, even inside a region."""
    lib = _load()
    prev = lib.tms_get_interesting_region()
    lib.tms_set_interesting_region(False)
    try:
        with _region_pool(None):
            yield
    finally:
        lib.tms_set_interesting_region(prev)


def _operation(fn, tag):
    report = _Report()
    code = fn(_tag(tag), ctypes.byref(report))
    out = report.as_dict()
    if code != TMS_OK:
        raise TmsError(code, f"{_ERRORS.get(code, 'error')} (code {code}, vendor code {report.driver_error})", out)
    return out


def pause_report(tag=None):
    """Pause ``tag`` (None: every tag); returns the report, raises TmsError on failure."""
    return _operation(_load().tms_pause_report, tag)


def resume_report(tag=None):
    """Resume ``tag`` (None: every tag); returns the report, raises TmsError on failure (nothing is
    lost: what could not be resumed stays paused, and a later call completes it)."""
    return _operation(_load().tms_resume_report, tag)


def pause(tag=None):
    _sync_torch()
    pause_report(tag)


def resume(tag=None):
    resume_report(tag)


def status():
    """Per tag: allocations and bytes active/paused, and backup bytes."""
    lib = _load()
    n = ctypes.c_size_t(0)
    lib.tms_status(None, 0, ctypes.byref(n))
    arr = (_TagStatus * max(n.value, 1))()
    lib.tms_status(arr, n.value, ctypes.byref(n))
    return [
        {
            "tag": arr[i].tag.decode(),
            "allocations_active": arr[i].allocations_active,
            "allocations_paused": arr[i].allocations_paused,
            "bytes_active": arr[i].bytes_active,
            "bytes_paused": arr[i].bytes_paused,
            "backup_bytes": arr[i].backup_bytes,
        }
        for i in range(n.value)
    ]


class _Margin:
    def __get__(self, obj, owner=None):
        return _load().tms_get_memory_margin_bytes()

    def __set__(self, obj, value):
        _load().set_memory_margin_bytes(int(value))


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside the block get the hook in LD_PRELOAD."""
    path = _path or _preloaded() or _installed()
    if path is None:
        raise TmsError(4, "libtms_hook.so not found: set LD_PRELOAD or TMS_LIBRARY")
    old = os.environ.get("LD_PRELOAD")
    entries = [p for p in (old or "").split(":") if p and p != path]
    os.environ["LD_PRELOAD"] = ":".join([path] + entries)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


# ---- torch-dependent parts (torch imported lazily) ------------------------------------------


def _torch():
    import torch  # noqa: PLC0415  (imported on demand: the package works without torch)

    return torch


def _device_module():
    torch = _torch()
    if getattr(torch, "npu", None) is not None and torch.npu.is_available():
        return torch.npu
    return torch.cuda


def _sync_torch():
    """Finish queued kernels before their memory goes (the hook also synchronizes the device)."""
    import sys

    if "torch" in sys.modules:
        mod = _device_module()
        if mod.is_available():
            mod.synchronize()


# One torch MemPool per (tag, backup flag, device), as torch_memory_saver keeps: PyTorch's caching
# allocator must never hand a cached block of one region to another region, or to code outside
# regions, or a pause would release memory a live tensor of another tag still uses (or miss memory
# it should release). disable() gets a fresh pool each time, as upstream's does.
_pools = {}
_pools_lock = threading.Lock()
_allocator = None


def _torch_allocator(mod):
    """Torch mode: the pluggable allocator over tms_torch_malloc/tms_torch_free (one per process)."""
    global _allocator
    if _allocator is None:
        torch = _torch()
        if mod is torch.cuda:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(_path, "tms_torch_malloc", "tms_torch_free")
        else:
            import torch_npu  # noqa: F401,PLC0415

            _allocator = torch_npu.npu.memory.NPUPluggableAllocator(_path, "tms_torch_malloc", "tms_torch_free")
    return _allocator


@contextlib.contextmanager
def _region_pool(key):
    """Routes the block's allocations through the MemPool of `key` (None: a fresh pool). In preload
    mode nothing is done for programs that never imported torch (the hook sees cudaMalloc itself);
    without torch at all, nothing is done either."""
    import sys

    if "torch" not in sys.modules:
        # Preload mode: a program without torch needs no pool. Torch mode: allocations only go
        # through torch, so import it if it is there at all.
        try:
            if _mode != "torch":
                raise ImportError
            _torch()
        except ImportError:
            yield
            return
    mod = _device_module()
    if not mod.is_available():
        yield
        return
    with _pools_lock:
        pool = _pools.get((key, mod.current_device())) if key is not None else None
        if pool is None:
            pool = mod.MemPool(_torch_allocator(mod).allocator()) if _mode == "torch" else mod.MemPool()
            if key is not None:
                _pools[(key, mod.current_device())] = pool
    with mod.use_mem_pool(pool):
        yield


@contextlib.contextmanager
def cuda_graph(cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default", enable_cpu_backup=False):
    """Capture ``cuda_graph`` with its memory tracked under ``tag`` (torch_memory_saver's
    signature)."""
    torch = _torch()
    with region(tag=tag, enable_cpu_backup=enable_cpu_backup):
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            yield


def get_cpu_backup(x, zero_copy=False):
    """A CPU tensor holding the backup of device tensor ``x`` while it is paused (None if it has
    none). ``zero_copy``: a view of the backup buffer itself, valid until the next resume."""
    torch = _torch()
    lib = _load()
    nbytes = x.numel() * x.element_size()
    ptr = lib.tms_get_cpu_backup_pointer(ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_uint8)), nbytes)
    if not ptr:
        return None
    buf = (ctypes.c_uint8 * nbytes).from_address(ctypes.addressof(ptr.contents))
    out = torch.frombuffer(buf, dtype=torch.uint8).view(x.dtype).view(x.shape)
    return out if zero_copy else out.clone()


class TorchMemorySaver:
    """torch_memory_saver's object API, method for method."""

    memory_margin_bytes = _Margin()

    def region(self, tag="default", enable_cpu_backup=False):
        return region(tag=tag, enable_cpu_backup=enable_cpu_backup)

    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default", enable_cpu_backup=False):
        return globals()["cuda_graph"](cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup)

    def disable(self):
        return disable()

    def pause(self, tag=None):
        pause(tag)

    def resume(self, tag=None):
        resume(tag)

    def get_cpu_backup(self, x, zero_copy=False):
        return get_cpu_backup(x, zero_copy)

    @property
    def enabled(self):
        try:
            _load()
            return True
        except TmsError:
            return False

    @property
    def hook_mode(self):
        return hook_mode()


torch_memory_saver = TorchMemorySaver()


def set_memory_margin_bytes(value):
    """Free device memory to keep on region allocation and resume (``tms.memory_margin_bytes``
    reads it; ``torch_memory_saver.memory_margin_bytes = n`` sets it too)."""
    _load().set_memory_margin_bytes(int(value))


def __getattr__(name):
    if name == "memory_margin_bytes":
        return _load().tms_get_memory_margin_bytes()
    raise AttributeError(name)
