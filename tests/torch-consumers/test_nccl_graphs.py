"""Collectives in CUDA graphs on the simulator: an unchanged torch.distributed program captures
`dist.all_reduce` in `torch.cuda.graph` and replays it, as SGLang's decode graphs do with their
tensor-parallel all-reduce (NCCL user guide, "CUDA Graphs": collectives can be captured since
NCCL 2.9, and every rank captures and replays the same sequence)."""

import json

import pytest
from conftest import REAL_DEVICE, free_port
from test_nccl import _launch

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only: the real NCCL needs as many GPUs as ranks")

CAPTURE_PROGRAM = r"""
import json, os, torch, torch.distributed as dist
from datetime import timedelta
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
out = {}
x = torch.zeros(1 << 16, device="cuda")
# Warm-up on a side stream, as torch.cuda.graph's documentation asks.
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    dist.all_reduce(x)
    z = x * 2 + 1
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
x.fill_(100.0 + rank)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    dist.all_reduce(x)
    z = x * 2 + 1
torch.cuda.synchronize()
# Capturing performs nothing: the peers' data has not moved yet.
out["after_capture"] = x[:2].tolist()
out["replays"] = []
for i in range(4):
    x.copy_(torch.arange(1 << 16, dtype=torch.float32, device="cuda") * (rank + 1) + i)
    g.replay()
    torch.cuda.synchronize()
    out["replays"].append([z[:3].tolist(), float(z[-1])])
# An eager collective after the replays still pairs with the peer's.
w = torch.full((8,), float(rank + 1), device="cuda")
dist.all_reduce(w)
out["eager_after"] = w[:2].tolist()
del g
torch.cuda.synchronize()
dist.destroy_process_group()
with open(os.environ["OUT"], "w") as f:
    json.dump(out, f)
"""


def test_an_all_reduce_captured_in_a_cuda_graph_replays_with_the_peers(sim):
    procs = _launch(sim, 2, CAPTURE_PROGRAM)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}"
    n = 1 << 16
    for rank in range(2):
        r = json.loads((sim.tmp / f"rank{rank}.json").read_text())
        # The capture ran nothing: x is still this rank's own.
        assert r["after_capture"] == [100.0 + rank] * 2, r
        for i, (head, last) in enumerate(r["replays"]):
            # Each replay sums both ranks' arange * (rank + 1) + i, then doubles and adds 1.
            want = [2 * (k * 1 + i) + 2 * (k * 2 + i) + 1 for k in range(3)]
            assert head == want, (i, head, want)
            assert last == 2 * ((n - 1) + i) + 2 * ((n - 1) * 2 + i) + 1, (i, last)
        assert r["eager_after"] == [3.0, 3.0], r


# ---- registration pins physical memory ----------------------------------------------------

REGISTRATION_PROGRAM = r"""
import ctypes, json, os, struct, sys, time
cudart = ctypes.CDLL("libcudart.so.13")
cuda = ctypes.CDLL("libcuda.so.1")
nccl = ctypes.CDLL("libnccl.so.2")
nccl.ncclGetLastError.restype = ctypes.c_char_p
MODE = os.environ["MODE"]  # "local": ncclCommRegister; "graph": a captured all-reduce
SIZE, COUNT = 2 << 20, 1024
out = {"mode": MODE}

class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Location),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint8 * 8)]
class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]

def on(dev):
    assert cudart.cudaSetDevice(dev) == 0 and cudart.cudaFree(None) == 0

def physical(dev, va, value):
    # cuMemCreate + cuMemMap + cuMemSetAccess at va, filled with `value`: a pause/resume's remap.
    on(dev)
    h = ctypes.c_uint64()
    assert cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(SIZE), ctypes.byref(Prop(1, 0, Location(1, dev))), ctypes.c_uint64(0)) == 0
    assert cuda.cuMemMap(ctypes.c_uint64(va), ctypes.c_size_t(SIZE), ctypes.c_size_t(0), h, ctypes.c_uint64(0)) == 0
    assert cuda.cuMemSetAccess(ctypes.c_uint64(va), ctypes.c_size_t(SIZE), ctypes.byref(Access(Location(1, dev), 3)), ctypes.c_size_t(1)) == 0
    write(dev, va, value)
    return h

def write(dev, va, value):
    on(dev)
    raw = struct.pack(f"<{COUNT}f", *([value] * COUNT))
    assert cudart.cudaMemcpy(ctypes.c_void_p(va), raw, len(raw), 1) == 0

def read(dev, va):
    on(dev)
    buf = ctypes.create_string_buffer(COUNT * 4)
    assert cudart.cudaMemcpy(buf, ctypes.c_void_p(va), COUNT * 4, 2) == 0
    return sorted(set(struct.unpack(f"<{COUNT}f", buf.raw)))

assert cuda.cuInit(0) == 0
comms = (ctypes.c_void_p * 2)()
assert nccl.ncclCommInitAll(comms, 2, None) == 0
comms = [ctypes.c_void_p(c) for c in comms]
vas, handles = [], []
for d in range(2):
    on(d)
    va = ctypes.c_uint64()
    assert cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(SIZE), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)) == 0
    vas.append(va.value)
    handles.append(physical(d, va.value, float(d + 1)))

streams = []
for d in range(2):
    on(d)
    s = ctypes.c_void_p()
    assert cudart.cudaStreamCreate(ctypes.byref(s)) == 0
    streams.append(s)

def all_reduce():
    assert nccl.ncclGroupStart() == 0
    for d in range(2):
        on(d)
        assert nccl.ncclAllReduce(ctypes.c_void_p(vas[d]), ctypes.c_void_p(vas[d]), ctypes.c_size_t(COUNT), 7, 0, comms[d], streams[d]) == 0
    assert nccl.ncclGroupEnd() == 0

if MODE == "local":
    regs = []
    for d in range(2):
        r = ctypes.c_void_p()
        assert nccl.ncclCommRegister(comms[d], ctypes.c_void_p(vas[d]), ctypes.c_size_t(SIZE), ctypes.byref(r)) == 0
        regs.append(r)
    run = all_reduce
else:
    for d in range(2):
        on(d)
        assert cudart.cudaStreamBeginCapture(streams[d], 0) == 0
    all_reduce()
    execs = []
    for d in range(2):
        on(d)
        g, e = ctypes.c_void_p(), ctypes.c_void_p()
        assert cudart.cudaStreamEndCapture(streams[d], ctypes.byref(g)) == 0
        assert cudart.cudaGraphInstantiate(ctypes.byref(e), g, ctypes.c_uint64(0)) == 0
        execs.append(e)
    def run():
        # One thread launches both ranks' graphs, as a one-process multi-GPU program does.
        for d in range(2):
            on(d)
            assert cudart.cudaGraphLaunch(execs[d], streams[d]) == 0

def synchronize():
    return [on(d) or cudart.cudaStreamSynchronize(streams[d]) for d in range(2)]

def async_errors():
    errs = []
    out["messages"] = []
    for d in range(2):
        e = ctypes.c_int()
        assert nccl.ncclCommGetAsyncError(comms[d], ctypes.byref(e)) == 0
        errs.append(e.value)
        # NCCL's last error is the process's: read it after each communicator's query.
        out["messages"].append(nccl.ncclGetLastError(comms[d]).decode())
    return errs

run()
out["fresh_sync"] = synchronize()
out["fresh"] = [read(d, vas[d]) for d in range(2)]
out["fresh_errors"] = async_errors()

# Rank 0's memory is released and other physical memory mapped at the same address (a pause
# without the communicator's knowledge, then a resume).
on(0)
assert cuda.cuMemUnmap(ctypes.c_uint64(vas[0]), ctypes.c_size_t(SIZE)) == 0
assert cuda.cuMemRelease(handles[0]) == 0
physical(0, vas[0], 10.0)
write(1, vas[1], 2.0)
start = time.monotonic()
run()
out["stale_sync"] = synchronize()
out["stale_seconds"] = time.monotonic() - start
out["stale_errors"] = async_errors()
out["after"] = [read(d, vas[d]) for d in range(2)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["local", "graph"])
def test_a_registration_whose_memory_was_released_and_remapped_fails_within_a_bound(sim, mode):
    # NCCL keeps using the physical pages it registered (ncclCommRegister, or a captured
    # collective's buffers under NCCL_GRAPH_REGISTER=1, its default); after they were released
    # and new memory mapped at the address, an operation through the registration must not run
    # on the new memory: it fails, on both ranks, after the bounded wait.
    proc = sim.python(
        REGISTRATION_PROGRAM,
        devices=2,
        memory="1GiB",
        extra={"MODE": mode, "TMS_SIM_NCCL_STALE_TIMEOUT": "1"},
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fresh_sync"] == [0, 0] and out["fresh_errors"] == [0, 0], out
    assert out["fresh"] == [[3.0], [3.0]], out
    assert out["stale_sync"] == [0, 0], out  # no device fault: the communicator fails
    assert out["stale_errors"] == [2, 2], out  # ncclSystemError on both ranks
    assert 1.0 <= out["stale_seconds"] < 30, out
    what = "ncclCommRegister's registration" if mode == "local" else "CUDA graph's registration"
    assert what in out["messages"][0] and "now" in out["messages"][0], out
    assert "stale" in out["messages"][1], out
    # Neither the new memory nor the peer's was written with a result.
    assert out["after"] == [[10.0], [2.0]], out


def test_without_graph_registration_a_replay_uses_the_memory_mapped_now(sim):
    proc = sim.python(
        REGISTRATION_PROGRAM, devices=2, memory="1GiB", extra={"MODE": "graph", "NCCL_GRAPH_REGISTER": "0"}, timeout=120
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stale_errors"] == [0, 0], out
    assert out["after"] == [[12.0], [12.0]], out


# ---- SGLang's pattern: the decode graph's all-reduce in a pausable graph pool ------------------

POOL_PROGRAM = r"""
import json, os, time, torch, torch.distributed as dist, torch_memory_saver
from datetime import timedelta
saver = torch_memory_saver.torch_memory_saver
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
out = {}
def save():
    with open(os.environ["OUT"], "w") as f:
        json.dump(out, f)
n = 1 << 16
x = torch.zeros(n, device="cuda")  # the runner's static input, outside the regions
def step():
    y = x * 2  # an intermediate in the graph's pool: in the cuda_graph region
    dist.all_reduce(y)
    return y + 1
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    step()
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with saver.cuda_graph(cuda_graph=g, stream=s, tag="cuda_graph"):
    z = step()
def replay(i):
    x.copy_(torch.arange(n, dtype=torch.float32, device="cuda") * (rank + 1) + i)
    g.replay()
    torch.cuda.synchronize()
    return z[:3].tolist()
out["before"] = replay(0)
# release_memory_occupation / resume_memory_occupation of the graphs (no backup: SGLang's tag).
saver.pause(tag="cuda_graph")
saver.resume(tag="cuda_graph")
start = time.monotonic()
out["after"] = replay(1)
out["seconds"] = time.monotonic() - start
save()
w = torch.ones(8, device="cuda")
try:
    dist.all_reduce(w)
    torch.cuda.synchronize()
    out["eager_after"] = w[:2].tolist()
except Exception as e:
    out["eager_after"] = f"{type(e).__name__}: {e}"
save()
os._exit(0)  # the process group may be failed: no teardown
"""


@pytest.mark.parametrize("register", ["1", "0", "1-unfixed"])
def test_a_decode_graphs_all_reduce_after_its_pool_was_paused_and_resumed(sim, register):
    # SGLang captures its tensor-parallel all-reduce in each decode graph, in a graph pool that
    # torch_memory_saver's `cuda_graph` tag releases and takes back. The all-reduce's buffer then
    # is other physical memory. PyTorch registers every segment of its caching allocator with
    # ncclCommRegister, and NCCL registers a captured collective's buffers (both NCCL's
    # defaults): the collective still names the released pages and must fail, never reduce the
    # new memory as if nothing had happened ("1-unfixed": the hook's fix turned off with
    # TMS_NCCL_REREGISTER=0, as without tms). With the hook, registration on ("1") is exact: it
    # turns graph registration off before the first region allocation and takes ncclCommRegister's
    # registrations down at the pause and makes them again at the resume. With both registrations
    # off ("0") the replay reduces the new memory too.
    import subprocess
    import sys

    script = sim.tmp / "pool_program.py"
    script.write_text(POOL_PROGRAM)
    port = free_port()
    procs = []
    for rank in range(2):
        env = sim.env(
            devices=2,
            memory="2GiB",
            preload=sim.compat_dir() / "torch_memory_saver_hook_mode_preload.abi3.so",
            extra={
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OUT": str(sim.tmp / f"pool{rank}.json"),
                "OMP_NUM_THREADS": "1",
                "NCCL_GRAPH_REGISTER": register[0],
                "NCCL_LOCAL_REGISTER": register[0],
                "TMS_NCCL_REREGISTER": "0" if register == "1-unfixed" else "1",
                "TMS_SIM_NCCL_STALE_TIMEOUT": "1",
            },
        )
        procs.append(
            subprocess.Popen([sys.executable, str(script)], env=env, cwd=sim.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, text) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text}"
    results = [json.loads((sim.tmp / f"pool{r}.json").read_text()) for r in range(2)]
    exact = lambda i: [2 * (k + i) + 2 * (2 * k + i) + 1 for k in range(3)]  # noqa: E731
    for r in results:
        assert r["before"] == exact(0), r
    if register != "1-unfixed":
        for r in results:
            assert r["after"] == exact(1), r
            assert r["eager_after"] == [2.0, 2.0], r
    else:
        for rank, r in enumerate(results):
            assert r["after"] != exact(1), r  # not reduced as if the registration still held
            assert 1.0 <= r["seconds"] < 60, r
            assert "NCCL" in r["eager_after"] and "registration" in r["eager_after"], r
