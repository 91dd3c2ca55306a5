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
