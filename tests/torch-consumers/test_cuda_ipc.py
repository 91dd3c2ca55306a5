"""CUDA IPC on the simulator when the exporter frees what it shared: the importer keeps the
pages it opened until it closes its handle, and the exporter's next allocation is other memory
(CUDA Runtime API, cudaIpcGetMemHandle: memory freed and allocated again at the same address gets
a new, unique handle; cudaIpcCloseMemHandle releases the importer's mapping)."""

import json

import pytest
from conftest import REAL_DEVICE

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only: a GPU run needs two processes on one device")

EXPORTER = r"""
import ctypes, json, os, struct, subprocess, sys
cudart = ctypes.CDLL("libcudart.so.13")
N = 4 << 20
class Handle(ctypes.Structure):  # cudaIpcMemHandle_t, 64 bytes, passed by value
    _fields_ = [("reserved", ctypes.c_uint8 * 64)]

def filled(value):
    p = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(p), N) == 0
    assert cudart.cudaMemset(p, value, N) == 0
    h = Handle()
    assert cudart.cudaIpcGetMemHandle(ctypes.byref(h), p) == 0
    return p, bytes(h.reserved).hex()

IMPORTER = '''
import ctypes, sys
cudart = ctypes.CDLL("libcudart.so.13")
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint8 * 64)]
N = 4 << 20
opened = {}
def read(p):
    buf = ctypes.create_string_buffer(N)
    assert cudart.cudaMemcpy(buf, p, N, 2) == 0
    return sorted(set(buf.raw))
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "open":
        p = ctypes.c_void_p()
        rc = cudart.cudaIpcOpenMemHandle(ctypes.byref(p), Handle((ctypes.c_uint8 * 64)(*bytes.fromhex(arg))), 1)
        opened[arg] = p
        print(rc, read(p) if rc == 0 else None, flush=True)
    elif cmd == "read":
        print(0, read(opened[arg]), flush=True)
    elif cmd == "close":
        print(cudart.cudaIpcCloseMemHandle(opened.pop(arg)), None, flush=True)
'''
importer = subprocess.Popen([sys.executable, "-c", IMPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
def ask(cmd, arg):
    importer.stdin.write(f"{cmd} {arg}\n")
    importer.stdin.flush()
    rc, values = importer.stdout.readline().split(" ", 1)
    return [int(rc), json.loads(values.replace("None", "null"))]

out = {}
old, old_handle = filled(0x11)
out["opened"] = ask("open", old_handle)
# The exporter frees the shared memory and allocates again (a release and a remap): the pool
# range the simulator freed first is the one it hands out next, unless the importer holds it.
assert cudart.cudaFree(old) == 0
new, new_handle = filled(0x22)
out["same_address"] = new.value == old.value
out["new_handle_differs"] = new_handle != old_handle
out["importer_after_release"] = ask("read", old_handle)
out["new_memory_opened"] = ask("open", new_handle)
out["closed"] = ask("close", old_handle)
out["new_memory_after_close"] = ask("read", new_handle)
importer.stdin.close()
importer.wait()
print(json.dumps(out))
"""


def test_an_importer_keeps_the_pages_it_opened_after_the_exporter_frees_them(sim):
    proc = sim.python(EXPORTER, devices=1, memory="1GiB", timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["opened"] == [0, [0x11]], out
    assert out["new_handle_differs"], out
    # Neither zeros (pages given back) nor the exporter's new bytes: the old pages.
    assert out["importer_after_release"] == [0, [0x11]], out
    assert out["new_memory_opened"] == [0, [0x22]], out
    assert out["closed"][0] == 0, out
    assert out["new_memory_after_close"] == [0, [0x22]], out


REGION_EXPORTS = r"""
import ctypes, json
hook = ctypes.CDLL(None)  # the preloaded hook's API
hook.tms_set_current_tag.argtypes = [ctypes.c_char_p]
cudart = ctypes.CDLL("libcudart.so.13")
acl = ctypes.CDLL("libascendcl.so")
nccl = ctypes.CDLL("libnccl.so.2")
acl.aclrtIpcMemGetExportKey.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
nccl.ncclCommWindowRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int]
N = 4 << 20
assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0

def both(region):
    hook.tms_set_interesting_region(region)
    hook.tms_set_current_tag(b"weights" if region else None)
    c, a = ctypes.c_void_p(), ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(c), N) == 0
    assert acl.aclrtMalloc(ctypes.byref(a), N, 0) == 0
    hook.tms_set_interesting_region(False)
    return c, a

out = {}
for name, region in (("plain", False), ("region", True)):
    c, a = both(region)
    handle = (ctypes.c_uint8 * 64)()
    key = ctypes.create_string_buffer(65)
    win = ctypes.c_void_p()
    out[name] = {
        "cuda_ipc": cudart.cudaIpcGetMemHandle(handle, c),
        "acl_key": acl.aclrtIpcMemGetExportKey(a, N, key, 65, 0),
        "nccl_window": nccl.ncclCommWindowRegister(None, c, N, ctypes.byref(win), 0),
    }
print(json.dumps(out))
"""


def test_the_hook_refuses_exports_of_region_memory_naming_the_tag(sim):
    # An importer of region memory would keep the pages a pause releases (the test above: an
    # importer keeps what it opened). Devices already refuse to export virtual-memory allocations;
    # the hook refuses every export call on region memory itself, whatever the driver does, and
    # names the tag and the fix. Memory outside regions is exported as before.
    proc = sim.python(REGION_EXPORTS, devices=1, memory="1GiB", timeout=120, preload=sim.hook)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"]["cuda_ipc"] == 0 and out["plain"]["acl_key"] == 0, out
    # cudaErrorInvalidValue, ACL_ERROR_RT_PARAM_INVALID, ncclInvalidUsage.
    assert out["region"] == {"cuda_ipc": 1, "acl_key": 107000, "nccl_window": 5}, out
    for call in ("cudaIpcGetMemHandle", "aclrtIpcMemGetExportKey", "ncclCommWindowRegister"):
        said = [line for line in proc.stderr.splitlines() if f"{call}(" in line and "refused" in line]
        assert len(said) == 1, f"{call}: {said}\n{proc.stderr}"
        assert "tag 'weights'" in said[0] and "outside" in said[0], said[0]
