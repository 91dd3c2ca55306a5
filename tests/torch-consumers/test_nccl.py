"""The simulator's NCCL (libnccl.so.2) under its real consumers.

- PyTorch unchanged: `init_process_group("nccl")` across 2 and 4 processes on simulated devices,
  every collective torch.distributed offers for weight sync, checked against the same calls on
  CPU tensors over gloo in the same processes; a rank SIGKILLed mid-broadcast makes the survivor
  raise within the process group's timeout.
- NCCL's C ABI through ctypes, the way vLLM's and vllm-ascend's communicators load it: one
  process driving two devices (ncclCommInitAll, groups), the device memory a communicator's
  buffers take, and the documented error code for each kind of bad input.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REAL_DEVICE, free_port

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only: the real NCCL needs as many GPUs as ranks")

RANK_PROGRAM = r"""
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
cpu = dist.new_group(backend="gloo")
gen = torch.Generator().manual_seed(1234 + rank)
# Whole numbers small enough for every partial sum to be exact in the type (bfloat16 holds
# whole numbers up to 256), so any reduction order (gloo's differs) gives the same result.
def sample(n, dtype):
    bound = 60 if dtype in (torch.bfloat16, torch.float16) else 1000
    return torch.randint(-bound, bound, (n,), generator=gen).to(dtype)
results = {}
def both(name, fn, *tensors):
    dev = [t.cuda() for t in tensors]
    fn(dev, None)
    host = [t.clone() for t in tensors]
    fn(host, cpu)
    results[name] = {"nccl": [t.cpu().float().tolist() for t in dev], "gloo": [t.float().tolist() for t in host]}
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8):
    x = sample(1000, dtype) if dtype != torch.uint8 else torch.randint(0, 50, (1000,), generator=gen).to(dtype)
    both(f"all_reduce_sum_{dtype}", lambda t, g: dist.all_reduce(t[0], group=g), x)
both("all_reduce_max", lambda t, g: dist.all_reduce(t[0], op=dist.ReduceOp.MAX, group=g), sample(333, torch.float32))
both("all_reduce_min_int", lambda t, g: dist.all_reduce(t[0], op=dist.ReduceOp.MIN, group=g), sample(333, torch.int64))
both("all_reduce_product", lambda t, g: dist.all_reduce(t[0], op=dist.ReduceOp.PRODUCT, group=g), torch.tensor([1.5, -2.0, 3.0]) * (rank + 1))
both("broadcast_from_last", lambda t, g: dist.broadcast(t[0], src=world - 1, group=g), sample(5000, torch.float32))
big = sample(3 << 20, torch.float32)  # 12 MiB: several 4 MiB chunks
both("broadcast_12MiB", lambda t, g: dist.broadcast(t[0], src=0, group=g), big)
both("reduce_to_1", lambda t, g: dist.reduce(t[0], dst=1, group=g), sample(100, torch.float32))
if rank != 1:
    del results["reduce_to_1"]  # only the destination's tensor is defined
def gather(t, g):
    t[1].copy_(torch.zeros_like(t[1]))
    dist.all_gather_into_tensor(t[1], t[0], group=g)
both("all_gather_into_tensor", gather, sample(257, torch.bfloat16), torch.zeros(257 * world, dtype=torch.bfloat16))
def scatter(t, g):
    dist.reduce_scatter_tensor(t[1], t[0], group=g)
both("reduce_scatter_tensor", scatter, sample(64 * world, torch.float32), torch.zeros(64))
def ring(t, g):
    right, left = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, t[0], right, group=g), dist.P2POp(dist.irecv, t[1], left, group=g)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
both("send_recv_ring", ring, sample(4096, torch.float32), torch.zeros(4096))
def pairs(t, g):
    if rank == 0:
        dist.send(t[0], dst=1, group=g)
    elif rank == 1:
        dist.recv(t[0], src=0, group=g)
both("send_then_recv", pairs, sample(10, torch.int64))
def all_to_all(t, g):
    dist.all_to_all_single(t[1], t[0], group=g)
both("all_to_all_single", all_to_all, sample(8 * world, torch.float32), torch.zeros(8 * world))
dist.barrier()
# A subgroup of ranks 0 and 1 (new_group): its broadcast must not involve the others.
sub = dist.new_group(ranks=[0, 1])
subcpu = dist.new_group(ranks=[0, 1], backend="gloo")
if rank < 2:
    y = sample(77, torch.float32)
    dev, host = y.cuda(), y.clone()
    dist.broadcast(dev, src=1, group=sub)
    dist.broadcast(host, src=1, group=subcpu)
    results["new_group_broadcast"] = {"nccl": [dev.cpu().tolist()], "gloo": [host.tolist()]}
dist.barrier()
json.dump(results, open(os.environ["OUT"], "w"))
dist.destroy_process_group()
print("rank done", rank)
"""


def _launch(sim, world, program, extra=None, devices=None):
    """Starts `world` ranks of `program` on one simulated node; returns the processes."""
    script = sim.tmp / f"rank_program_{world}.py"
    script.write_text(program)
    port = free_port()
    procs = []
    for rank in range(world):
        env = sim.env(
            devices=devices or world,
            memory="2GiB",
            extra={
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OUT": str(sim.tmp / f"rank{rank}.json"),
                "OMP_NUM_THREADS": "1",
                "TMS_SIM_NCCL_CONNECT_TIMEOUT": "60",
                **(extra or {}),
            },
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, cwd=sim.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


@pytest.mark.parametrize("world", [2, 4])
def test_torch_distributed_nccl_matches_gloo(sim, world):
    procs = _launch(sim, world, RANK_PROGRAM)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}"
    per_rank = [json.loads((sim.tmp / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, results in enumerate(per_rank):
        assert len(results) >= 15, results.keys()
        for name, r in results.items():
            assert r["nccl"] == r["gloo"], f"rank {rank}: {name} differs between NCCL on the simulator and gloo"
    # The data really moved: after the ring, each rank holds its left neighbour's tensor.
    assert per_rank[0]["send_recv_ring"]["nccl"][1] == per_rank[0]["send_recv_ring"]["gloo"][1]
    assert per_rank[0]["broadcast_12MiB"]["nccl"] == per_rank[world - 1]["broadcast_12MiB"]["nccl"]
    assert per_rank[0]["broadcast_from_last"]["nccl"] != [[0.0] * 5000]


KILLED_PROGRAM = r"""
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=2, timeout=timedelta(seconds=20))
dist.barrier()
x = torch.full((16 << 20,), float(rank), device="cuda")  # 64 MiB
print("broadcasting", flush=True)
start = time.monotonic()
try:
    dist.broadcast(x, src=1)
    torch.cuda.synchronize()
    print(f"finished after {time.monotonic() - start:.1f} s", flush=True)
except Exception as e:
    print(f"raised after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
"""


def test_a_rank_killed_mid_broadcast_makes_the_survivor_raise(sim):
    # A slow modelled link (64 MiB at 50 MB/s: over a second) keeps the broadcast under way.
    procs = _launch(
        sim, 2, KILLED_PROGRAM, extra={"TMS_SIM_LINK_GBPS": "0.05", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    )
    sender = procs[1]
    line = ""
    deadline = time.monotonic() + 120
    while "broadcasting" not in line and time.monotonic() < deadline:
        line = sender.stdout.readline()
        if not line and sender.poll() is not None:
            break
    assert "broadcasting" in line, f"the sender never reached its broadcast: {sender.communicate()[0]}"
    time.sleep(0.5)
    killed_at = time.monotonic()
    sender.send_signal(signal.SIGKILL)
    sender.wait()
    out, _ = procs[0].communicate(timeout=120)
    took = time.monotonic() - killed_at
    assert procs[0].returncode not in (0, None), f"the survivor did not fail:\n{out}"
    assert "finished after" not in out, out
    assert took < 40, f"the survivor took {took:.0f} s to fail (process group timeout 20 s):\n{out}"
    assert "raised after" in out, f"the survivor did not raise:\n{out}"


# ---- the C ABI through ctypes ------------------------------------------------------------

CTYPES_PROGRAM = r"""
import ctypes, json, os, struct, sys, threading, time
cudart = ctypes.CDLL("libcudart.so.13")
nccl = ctypes.CDLL("libnccl.so.2")
out = {}
v = ctypes.c_int()
assert nccl.ncclGetVersion(ctypes.byref(v)) == 0
out["version"] = v.value
nccl.ncclGetErrorString.restype = ctypes.c_char_p
nccl.ncclGetLastError.restype = ctypes.c_char_p
out["error_string_6"] = nccl.ncclGetErrorString(6).decode()

def free_bytes(dev):
    cudart.cudaSetDevice(dev)
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert cudart.cudaMemGetInfo(ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value

def dev_buffer(dev, values, fmt="f"):
    cudart.cudaSetDevice(dev)
    p = ctypes.c_void_p()
    raw = struct.pack(f"<{len(values)}{fmt}", *values)
    assert cudart.cudaMalloc(ctypes.byref(p), len(raw)) == 0
    assert cudart.cudaMemcpy(p, raw, len(raw), 1) == 0
    return p, len(raw)

def read(p, n, fmt="f"):
    buf = ctypes.create_string_buffer(n)
    assert cudart.cudaMemcpy(buf, p, n, 2) == 0
    return list(struct.unpack(f"<{n // struct.calcsize(fmt)}{fmt}", buf.raw))

# One process, two devices.
before = [free_bytes(0), free_bytes(1)]
comms = (ctypes.c_void_p * 2)()
assert nccl.ncclCommInitAll(comms, 2, None) == 0
comms = [ctypes.c_void_p(c) for c in comms]  # as pointers: ctypes passes a bare int as a C int
after = [free_bytes(0), free_bytes(1)]
out["buffer_bytes"] = [b - a for b, a in zip(before, after)]
count, rank, dev = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
assert nccl.ncclCommCount(comms[1], ctypes.byref(count)) == 0
assert nccl.ncclCommUserRank(comms[1], ctypes.byref(rank)) == 0
assert nccl.ncclCommCuDevice(comms[1], ctypes.byref(dev)) == 0
out["count_rank_device"] = [count.value, rank.value, dev.value]

# A group of all-reduces, one per device, as a single process must issue them.
def group_all_reduce(counts=(4, 4)):
    assert nccl.ncclGroupStart() == 0
    for d in range(2):
        cudart.cudaSetDevice(d)
        assert nccl.ncclAllReduce(bufs[d][0], bufs[d][0], ctypes.c_size_t(counts[d]), 7, 0, comms[d], None) == 0
    assert nccl.ncclGroupEnd() == 0
    return [cudart.cudaSetDevice(d) or cudart.cudaDeviceSynchronize() for d in range(2)]
bufs = [dev_buffer(d, [1.5 * (d + 1), 2.0, -3.0, 4.25]) for d in range(2)]
assert group_all_reduce() == [0, 0]
out["all_reduce"] = [read(bufs[d][0], bufs[d][1]) for d in range(2)]

# Communicator memory (ncclCommSuspend/Resume/MemStats, NCCL 2.29.7+): the buffers go and come back.
def stat(comm, which):
    v = ctypes.c_uint64()
    assert nccl.ncclCommMemStats(comm, which, ctypes.byref(v)) == 0
    return v.value
out["stats"] = [stat(comms[0], k) for k in range(4)]
free_active = [free_bytes(0), free_bytes(1)]
out["suspend_bad_flags"] = nccl.ncclCommSuspend(comms[0], 2)
for d in range(2):
    assert nccl.ncclCommSuspend(comms[d], 1) == 0
out["suspend_again"] = nccl.ncclCommSuspend(comms[0], 1)
out["suspended_stat"] = stat(comms[0], 1)
out["freed_by_suspend"] = [free_bytes(d) - free_active[d] for d in range(2)]
out["collective_while_suspended"] = nccl.ncclAllReduce(bufs[0][0], bufs[0][0], ctypes.c_size_t(4), 7, 0, comms[0], None)
nccl.ncclGetLastError.restype = ctypes.c_char_p
out["suspended_message"] = nccl.ncclGetLastError(None).decode()
for d in range(2):
    assert nccl.ncclCommResume(comms[d]) == 0
out["taken_by_resume"] = [free_active[d] - free_bytes(d) for d in range(2)]
assert group_all_reduce() == [0, 0]
out["all_reduce_after_resume"] = [read(bufs[d][0], bufs[d][1]) for d in range(2)]

# Bad input: each gets NCCL's documented code, and nothing crashes.
p0 = bufs[0][0]
out["null_comm"] = nccl.ncclAllReduce(p0, p0, ctypes.c_size_t(4), 7, 0, None, None)
out["freed_comm"] = nccl.ncclCommCount(ctypes.c_void_p(12345), ctypes.byref(count))
out["unknown_dtype"] = nccl.ncclAllReduce(p0, p0, ctypes.c_size_t(4), 99, 0, comms[0], None)
out["unknown_op"] = nccl.ncclAllReduce(p0, p0, ctypes.c_size_t(4), 7, 42, comms[0], None)
out["root_out_of_range"] = nccl.ncclBroadcast(p0, p0, ctypes.c_size_t(4), 7, 2, comms[0], None)
out["count_overflow"] = nccl.ncclAllReduce(p0, p0, ctypes.c_size_t(2**62), 7, 0, comms[0], None)
out["null_buffer"] = nccl.ncclAllReduce(None, None, ctypes.c_size_t(4), 7, 0, comms[0], None)
out["group_end_alone"] = nccl.ncclGroupEnd()
bad_cfg = (ctypes.c_char * 256)()
class UniqueId(ctypes.Structure):  # ncclUniqueId, passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]
out["garbage_id"] = nccl.ncclCommInitRank(ctypes.byref(ctypes.c_void_p()), 2, UniqueId(b"not an id"), 0)
out["config_without_magic"] = nccl.ncclCommInitRankConfig(ctypes.byref(ctypes.c_void_p()), 1, UniqueId(), 0, bad_cfg)
out["unsupported"] = nccl.ncclCommShrink(comms[0])
out["last_error"] = nccl.ncclGetLastError(None).decode()

# Ranks that disagree (different counts) fail the operation on both, named, instead of mixing.
group_all_reduce(counts=(4, 2))
errs = []
for d in range(2):
    e = ctypes.c_int()
    assert nccl.ncclCommGetAsyncError(comms[d], ctypes.byref(e)) == 0
    errs.append(e.value)
    if d == 0:
        out["mismatch_message"] = nccl.ncclGetLastError(comms[0]).decode()
out["mismatch_async_errors"] = errs
out["after_mismatch_call"] = nccl.ncclAllReduce(p0, p0, ctypes.c_size_t(4), 7, 0, comms[0], None)
held = [free_bytes(0), free_bytes(1)]
for d in range(2):
    assert nccl.ncclCommDestroy(comms[d]) == 0
out["given_back_by_destroy"] = [free_bytes(0) - held[0], free_bytes(1) - held[1]]
out["destroyed_again"] = nccl.ncclCommDestroy(comms[0])
print(json.dumps(out))
"""


def test_nccl_c_abi_one_process_two_devices_and_bad_input(sim):
    proc = sim.python(CTYPES_PROGRAM, devices=2, memory="1GiB", python=sys.executable)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == 23007
    assert "remote process exited" in out["error_string_6"]
    expected = [1.5 + 3.0, 4.0, -6.0, 8.5]
    # NCCL_BUFFSIZE (4 MiB) x 2 channels x send+receive x 1 peer, plus 1 MiB that stays while
    # suspended, outside any allocation.
    assert out["buffer_bytes"] == [17 << 20, 17 << 20]
    assert out["stats"] == [16 << 20, 0, 1 << 20, 17 << 20]
    assert out["suspend_bad_flags"] == 4
    assert out["suspend_again"] == 0
    assert out["suspended_stat"] == 1
    assert out["freed_by_suspend"] == [16 << 20, 16 << 20]
    assert out["collective_while_suspended"] == 5
    assert "suspended" in out["suspended_message"] and "ncclCommResume" in out["suspended_message"]
    assert out["taken_by_resume"] == [0, 0]
    assert out["all_reduce_after_resume"] == [[2 * v for v in expected]] * 2
    assert out["count_rank_device"] == [2, 1, 1]
    assert out["all_reduce"] == [expected, expected]
    assert out["null_comm"] == 4
    assert out["freed_comm"] == 4
    assert out["unknown_dtype"] == 4
    assert out["unknown_op"] == 4
    assert out["root_out_of_range"] == 4
    assert out["count_overflow"] == 4
    assert out["null_buffer"] == 4
    assert out["group_end_alone"] == 5
    assert out["config_without_magic"] == 4
    assert out["garbage_id"] == 4
    assert out["unsupported"] == 5
    assert "ncclCommShrink" in out["last_error"]
    assert out["mismatch_async_errors"] == [5, 5]
    assert "disagree" in out["mismatch_message"] and "4 elements" in out["mismatch_message"]
    assert out["after_mismatch_call"] == 5
    assert out["given_back_by_destroy"] == [17 << 20, 17 << 20]
    assert out["destroyed_again"] == 4


LONELY_PROGRAM = r"""
import ctypes, json, subprocess, sys, time
cudart = ctypes.CDLL("libcudart.so.13")
nccl = ctypes.CDLL("libnccl.so.2")
out = {}
class UniqueId(ctypes.Structure):  # ncclUniqueId, passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
start = time.monotonic()
out["never_joined"] = nccl.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0)
out["never_joined_s"] = time.monotonic() - start
nccl.ncclGetLastError.restype = ctypes.c_char_p
out["never_joined_message"] = nccl.ncclGetLastError(None).decode()
# An id from another run: its root (a process that exited) is gone.
other = subprocess.run([sys.executable, "-c",
    "import ctypes,sys; n=ctypes.CDLL('libnccl.so.2'); u=(ctypes.c_char*128)(); n.ncclGetUniqueId(u); sys.stdout.buffer.write(bytes(u))"],
    capture_output=True, check=True).stdout
start = time.monotonic()
out["other_run"] = nccl.ncclCommInitRank(ctypes.byref(comm), 2, UniqueId.from_buffer_copy(other), 1)
out["other_run_s"] = time.monotonic() - start
print(json.dumps(out))
"""


def test_a_rank_that_never_joins_fails_init_after_the_connect_timeout(sim):
    proc = sim.python(LONELY_PROGRAM, devices=1, memory="1GiB", extra={"TMS_SIM_NCCL_CONNECT_TIMEOUT": "2"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["never_joined"] == 8, out  # ncclTimeout
    assert 1.5 < out["never_joined_s"] < 15, out
    assert "rank(s) 1 never joined" in out["never_joined_message"]
    assert out["other_run"] == 2, out  # ncclSystemError: the root cannot be reached
    assert out["other_run_s"] < 15, out


PAUSED_PROGRAM = r"""
import ctypes, json
cudart = ctypes.CDLL("libcudart.so.13")
cuda = ctypes.CDLL("libcuda.so.1")
nccl = ctypes.CDLL("libnccl.so.2")
out = {}
cudart.cudaSetDevice(0)
cudart.cudaFree(None)  # the primary context
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure):  # CUmemAllocationProp: pinned, on device 0
    _fields_ = [("type", ctypes.c_int), ("handleTypes", ctypes.c_int), ("location", Location),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]
class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]
size = 2 << 20
addr, handle = ctypes.c_uint64(), ctypes.c_uint64()
assert cuda.cuMemAddressReserve(ctypes.byref(addr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)) == 0
assert cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(Prop(1, 0, Location(1, 0))), ctypes.c_uint64(0)) == 0
assert cuda.cuMemMap(addr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)) == 0
assert cuda.cuMemSetAccess(addr, ctypes.c_size_t(size), ctypes.byref(Access(Location(1, 0), 3)), ctypes.c_size_t(1)) == 0
comms = (ctypes.c_void_p * 1)()
assert nccl.ncclCommInitAll(comms, 1, (ctypes.c_int * 1)(0)) == 0
comm = ctypes.c_void_p(comms[0])
ptr = ctypes.c_void_p(addr.value)
# Mapped: a broadcast over it runs.
assert nccl.ncclBroadcast(ptr, ptr, ctypes.c_size_t(1024), 7, 0, comm, None) == 0
out["mapped_sync"] = cudart.cudaDeviceSynchronize()
# Paused as the hook pauses: unmapped, the handle released; the range stays reserved.
assert cuda.cuMemUnmap(addr, ctypes.c_size_t(size)) == 0
assert cuda.cuMemRelease(handle) == 0
out["queued"] = nccl.ncclBroadcast(ptr, ptr, ctypes.c_size_t(1024), 7, 0, comm, None)
out["paused_sync"] = cudart.cudaDeviceSynchronize()
p = ctypes.c_void_p()
out["after"] = cudart.cudaMalloc(ctypes.byref(p), 256)
e = ctypes.c_int()
nccl.ncclCommGetAsyncError(comm, ctypes.byref(e))
out["async_error"] = e.value
print(json.dumps(out))
"""


def test_a_collective_on_paused_memory_faults_like_a_kernel(sim):
    proc = sim.python(PAUSED_PROGRAM, devices=1, memory="1GiB")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mapped_sync"] == 0
    assert out["queued"] == 0  # queued: the fault comes when the stream runs it
    assert out["paused_sync"] == 700  # cudaErrorIllegalAddress
    assert out["after"] == 700  # sticky: the context is dead
    assert out["async_error"] == 1  # ncclUnhandledCudaError


NODES_PROGRAM = r"""
import ctypes, json, os, struct, sys, time
cudart = ctypes.CDLL("libcudart.so.13")
nccl = ctypes.CDLL("libnccl.so.2")
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
rank, id_file = int(os.environ["RANK"]), os.environ["ID_FILE"]
uid = UniqueId()
if rank == 0:
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    open(id_file + ".tmp", "wb").write(bytes(uid))  # the raw 128 bytes (.internal stops at a NUL)
    os.rename(id_file + ".tmp", id_file)
else:
    while not os.path.exists(id_file):
        time.sleep(0.02)
    uid = UniqueId.from_buffer_copy(open(id_file, "rb").read())
cudart.cudaSetDevice(0)
comm = ctypes.c_void_p()
assert nccl.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank) == 0
n = 8 << 20
p = ctypes.c_void_p()
assert cudart.cudaMalloc(ctypes.byref(p), n) == 0
pattern = bytes((i * 7 + 3) % 251 for i in range(n)) if rank == 0 else bytes(n)
assert cudart.cudaMemcpy(p, pattern, n, 1) == 0
stream = ctypes.c_void_p()
assert cudart.cudaStreamCreate(ctypes.byref(stream)) == 0
start = time.monotonic()
assert nccl.ncclBroadcast(p, p, ctypes.c_size_t(n), 1, 0, comm, stream) == 0
assert cudart.cudaStreamSynchronize(stream) == 0
took = time.monotonic() - start
back = ctypes.create_string_buffer(n)
assert cudart.cudaMemcpy(back, p, n, 2) == 0
expect = bytes((i * 7 + 3) % 251 for i in range(n))
print(json.dumps({"rank": rank, "same": back.raw == expect, "seconds": took, "node": os.environ["TMS_SIM_NODE"]}))
assert nccl.ncclCommDestroy(comm) == 0
"""


def test_ranks_on_different_simulated_nodes_move_data_at_the_inter_node_rate(sim):
    # As Ray places them: each rank on a node of its own (own device 0). The inter-node link is
    # modelled at 0.1 GB/s, so 8 MiB takes at least 84 ms; intra-node would be 450 GB/s.
    script = sim.tmp / "nodes.py"
    script.write_text(NODES_PROGRAM)
    id_file = sim.tmp / "nccl-id"
    procs = []
    for rank in range(2):
        env = sim.env(devices=1, memory="1GiB", extra={"RANK": str(rank), "ID_FILE": str(id_file), "TMS_SIM_LINK_GBPS": "450,0.1"})
        env["TMS_SIM_NODE"] = f"{sim.node}-host{rank}"
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=sim.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"exit {p.returncode}\n{stdout}\n{stderr}"
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0]["node"] != outs[1]["node"]
    assert all(o["same"] for o in outs), outs
    assert outs[1]["seconds"] >= (8 << 20) / 0.1e9 * 0.95, outs


CTYPES_UNDER_HOOK = r"""
import ctypes, json, os, struct
cudart = ctypes.CDLL("libcudart.so.13")
# As vLLM's and verl's communicators load NCCL: by name, names looked up on that handle (a lookup
# that never sees the preloaded hook's definitions unless the hook answers dlsym itself).
nccl = ctypes.CDLL("libnccl.so.2")
hook = ctypes.CDLL(os.environ["TMS_HOOK"])
def free_bytes(dev):
    cudart.cudaSetDevice(dev)
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert cudart.cudaMemGetInfo(ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value
comms = (ctypes.c_void_p * 2)()
assert nccl.ncclCommInitAll(comms, 2, None) == 0
comms = [ctypes.c_void_p(c) for c in comms]
bufs = []
for d in range(2):
    cudart.cudaSetDevice(d)
    p = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(p), 16) == 0
    assert cudart.cudaMemcpy(p, struct.pack("<4f", d + 1.0, 2.0, 3.0, 4.0), 16, 1) == 0
    bufs.append(p)
def all_reduce():
    # In a group, NCCL reports a communicator's state at ncclGroupEnd.
    assert nccl.ncclGroupStart() == 0
    for d in range(2):
        cudart.cudaSetDevice(d)
        assert nccl.ncclAllReduce(bufs[d], bufs[d], ctypes.c_size_t(4), 7, 0, comms[d], None) == 0
    rc = nccl.ncclGroupEnd()
    for d in range(2):
        cudart.cudaSetDevice(d)
        cudart.cudaDeviceSynchronize()
    return rc
out = {}
before = [free_bytes(0), free_bytes(1)]
out["pause"] = hook.tms_pause(b"nccl")
out["freed"] = [free_bytes(d) - before[d] for d in range(2)]
out["while_paused"] = all_reduce()
out["resume"] = hook.tms_resume(b"nccl")
out["back"] = [before[d] - free_bytes(d) for d in range(2)]
out["after"] = all_reduce()
buf = ctypes.create_string_buffer(16)
cudart.cudaSetDevice(1)
assert cudart.cudaMemcpy(buf, bufs[1], 16, 2) == 0
out["values"] = list(struct.unpack("<4f", buf.raw))
for c in comms:
    assert nccl.ncclCommDestroy(c) == 0
print(json.dumps(out))
"""


def test_communicators_of_a_ctypes_client_pause_with_the_tag_nccl(sim):
    # vLLM's PyNcclCommunicator and verl's weight-sync group load libnccl.so.2 with ctypes; the
    # hook answers their handle lookups, so their communicators are tracked and tag nccl
    # suspends them (issue 32).
    proc = sim.python(CTYPES_UNDER_HOOK, devices=2, memory="1GiB", preload=sim.hook, extra={"TMS_HOOK": str(sim.hook)})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pause"] == 0 and out["resume"] == 0, out
    assert out["freed"] == [16 << 20, 16 << 20], out
    assert out["while_paused"] == 5, out  # ncclInvalidUsage: suspended
    assert out["back"] == [0, 0], out
    assert out["after"] == 0, out
    assert out["values"] == [3.0, 4.0, 6.0, 8.0], out
