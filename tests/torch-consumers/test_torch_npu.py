"""torch_npu 2.9.1, unchanged, on the simulator's Ascend devices (scripts/torch-env.sh --npu; the
harness is tests/tests/torch.rs). torch_npu loads its Ascend stack (libascendcl.so, libhccl.so and
the rest of CANN's names, all the simulator under `tms-sim env`) and takes device memory through
its own caching allocator, which finds `aclrtMallocAlign32` with dlopen + dlsym.

- the memory path: `.to("npu")`, `.cpu()`, `mem_get_info`, `empty_cache`, pinned host memory,
  copies on a side stream timed by events, a second device;
- tms-memory-saver's wheel in place of sgl-kernel-npu's torch_memory_saver, in preload mode (the
  hook catches the caching allocator's `aclrtMallocAlign32` through `dlsym(handle)`) and torch
  mode (`NPUPluggableAllocator` + MemPool): pause frees the device memory, resume brings the bytes
  back at the same addresses, tms-ctl sees the process and its tags;
- torch.distributed's `hccl` backend between two simulated NPUs: broadcast and all_reduce exact;
  then verl's stateless HCCL weight sync (a TCPStore and a ctypes communicator) on the same NPUs;
- operators, computed on the CPU behind torch_npu's operator calls (tms_sim_torch's layer for the
  PrivateUse1 key): a small model's forward, backward and AdamW steps bit-identical to the CPU's,
  a battery of operators exact against the CPU, a second device, a side stream, printing; torch_npu's
  own operators refused at the call with an error naming them; `dist.barrier()` and an all_reduce of
  computed tensors over hccl (docs/simulator.md, "torch_npu on the simulator").

Few processes, each checking many things, so the file stays quick in CI.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REAL_DEVICE, free_port

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="the NPU kit runs test_npu_programs.py")

MIB = 1 << 20


def _json(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1])


MEMORY = r"""
import torch, torch_npu
out = {"available": torch.npu.is_available(), "count": torch.npu.device_count(),
       "cuda": torch.cuda.is_available()}
a = (torch.arange(4 << 20, dtype=torch.int64) * 2654435761 >> 11).to(torch.uint8)
f0, out["total"] = torch.npu.mem_get_info()
x = a.to("npu")
f1 = torch.npu.mem_get_info()[0]
out["charged"] = f0 - f1
out["allocated"] = torch.npu.memory_allocated()
out["exact"] = torch.equal(x.cpu(), a)
del x
out["cached"] = torch.npu.mem_get_info()[0] - f1
torch.npu.empty_cache()
out["returned"] = torch.npu.mem_get_info()[0] - f1
pinned = a.pin_memory()
out["pinned"], out["plain_pinned"] = pinned.is_pinned(), a.is_pinned()
back = torch.empty_like(a).pin_memory()
s = torch.npu.Stream()
ev0, ev1 = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
with torch.npu.stream(s):
    ev0.record()
    y = pinned.to("npu", non_blocking=True)
    back.copy_(y, non_blocking=True)
    ev1.record()
ev1.synchronize()
out["stream_exact"] = torch.equal(back, a)
out["elapsed_ms"] = ev0.elapsed_time(ev1)
out["done"] = ev1.query()
z = y.to("npu:1")
out["peer_device"], out["peer_exact"] = str(z.device), torch.equal(z.cpu(), a)
w = torch.empty(1 << 20, dtype=torch.uint8, device="npu:1")
w.copy_(z[: 1 << 20])
out["d2d_exact"] = torch.equal(w.cpu(), a[: 1 << 20])
out["dev1_allocated"] = torch.npu.memory_allocated(1)
# The runtime calls torch_npu makes, with the codes CANN's runtime reference documents.
import ctypes, threading
acl = ctypes.CDLL("libascendcl.so")
ev = ctypes.c_void_p()
out["event_bad_flag"] = acl.aclrtCreateEventExWithFlag(ctypes.byref(ev), 0x100)
out["event_ipc"] = acl.aclrtCreateEventExWithFlag(ctypes.byref(ev), 0x40)
out["sat_mode_bad"] = acl.aclrtSetDeviceSatMode(2)
out["sat_mode_ok"] = acl.aclrtSetDeviceSatMode(0)
mode = ctypes.c_int(-1)
acl.aclrtGetDeviceSatMode(ctypes.byref(mode))
out["sat_mode_read"] = mode.value
acl.aclrtSetDeviceSatMode(1)
raw = ctypes.c_void_p(s.npu_stream)
CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
ran = []
cb = CB(lambda data: ran.append(data))
out["callback_unsubscribed"] = acl.aclrtLaunchCallback(cb, ctypes.c_void_p(7), 0, raw)
tid = threading.get_ident()
out["subscribe"] = acl.aclrtSubscribeReport(ctypes.c_uint64(tid), raw)
out["subscribe_twice"] = acl.aclrtSubscribeReport(ctypes.c_uint64(tid), raw)
out["callback"] = acl.aclrtLaunchCallback(cb, ctypes.c_void_p(7), 0, raw)
out["report"] = acl.aclrtProcessReport(10000)
out["ran"] = ran
out["report_idle"] = acl.aclrtProcessReport(0)
out["unsubscribe"] = acl.aclrtUnSubscribeReport(ctypes.c_uint64(tid), raw)
acl.aclrtGetSocName.restype = ctypes.c_char_p
out["soc"] = acl.aclrtGetSocName().decode()
results["memory"] = out
"""


@pytest.fixture(scope="module")
def memory_then_compute(tmp_path_factory):
    """MEMORY, then COMPUTE, in one process: one torch_npu start-up for both."""
    from conftest import SimRun

    code = "import json\nresults = {}\n" + MEMORY + COMPUTE + "print(json.dumps(results))\n"
    sim = SimRun(tmp_path_factory.mktemp("npu-memory-compute"))
    return _json(sim.python(code, devices=2, memory="4GiB", npu_only=True, timeout=240))


def test_the_memory_path_of_torch_npu(memory_then_compute):
    out = memory_then_compute["memory"]
    assert out["available"] and out["count"] == 2, out
    assert out["cuda"] is False, out  # an Ascend host: torch_npu starts only without a CUDA device
    assert out["total"] == 4 << 30, out
    # The caching allocator takes a 20 MiB segment for a 4 MiB tensor (torch_npu's large-block
    # rounding), keeps it when the tensor dies, and gives it back on empty_cache.
    assert out["charged"] == 20 * MIB and out["allocated"] >= 4 * MIB, out
    assert out["exact"], out
    assert out["cached"] == 0 and out["returned"] == 20 * MIB, out
    assert out["pinned"] and not out["plain_pinned"], out
    assert out["stream_exact"] and out["done"] and out["elapsed_ms"] >= 0, out
    assert out["peer_device"] == "npu:1" and out["peer_exact"] and out["d2d_exact"], out
    assert out["dev1_allocated"] >= 5 * MIB, out
    assert (out["event_bad_flag"], out["event_ipc"]) == (100000, 207000), out
    assert (out["sat_mode_bad"], out["sat_mode_ok"], out["sat_mode_read"]) == (100000, 0, 0), out
    assert out["callback_unsubscribed"] == 107015, out
    assert (out["subscribe"], out["subscribe_twice"], out["callback"]) == (0, 107011, 0), out
    assert out["report"] == 0 and out["ran"] == [7] and out["report_idle"] == 507012, out
    assert out["unsubscribe"] == 0 and out["soc"] == "Ascend910B2", out


COMPUTE = r"""
import torch, torch_npu
import torch.nn as nn, torch.nn.functional as F
out = {}

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.LayerNorm(32), nn.Dropout(0.1),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))

def train(dev, steps=3):
    model = build().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16).to(dev), torch.randint(0, 5, (8,)).to(dev)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The state (parameters and BatchNorm's running statistics) and the last gradients.
    return losses, [t.cpu() for t in model.state_dict().values()], [p.grad.cpu() for p in model.parameters()]

cpu, npu = train("cpu"), train("npu")
out["losses"] = [cpu[0], npu[0]]
out["state_exact"] = len(cpu[1]) == 13 and all(torch.equal(a, b) for a, b in zip(cpu[1], npu[1]))
out["grads_exact"] = all(torch.equal(a, b) for a, b in zip(cpu[2], npu[2]))
out["learned"] = npu[0][-1] < npu[0][0]

def same(f):
    torch.manual_seed(5)
    a = f("cpu")
    torch.manual_seed(5)
    b = f("npu")
    return str(b.device).startswith("npu") and a.dtype == b.dtype and torch.equal(a, b.cpu())

def matmul_grad(d):
    # torch_npu's own autograd for matmul would call its NPU-only matmul_backward.
    a = torch.randn(2, 3, 4, device=d, requires_grad=True)
    torch.matmul(a, torch.randn(4, 5, device=d)).square().sum().backward()
    return a.grad

checks = {
    "matmul_grad": matmul_grad,
    "full": lambda d: torch.full((3, 5), 2.5, device=d),
    "ones_add": lambda d: torch.ones(7, device=d).add_(3),
    "arange": lambda d: torch.arange(3, 40, 3, device=d),
    "randn": lambda d: torch.randn(64, device=d),
    "matmul": lambda d: torch.randn(33, 17, device=d) @ torch.randn(17, 9, device=d),
    "bmm": lambda d: torch.bmm(torch.randn(3, 4, 5, device=d), torch.randn(3, 5, 2, device=d)),
    "strided_inplace": lambda d: (lambda x: (x[:, ::2].mul_(3), x)[1])(torch.randn(6, 8, device=d)),
    "transpose_contig": lambda d: torch.randn(5, 7, device=d).t().contiguous(),
    "to_bf16": lambda d: torch.randn(9, 4, device=d).t().to(torch.bfloat16),
    "softmax": lambda d: torch.randn(4, 10, device=d).softmax(-1),
    "reductions": lambda d: torch.stack([torch.randn(6, 5, device=d).sum(0), torch.randn(6, 5, device=d).amax(0)]),
    "argmax": lambda d: torch.randn(6, 5, device=d).argmax(1),
    "mask": lambda d: (lambda x: x[x > 0])(torch.randn(50, device=d)),
    "gather": lambda d: torch.randn(4, 6, device=d).gather(1, torch.randint(0, 6, (4, 3), device=d)),
    "cumsum": lambda d: torch.randn(20, device=d).cumsum(0),
    "where": lambda d: (lambda x: torch.where(x > 0, x, -x))(torch.randn(12, device=d)),
    "conv2d": lambda d: F.conv2d(torch.randn(2, 3, 8, 8, device=d), torch.randn(4, 3, 3, 3, device=d), padding=1),
    "conv_module": lambda d: nn.Conv2d(3, 4, 3).to(d)(torch.randn(2, 3, 8, 8).to(d)).detach(),
    "sdpa": lambda d: F.scaled_dot_product_attention(*(torch.randn(2, 4, 6, 8, device=d) for _ in range(3)), is_causal=True),
    "embedding": lambda d: F.embedding(torch.tensor([[1, 3], [0, 2]], device=d), torch.randn(5, 4, device=d)),
}
out["ops_exact"] = {k: same(f) for k, f in checks.items()}
# CANN's default on a 910B (binary operators): Module.to("npu") keeps BatchNorm and Conv2d weights
# in the plain format instead of casting them to NPU-private ones with an operator.
out["jit_compile_false"] = torch.npu.is_jit_compile_false()
x = torch.arange(6, dtype=torch.float32).to("npu")
out["repr"] = repr(x * 2)
out["item"] = (x * x).sum().item()
# A second device: results stay on the operands' device; mixing devices raises as on a GPU.
y = x.to("npu:1")
z = y * 3
out["device1"] = [str(z.device), torch.equal(z.cpu(), torch.arange(6.0) * 3)]
try:
    x + y
    out["mixed"] = "ran"
except RuntimeError as e:
    out["mixed"] = str(e)
# A side stream: copies queued on it land before an op that follows them on it reads.
s = torch.npu.Stream()
src = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
with torch.npu.stream(s):
    dev = src.to("npu", non_blocking=True)
    again = torch.empty_like(dev)
    again.copy_(dev)  # device to device, queued on the side stream
    doubled = again * 2
s.synchronize()
out["side_stream"] = torch.equal(doubled.cpu(), src * 2)
# torch_npu's own operators have no CPU kernel: refused at the call, naming the operator; later
# operators still compute.
try:
    torch_npu.npu_rms_norm(x.view(2, 3), torch.ones(3, device="npu"))
    out["refused"] = "ran"
except NotImplementedError as e:
    out["refused"] = str(e)
out["after_refused"] = torch.equal((x + 1).cpu(), torch.arange(6.0) + 1)
results["compute"] = out
"""


def test_operators_compute_on_the_cpu_as_the_cpu_does(memory_then_compute):
    out = memory_then_compute["compute"]
    # Forward, backward and AdamW (Linear, BatchNorm1d, GELU, LayerNorm, Dropout, ReLU,
    # cross-entropy): the very numbers the CPU gives, dropout masks included (the CPU's generator
    # draws them).
    assert out["losses"][0] == out["losses"][1], out["losses"]
    assert out["state_exact"] and out["grads_exact"] and out["learned"], out
    assert all(out["ops_exact"].values()), out["ops_exact"]
    assert out["jit_compile_false"], out
    assert out["repr"] == "tensor([ 0.,  2.,  4.,  6.,  8., 10.], device='npu:0')", out
    assert out["item"] == 55.0, out
    assert out["device1"] == ["npu:1", True], out
    assert "npu:0 and npu:1" in out["mixed"], out
    assert out["side_stream"], out
    assert out["refused"].startswith("npu::npu_rms_norm has no CPU implementation"), out
    assert out["after_refused"], out


SAVER = r"""
import json, os, subprocess, torch, torch_npu
from torch_memory_saver import torch_memory_saver as saver
saver.hook_mode = os.environ["MODE"]
MIB = 1 << 20
out = {}
def free():
    torch.npu.synchronize()
    return torch.npu.mem_get_info()[0]
def ctl(*args):
    p = subprocess.run([os.environ["TMS_CTL"], "--dir", os.environ["TMS_CONTROL_DIR"], "--json", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)
pattern = (torch.arange(32 * MIB, dtype=torch.int64) * 2654435761 >> 11).to(torch.uint8)
other = (torch.arange(8 * MIB, dtype=torch.int64) * 40503 >> 7).to(torch.uint8)
outside = pattern[: 4 * MIB].to("npu")
with saver.region(tag="weights", enable_cpu_backup=True):
    w = pattern.to("npu")
with saver.region(tag="kv_cache"):
    kv = other.to("npu")
w_ptr, kv_ptr = w.data_ptr(), kv.data_ptr()
out["mode"] = saver.hook_mode
out["listed"] = ctl("list")
f0 = free()
saver.pause("weights")
f1 = free()
out["freed_weights"] = f1 - f0
out["backup_while_paused"] = torch.equal(saver.get_cpu_backup(w), pattern)
saver.pause("kv_cache")
f2 = free()
out["freed_kv"] = f2 - f1
out["status_paused"] = ctl("status", os.environ["TMS_NAME"])
saver.resume("weights")
saver.resume("kv_cache")
out["regained"] = f2 - free()
out["same_ptrs"] = w.data_ptr() == w_ptr and kv.data_ptr() == kv_ptr
out["weights_exact"] = torch.equal(w.cpu(), pattern)
out["outside_kept"] = torch.equal(outside.cpu(), pattern[: 4 * MIB])
kv.copy_(other.flip(0).to("npu"))
out["kv_usable"] = torch.equal(kv.cpu(), other.flip(0))
# Through tms-ctl from outside the program, as an operator would: the bytes come back again.
ctl("pause", os.environ["TMS_NAME"], "--tag", "weights")
out["ctl_freed"] = free() - f0
ctl("resume", os.environ["TMS_NAME"], "--tag", "weights")
out["ctl_exact"] = torch.equal(w.cpu(), pattern) and w.data_ptr() == w_ptr
print(json.dumps(out, default=str))
"""


def _ctl_binary(hook):
    for p in (Path(hook).parent / "tms-ctl", Path(hook).parent.parent / "bin" / "tms-ctl"):
        if p.is_file():
            return p
    pytest.fail("tms-ctl not found beside the hook")


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_our_wheel_pauses_and_resumes_torch_npu_memory(sim, fresh_venv, mode):
    python, site = fresh_venv
    control = sim.tmp / "control"
    control.mkdir(mode=0o700, exist_ok=True)
    name = f"npu-{mode}-{os.getpid()}"
    extra = {
        "MODE": mode,
        "TMS_CTL": str(_ctl_binary(sim.hook)),
        "TMS_CONTROL_DIR": str(control),
        "TMS_NAME": name,
        "TMS_CONTROL": "1",
    }
    preload = site / "torch_memory_saver_hook_mode_preload.abi3.so" if mode == "preload" else None
    out = _json(sim.python(SAVER, python=python, preload=preload, memory="2GiB", npu_only=True, extra=extra))
    assert out["mode"] == mode, out
    # tms-ctl sees the process under its name, on the Ascend device, with both tags; while
    # paused, their bytes are counted as paused.
    listed = [p["status"] for p in out["listed"] if p["status"].get("name") == name]
    assert len(listed) == 1, out["listed"]
    assert [d["vendor"] for d in listed[0]["devices"]] == ["acl"], listed
    assert {"weights", "kv_cache"} <= {t["tag"] for t in listed[0]["tags"]}, listed
    paused = {t["tag"]: t for row in out["status_paused"] for t in row["status"]["tags"]}
    assert paused["weights"]["bytes_paused"] >= 32 * MIB and paused["weights"]["bytes_active"] == 0, paused
    assert paused["kv_cache"]["bytes_paused"] >= 8 * MIB, paused
    assert out["freed_weights"] >= 32 * MIB, out
    assert out["backup_while_paused"], out
    assert out["freed_kv"] >= 8 * MIB, out
    assert out["regained"] >= 40 * MIB, out
    assert out["same_ptrs"] and out["weights_exact"] and out["outside_kept"] and out["kv_usable"], out
    assert out["ctl_freed"] >= 32 * MIB and out["ctl_exact"], out


HCCL_RANK = r"""
import json, os, torch, torch_npu
import torch.distributed as dist
rank = int(os.environ["RANK"])
torch.npu.set_device(rank)
dist.init_process_group("hccl", rank=rank, world_size=2)
out = {"rank": rank, "backend": dist.get_backend()}
n = 1 << 20
src = (torch.arange(n, dtype=torch.int64) * 2654435761 % 1000003).to(torch.float32)
t = (src if rank == 0 else torch.zeros(n)).to("npu")
dist.broadcast(t, src=0)
out["broadcast_exact"] = torch.equal(t.cpu(), src)
mine = (torch.arange(n, dtype=torch.int64) % 977 + rank * 1000).to(torch.int32)
r = mine.to("npu")
dist.all_reduce(r)
expect = (torch.arange(n, dtype=torch.int64) % 977 * 2 + 1000).to(torch.int32)
out["all_reduce_exact"] = torch.equal(r.cpu(), expect)
f = (torch.arange(4096, dtype=torch.float32) / 7 + rank).to("npu")
dist.all_reduce(f, op=dist.ReduceOp.MAX)
out["max_exact"] = torch.equal(f.cpu(), torch.arange(4096, dtype=torch.float32) / 7 + 1)
# torch_npu's barrier all-reduces a tensor made by torch.ones, an operator computed on the CPU.
dist.barrier()
c = torch.ones(4096, device="npu") * (rank + 1)
dist.all_reduce(c)
out["computed_exact"] = torch.equal((c - 1).cpu(), torch.full((4096,), 2.0))
dist.destroy_process_group()

# verl's stateless weight sync on Ascend (verl/utils/distributed.py `stateless_init_process_group`
# with vllm-ascend's pyhccl communicator): a TCPStore outside any process group carries rank 0's
# HcclRootInfo, both ranks init an HCCL communicator on it, warm it up with a one-element
# all_reduce, and broadcast torch_npu tensors in place on torch_npu's current stream.
import ctypes
from datetime import timedelta
hccl = ctypes.CDLL("libhccl.so")
class RootInfo(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 4108)]
store = dist.TCPStore("127.0.0.1", int(os.environ["SYNC_PORT"]), 2, rank == 0, timedelta(seconds=60))
info = RootInfo()
if rank == 0:
    assert hccl.HcclGetRootInfo(ctypes.byref(info)) == 0
    store.set("root", bytes(info.internal))
ctypes.memmove(ctypes.byref(info), store.get("root"), 4108)
comm = ctypes.c_void_p()
out["init"] = hccl.HcclCommInitRootInfo(2, ctypes.byref(info), rank, ctypes.byref(comm))
stream = ctypes.c_void_p(torch.npu.current_stream().npu_stream)
warm = torch.zeros(1, dtype=torch.float32).to("npu")
out["warm"] = hccl.HcclAllReduce(ctypes.c_void_p(warm.data_ptr()), ctypes.c_void_p(warm.data_ptr()),
                                 ctypes.c_uint64(1), 4, 0, comm, stream)
torch.manual_seed(1234)
weights = {"embed": torch.randn(512, 256), "proj": torch.randn(1024).to(torch.bfloat16)}
HCCL_DTYPE = {torch.float32: 4, torch.bfloat16: 11}
dev = {k: (v if rank == 0 else torch.zeros_like(v)).to("npu") for k, v in weights.items()}
codes = [hccl.HcclBroadcast(ctypes.c_void_p(t.data_ptr()), ctypes.c_uint64(t.numel()), HCCL_DTYPE[t.dtype], 0,
                            comm, stream) for t in dev.values()]
torch.npu.current_stream().synchronize()
out["sync_codes"] = codes
out["sync_exact"] = all(torch.equal(dev[k].cpu(), weights[k]) for k in weights)
out["destroy"] = hccl.HcclCommDestroy(comm)
print(json.dumps(out))
"""


def test_torch_distributed_hccl_backend_and_verl_s_stateless_sync_between_two_npus(sim):
    port = free_port()
    procs = []
    for rank in range(2):
        extra = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "SYNC_PORT": str(port + 1), "TMS_SIM_HCCL_CONNECT_TIMEOUT": "60"}
        env = sim.env(devices=2, memory="2GiB", npu_only=True, extra=extra)
        procs.append(subprocess.Popen([sys.executable, "-c", HCCL_RANK], env=env, cwd=sim.tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(_json(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)))
    for out in outs:
        assert out["backend"] == "hccl", out
        assert out["broadcast_exact"] and out["all_reduce_exact"] and out["max_exact"], out
        assert out["computed_exact"], out
        assert (out["init"], out["warm"], out["sync_codes"], out["destroy"]) == (0, 0, [0, 0], 0), out
        assert out["sync_exact"], out
