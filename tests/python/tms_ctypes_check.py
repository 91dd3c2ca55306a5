"""Binds libtms_hook.so exactly as torch_memory_saver's Python wrapper does (same names, argtypes
and restypes: tms's own package states them once, TORCH_MEMORY_SAVER_API) and nothing more, then
drives a region, pause and resume through them on the simulator.

Run with LD_PRELOAD=<libtms_hook.so>, the simulator on LD_LIBRARY_PATH and python/ on PYTHONPATH.
Exits 0 when every check holds; prints what failed otherwise."""
import ctypes
import os
import sys

from tms._lib import TORCH_MEMORY_SAVER_API, bind

MiB = 1 << 20


def preloaded_library():
    # torch_memory_saver's rule: exactly one LD_PRELOAD entry naming the library.
    entries = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    hooks = [p for p in entries if "tms_hook" in p or "torch_memory_saver" in p]
    assert len(hooks) == 1, f"expected one hook library in LD_PRELOAD, got {entries}"
    return ctypes.CDLL(hooks[0])


def main():
    lib = bind(preloaded_library(), TORCH_MEMORY_SAVER_API)
    cudart = ctypes.CDLL("libcudart.so.12")  # dlopen + dlsym(handle): the interposed path
    size_t = ctypes.c_size_t

    def free_mem():
        f, t = size_t(), size_t()
        assert cudart.cudaMemGetInfo(ctypes.byref(f), ctypes.byref(t)) == 0
        return f.value

    # The wrapper's region entry sequence.
    lib.tms_set_current_tag(b"py")
    lib.tms_set_interesting_region(True)
    lib.tms_set_enable_cpu_backup(True)
    lib.tms_set_cpu_backup_backend(b"pinned")
    lib.tms_set_enable_disk_backup(False)
    assert lib.tms_get_current_tag() == b"py"
    assert lib.tms_get_interesting_region() is True
    assert lib.tms_get_enable_cpu_backup() is True
    assert lib.tms_get_cpu_backup_backend() == b"pinned"
    # Retention is off by default, as upstream's.
    assert lib.tms_get_retain_cpu_backup() is False

    ptr = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(ptr), size_t(4 * MiB)) == 0
    lib.tms_set_interesting_region(False)
    payload = bytes((i * 7 + 3) % 256 for i in range(4 * MiB))
    src = ctypes.create_string_buffer(payload, len(payload))
    assert cudart.cudaMemcpy(ptr, src, size_t(len(payload)), 1) == 0
    before = free_mem()
    assert lib.tms_pause(b"py") == 0
    assert free_mem() - before == 4 * MiB, "pause did not free the allocation"
    assert lib.tms_pause(b"py") == 0, "a second pause must be a no-op, not an error"
    gpu = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8))
    backup = lib.tms_get_cpu_backup_pointer(gpu, 4 * MiB)
    assert ctypes.string_at(backup, 64) == payload[:64], "backup pointer does not hold the contents"
    assert lib.tms_resume(None) == 0
    assert free_mem() == before
    dst = ctypes.create_string_buffer(len(payload))
    assert cudart.cudaMemcpy(dst, ptr, size_t(len(payload)), 2) == 0
    assert dst.raw == payload, "contents changed across pause/resume"
    assert not lib.tms_get_cpu_backup_pointer(gpu, 4 * MiB), "a resumed allocation's backup must not be handed out"
    # Retention is decided at resume, as upstream: switching it on afterwards exposes nothing.
    lib.tms_set_retain_cpu_backup(True)
    assert not lib.tms_get_cpu_backup_pointer(gpu, 4 * MiB)
    assert lib.tms_pause(b"py") == 0 and lib.tms_resume(b"py") == 0
    lib.tms_set_retain_cpu_backup(False)
    kept = lib.tms_get_cpu_backup_pointer(gpu, 4 * MiB)
    assert kept and ctypes.string_at(kept, 64) == payload[:64], "a backup retained at resume is handed out"
    assert lib.tms_pause(b"py") == 0 and lib.tms_resume(b"py") == 0
    assert not lib.tms_get_cpu_backup_pointer(gpu, 4 * MiB), "a resume without retention ends it"
    lib.set_memory_margin_bytes(123)
    assert cudart.cudaFree(ptr) == 0
    print("ctypes ok")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
