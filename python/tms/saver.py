"""The torch side of tms: which library serves the process, and one torch MemPool per region kind.

PyTorch's caching allocator keeps freed blocks for reuse. Without a pool per region kind, a block
cached from a ``weights`` tensor could be handed to a ``kv_cache`` tensor or to code outside any
region, and pausing one tag would release memory a live tensor of another still uses. So every
(tag, CPU backup, disk backup, backup backend, device) gets its own ``MemPool``, as
torch_memory_saver keeps them, and ``disable()`` gets a fresh one each time.

This is tms's public core: ``torch_memory_saver`` (upstream's API) is a facade over it and
imports nothing else of tms but its top-level names. Public here: ``shared()`` (the process's one
``Saver``), ``Saver`` (its ``region``, ``disable``, ``cuda_graph``, ``pause_report``,
``resume_report``, ``status``, ``with_region_config``, ``get_cpu_backup``, the settings
(``backup_live_only`` among them), and
``handle``/``mem_pools`` for code that reaches into torch_memory_saver's ``_impl``),
``HookHandle`` (the loaded library, typed), ``check_region_arguments`` and ``DEFAULT_TAG``.
"""

import contextlib
import ctypes
import os
import sys
import threading

from ._lib import (
    ERRORS,
    TMS_ERR_INVALID,
    TMS_ERR_NO_DRIVER,
    TMS_OK,
    MemRange,
    Report,
    TagStatus,
    TmsError,
    load,
    packaged_hook,
    preloaded_hook,
)

HOOK_MODES = ("preload", "torch")
BACKUP_BACKENDS = ("pinned", "mmap")
DEFAULT_TAG = "default"


def _encode(tag):
    return None if tag is None else tag.encode("utf-8")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _live_only_default():
    """``TMS_BACKUP_LIVE_ONLY`` (default on); a value that is not a boolean warns and keeps it on."""
    value = os.environ.get("TMS_BACKUP_LIVE_ONLY")
    if value is None or value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    print(f"tms: TMS_BACKUP_LIVE_ONLY={value!r} is not a boolean; using 1 (on)", file=sys.stderr)
    return True


def _dead_blocks(segment):
    """The (address, length) of each block the caching allocator holds free in ``segment`` (a
    ``memory_snapshot()`` entry): its blocks lie end to end from the segment's address."""
    at = segment["address"]
    dead = []
    for block in segment["blocks"]:
        if block["state"] == "inactive":
            dead.append((at, block["size"]))
        at += block["size"]
    return dead


def _snapshot(mod, pool_id=None):
    """The caching allocator's segments, of one pool or of all; without the allocation history,
    where this torch can leave it out."""
    try:
        if pool_id is None:
            return mod.memory_snapshot(include_traces=False)
        return mod.memory_snapshot(pool_id, include_traces=False)
    except TypeError:  # an older torch: every segment, each naming its pool
        segments = mod.memory_snapshot()
        if pool_id is None:
            return segments
        return [s for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool_id)]


def _torch():
    import torch  # noqa: PLC0415  (on demand: tms works in programs without torch)

    return torch


def device_module():
    """torch.npu where torch_npu drives an Ascend device, else torch.cuda."""
    torch = _torch()
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return npu
    return torch.cuda


class HookHandle:
    """The loaded library (``cdll``) and the per-thread region settings it keeps."""

    def __init__(self, path):
        self.path = path
        self.cdll = load(path)

    def set_config(self, *, tag, interesting_region, enable_cpu_backup, cpu_backup_backend=None, enable_disk_backup=False):
        cdll = self.cdll
        cdll.tms_set_current_tag(_encode(tag))
        cdll.tms_set_interesting_region(bool(interesting_region))
        cdll.tms_set_enable_cpu_backup(bool(enable_cpu_backup))
        if cpu_backup_backend is not None:
            cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        cdll.tms_set_enable_disk_backup(bool(enable_disk_backup))

    def config(self):
        cdll = self.cdll
        return {
            "tag": (cdll.tms_get_current_tag() or b"").decode("utf-8"),
            "interesting_region": cdll.tms_get_interesting_region(),
            "enable_cpu_backup": cdll.tms_get_enable_cpu_backup(),
            "cpu_backup_backend": (cdll.tms_get_cpu_backup_backend() or b"pinned").decode("utf-8"),
            "enable_disk_backup": cdll.tms_get_enable_disk_backup(),
        }


def check_region_arguments(enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
    if enable_cpu_backup and enable_disk_backup:
        raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in BACKUP_BACKENDS:
        raise ValueError(f"cpu_backup_backend must be one of {BACKUP_BACKENDS}, not {cpu_backup_backend!r}")


class Saver:
    """One process's use of the hook. ``hook_mode``: "preload" (the hook is in LD_PRELOAD and sees
    every cudaMalloc/aclrtMalloc), "torch" (PyTorch's pluggable allocator calls the hook for
    region pools), or None (preload when LD_PRELOAD names the hook, else torch)."""

    def __init__(self, hook_mode=None):
        if hook_mode is not None and hook_mode not in HOOK_MODES:
            raise ValueError(f"hook_mode must be one of {HOOK_MODES}, not {hook_mode!r}")
        self._requested_mode = hook_mode
        self._hook_mode = None
        self._handle = None
        self._mem_pools = {}
        self._pools_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._allocator = None
        self.backup_live_only = _live_only_default()

    # ---- the library -------------------------------------------------------------------------

    def _resolve(self):
        preloaded = preloaded_hook()
        mode = self._requested_mode or ("preload" if preloaded else "torch")
        if mode == "preload":
            if preloaded is None:
                raise TmsError(
                    TMS_ERR_NO_DRIVER,
                    "hook_mode='preload' needs the hook in LD_PRELOAD of this process, set before it "
                    "started: run it as LD_PRELOAD=$(python -m tms library) python ..., or "
                    "start it from a parent inside torch_memory_saver.configure_subprocess(); or "
                    "use hook_mode='torch'",
                )
            return mode, preloaded
        # A hook already in the process serves the pluggable allocator too: a second copy
        # would keep its own allocations, out of reach of the first one's pause.
        path = preloaded or packaged_hook("torch")
        if path is None:
            raise TmsError(
                TMS_ERR_NO_DRIVER,
                "libtms_hook.so not found: install the tms-memory-saver wheel, or set TMS_LIBRARY "
                "to the library (scripts/install.sh PREFIX installs it in PREFIX/lib)",
            )
        return mode, path

    @property
    def handle(self):
        if self._handle is None:
            with self._load_lock:
                if self._handle is None:
                    mode, path = self._resolve()
                    handle = HookHandle(path)
                    self._hook_mode = mode
                    self._handle = handle
        return self._handle

    @property
    def cdll(self):
        return self.handle.cdll

    @property
    def hook_mode(self):
        _ = self.handle
        return self._hook_mode

    @property
    def requested_mode(self):
        return self._requested_mode

    @property
    def library_path(self):
        return self.handle.path

    @property
    def mem_pools(self):
        """The MemPools by region kind (torch_memory_saver's ``_impl._mem_pools``)."""
        return self._mem_pools

    # ---- pools --------------------------------------------------------------------------------

    def _torch_allocator(self, mod):
        """Torch mode: the pluggable allocator over tms_torch_malloc/tms_torch_free (one per
        process: torch keeps the library loaded for its lifetime)."""
        if self._allocator is None:
            torch = _torch()
            if mod is torch.cuda:
                cls = torch.cuda.memory.CUDAPluggableAllocator
            else:
                import torch_npu  # noqa: PLC0415

                cls = torch_npu.npu.memory.NPUPluggableAllocator
            self._allocator = cls(self.library_path, "tms_torch_malloc", "tms_torch_free")
        return self._allocator

    def _new_pool(self, mod):
        if self.hook_mode == "torch":
            return mod.MemPool(allocator=self._torch_allocator(mod).allocator())
        return mod.MemPool()

    def _torch_in_use(self):
        """Whether allocations of this block go through torch: in preload mode only a program
        that imported torch needs pools (a C program's cudaMalloc reaches the hook directly)."""
        if "torch" not in sys.modules and self.hook_mode != "torch":
            return None
        try:
            mod = device_module()
        except ImportError:
            return None
        return mod if mod.is_available() else None

    @contextlib.contextmanager
    def _pool(self, key):
        mod = self._torch_in_use()
        if mod is None:
            yield
            return
        if key is None:
            pool = self._new_pool(mod)
        else:
            key = key + (mod.current_device(),)
            with self._pools_lock:
                pool = self._mem_pools.get(key)
                if pool is None:
                    pool = self._mem_pools[key] = self._new_pool(mod)
        with mod.use_mem_pool(pool):
            yield

    # ---- regions ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend=None, enable_disk_backup=False):
        """The hook's per-thread settings for the block, restored afterwards (no pool)."""
        handle = self.handle
        before = handle.config()
        handle.set_config(
            tag=tag,
            interesting_region=True,
            enable_cpu_backup=enable_cpu_backup,
            cpu_backup_backend=cpu_backup_backend,
            enable_disk_backup=enable_disk_backup,
        )
        try:
            yield
        finally:
            handle.set_config(**before)

    @contextlib.contextmanager
    def region(self, tag=DEFAULT_TAG, enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        check_region_arguments(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        backend = ""
        if enable_cpu_backup:
            backend = cpu_backup_backend or self.handle.config()["cpu_backup_backend"]
        key = (tag, bool(enable_cpu_backup), bool(enable_disk_backup), backend)
        with self._pool(key):
            with self.with_region_config(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside the block are plain device memory, even inside a region."""
        cdll = self.cdll
        before = cdll.tms_get_interesting_region()
        cdll.tms_set_interesting_region(False)
        try:
            with self._pool(None):
                yield
        finally:
            cdll.tms_set_interesting_region(before)

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode="global",
        tag=DEFAULT_TAG,
        enable_cpu_backup=False,
        cpu_backup_backend=None,
    ):
        """``torch.cuda.graph`` whose memory (the graph's private pool) is tracked under ``tag``."""
        check_region_arguments(enable_cpu_backup, False, cpu_backup_backend)
        if self.hook_mode != "preload":
            # The graph's private pool allocates with the caching allocator's own cudaMalloc,
            # which only an LD_PRELOADed hook sees.
            raise TmsError(TMS_ERR_INVALID, "cuda_graph() needs hook_mode='preload' (the hook in LD_PRELOAD)")
        torch = _torch()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self.with_region_config(tag, enable_cpu_backup, cpu_backup_backend):
                yield

    # ---- pause and resume ---------------------------------------------------------------------

    def _finish_queued_work(self):
        """The caller's kernels on its current stream finish before their memory goes. Only the
        current stream: a device-wide synchronize would also wait for communication streams,
        which may be blocked on a peer that is itself waiting for this process to pause."""
        mod = sys.modules.get("torch") and self._torch_in_use()
        if mod is not None and getattr(mod, "is_initialized", lambda: True)():
            mod.current_stream().synchronize()

    def _operation(self, fn, tag):
        report = Report()
        code = fn(_encode(tag), ctypes.byref(report))
        out = report.as_dict()
        if code != TMS_OK:
            what = "pause" if fn is self.cdll.tms_pause_report else "resume"
            raise TmsError(
                code,
                f"{what}({tag!r}): {ERRORS.get(code, 'error')} (code {code}, vendor code {report.driver_error}); "
                f"{report.allocations_done} done, {report.allocations_failed} failed "
                f"({report.bytes_failed} bytes), {report.allocations_skipped} already so. Nothing is "
                "lost: what failed keeps its contents, and calling again completes it",
                out,
            )
        return out

    def _mark_dead_blocks(self, tag):
        """Tells the hook which bytes of the segments this pause takes are free blocks of the
        caching allocator, so that their backups copy only the live ones. Every tag: every
        segment the allocator holds (regions of the default pool too, when the whole process is
        tracked); one tag: the segments of its pools. A segment that is no region allocation is
        refused by the hook and left alone. Best effort: a failure here costs only bytes copied."""
        mod = self._torch_in_use()
        if mod is None or not getattr(mod, "is_initialized", lambda: True)():
            return
        if tag is None:
            segments = _snapshot(mod)
        else:
            with self._pools_lock:
                pools = [pool for key, pool in self._mem_pools.items() if key[0] == tag]
            segments = [s for pool in pools for s in _snapshot(mod, pool.id)]
        mark = self.cdll.tms_mark_dead
        for segment in segments:
            dead = _dead_blocks(segment)
            if dead:
                mark((MemRange * len(dead))(*dead), len(dead))

    def pause_report(self, tag=None, live_only=None):
        """Pauses ``tag`` (None: every tag). ``live_only`` (default ``backup_live_only``, from
        ``TMS_BACKUP_LIVE_ONLY``): backups copy only the blocks PyTorch's caching allocator has
        in use; its free blocks come back with undefined contents, as after ``empty_cache``."""
        self._finish_queued_work()
        if self.backup_live_only if live_only is None else live_only:
            self._mark_dead_blocks(tag)
        return self._operation(self.cdll.tms_pause_report, tag)

    def resume_report(self, tag=None):
        return self._operation(self.cdll.tms_resume_report, tag)

    def status(self):
        cdll = self.cdll
        n = ctypes.c_size_t(0)
        cdll.tms_status(None, 0, ctypes.byref(n))
        arr = (TagStatus * max(n.value, 1))()
        cdll.tms_status(arr, n.value, ctypes.byref(n))
        fields = [name for name, _ in TagStatus._fields_ if name != "tag"]
        return [{"tag": arr[i].tag.decode(), **{f: getattr(arr[i], f) for f in fields}} for i in range(n.value)]

    # ---- settings and backups -----------------------------------------------------------------

    @property
    def memory_margin_bytes(self):
        return self.cdll.tms_get_memory_margin_bytes()

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        value = int(value)
        if value < 0:
            raise ValueError(f"memory_margin_bytes must be >= 0, not {value}")
        self.cdll.set_memory_margin_bytes(value)

    @property
    def retain_cpu_backup(self):
        return bool(self.cdll.tms_get_retain_cpu_backup())

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        self.cdll.tms_set_retain_cpu_backup(bool(value))

    @property
    def verify_restore(self):
        return bool(self.cdll.tms_get_verify_restore())

    @verify_restore.setter
    def verify_restore(self, value):
        self.cdll.tms_set_verify_restore(bool(value))

    def set_disk_backup_dir(self, path):
        os.makedirs(path, exist_ok=True)
        self.cdll.tms_set_disk_backup_dir(os.fsencode(path))

    def get_cpu_backup(self, x, zero_copy=False):
        """A CPU tensor with the backup of device tensor ``x`` while it is paused with a backup
        (or retained after resume), else None. ``zero_copy``: a view of the backup itself, valid
        until the next resume or free."""
        torch = _torch()
        if x.device.type not in ("cuda", "npu"):
            raise ValueError(f"get_cpu_backup needs a device tensor, not one on {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"get_cpu_backup needs a contiguous tensor ({tuple(x.shape)}, stride {x.stride()})")
        nbytes = x.numel() * x.element_size()
        ptr = self.cdll.tms_get_cpu_backup_pointer(ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_uint8)), nbytes)
        if not ptr or nbytes == 0:
            return None
        buf = (ctypes.c_uint8 * nbytes).from_address(ctypes.addressof(ptr.contents))
        out = torch.frombuffer(buf, dtype=torch.uint8).view(x.dtype).view(x.shape)
        return out if zero_copy else out.clone()


_shared = None
_shared_lock = threading.Lock()


def shared(hook_mode=None):
    """The process's Saver. Asking for a mode after it was settled otherwise is an error: the
    library and pools of one mode cannot serve the other."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Saver(hook_mode)
        elif hook_mode is not None:
            settled = _shared._hook_mode or _shared.requested_mode
            if settled is not None and settled != hook_mode:
                raise TmsError(
                    TMS_ERR_INVALID,
                    f"hook_mode={hook_mode!r} asked for, but this process already uses {settled!r}; "
                    "set torch_memory_saver.hook_mode before the first region/pause/resume",
                )
            if settled is None:
                _shared._requested_mode = hook_mode
        return _shared
