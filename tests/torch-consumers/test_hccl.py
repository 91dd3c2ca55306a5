"""The simulator's HCCL (libhccl.so) under a ctypes client written from CANN's documentation, the
way vllm-ascend's communicator loads it (torch_npu cannot run here): rank 0 makes the 4108-byte
root info, the other rank receives it (here through a file; vllm-ascend broadcasts it over a CPU
group), both init, run the collectives weight sync uses on ACL streams, and destroy. Also: the
rank-table init, the device memory HCCL_BUFFSIZE takes, the connect timeout, and the documented
code for each kind of bad input. No torch is imported: plain Python and the simulator.
"""

import json
import subprocess
import sys
import time

import pytest
from conftest import REAL_DEVICE

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only")

CLIENT = r"""
import ctypes, json, os, struct, sys, time
acl = ctypes.CDLL("libascendcl.so")
hccl = ctypes.CDLL(os.environ.get("HCCL_SO_PATH", "libhccl.so"))
hccl.HcclGetErrorString.restype = ctypes.c_char_p
class RootInfo(ctypes.Structure):  # HcclRootInfo: 4108 opaque bytes
    _fields_ = [("internal", ctypes.c_byte * 4108)]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD"])
root_file = os.environ["ROOT_FILE"]
assert acl.aclrtSetDevice(rank) == 0
stream = ctypes.c_void_p()
assert acl.aclrtCreateStream(ctypes.byref(stream)) == 0
out = {"rank": rank}

def free_bytes():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert acl.aclrtGetMemInfo(1, ctypes.byref(f), ctypes.byref(t)) == 0  # ACL_HBM_MEM
    return f.value

def device(values, fmt):
    raw = struct.pack(f"<{len(values)}{fmt}", *values)
    p = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(p), ctypes.c_size_t(len(raw)), 0) == 0
    assert acl.aclrtMemcpy(p, ctypes.c_size_t(len(raw)), raw, ctypes.c_size_t(len(raw)), 1) == 0
    return p, len(raw)

def host(p, n, fmt):
    buf = ctypes.create_string_buffer(n)
    assert acl.aclrtMemcpy(buf, ctypes.c_size_t(n), p, ctypes.c_size_t(n), 2) == 0
    return list(struct.unpack(f"<{n // struct.calcsize(fmt)}{fmt}", buf.raw))

info = RootInfo()
comm = ctypes.c_void_p()
before = free_bytes()
if os.environ.get("RANK_TABLE"):
    r = hccl.HcclCommInitClusterInfo(os.environ["RANK_TABLE"].encode(), rank, ctypes.byref(comm))
else:
    if rank == 0:
        assert hccl.HcclGetRootInfo(ctypes.byref(info)) == 0
        with open(root_file + ".tmp", "wb") as f:
            f.write(bytes(info.internal))
        os.rename(root_file + ".tmp", root_file)
    else:
        while not os.path.exists(root_file):
            time.sleep(0.05)
        ctypes.memmove(ctypes.byref(info), open(root_file, "rb").read(), 4108)
    r = hccl.HcclCommInitRootInfo(world, ctypes.byref(info), rank, ctypes.byref(comm))
assert r == 0, r
out["buffers"] = before - free_bytes()
size, rid = ctypes.c_uint32(), ctypes.c_uint32()
assert hccl.HcclGetRankSize(comm, ctypes.byref(size)) == 0 and hccl.HcclGetRankId(comm, ctypes.byref(rid)) == 0
out["size_id"] = [size.value, rid.value]
# HcclDataType: INT16 1, INT32 2, FP16 3, FP32 4; HcclReduceOp: SUM 0, MAX 2.
a, na = device([1.5 * (rank + 1), -2.0, 3.25, 1000.0 * rank], "f")
assert hccl.HcclAllReduce(a, a, ctypes.c_uint64(4), 4, 0, comm, stream) == 0
b, nb = device([rank * 10 + i for i in range(6)], "i")
assert hccl.HcclBroadcast(b, ctypes.c_uint64(6), 2, 1, comm, stream) == 0
g_in, ng = device([rank + 0.5, rank + 0.25], "e")
g_out, ngo = device([0.0] * (2 * world), "e")
assert hccl.HcclAllGather(g_in, g_out, ctypes.c_uint64(2), 3, comm, stream) == 0
rs_in, _ = device([(rank + 1) * (i + 1) * (-1) ** i for i in range(2 * world)], "h")
rs_out, nrs = device([0, 0], "h")
assert hccl.HcclReduceScatter(rs_in, rs_out, ctypes.c_uint64(2), 1, 2, comm, stream) == 0
p2p, np2p = device([rank * 7.0] * 3, "f")
if rank == 0:
    assert hccl.HcclSend(p2p, ctypes.c_uint64(3), 4, 1, comm, stream) == 0
else:
    assert hccl.HcclRecv(p2p, ctypes.c_uint64(3), 4, 0, comm, stream) == 0
assert hccl.HcclBarrier(comm, stream) == 0
assert acl.aclrtSynchronizeStream(stream) == 0
out["all_reduce"] = host(a, na, "f")
out["broadcast"] = host(b, nb, "i")
out["all_gather"] = host(g_out, ngo, "e")
out["reduce_scatter"] = host(rs_out, nrs, "h")
out["recv"] = host(p2p, np2p, "f")
# Bad input: the documented HcclResult codes, nothing queued, nothing crashes.
out["unknown_dtype"] = hccl.HcclAllReduce(a, a, ctypes.c_uint64(4), 99, 0, comm, stream)
out["int128"] = hccl.HcclAllReduce(a, a, ctypes.c_uint64(4), 12, 0, comm, stream)
out["no_avg_in_hccl"] = hccl.HcclAllReduce(a, a, ctypes.c_uint64(4), 4, 4, comm, stream)
out["null_comm"] = hccl.HcclAllReduce(a, a, ctypes.c_uint64(4), 4, 0, None, stream)
out["root_out_of_range"] = hccl.HcclBroadcast(b, ctypes.c_uint64(6), 2, 5, comm, stream)
out["count_overflow"] = hccl.HcclAllReduce(a, a, ctypes.c_uint64(2**62), 4, 0, comm, stream)
out["error_string"] = hccl.HcclGetErrorString(9).decode()
e = ctypes.c_int()
assert hccl.HcclGetCommAsyncError(comm, ctypes.byref(e)) == 0
out["async_error"] = e.value
held = free_bytes()
assert hccl.HcclCommDestroy(comm) == 0
out["given_back"] = free_bytes() - held
out["destroyed_again"] = hccl.HcclCommDestroy(comm)
print(json.dumps(out))
"""


def _ranks(sim, extra=None, world=2):
    script = sim.tmp / "hccl_client.py"
    script.write_text(CLIENT)
    root_file = sim.tmp / f"root-{time.monotonic_ns()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=sim.env(
                devices=world,
                memory="2GiB",
                extra={"RANK": str(r), "WORLD": str(world), "ROOT_FILE": str(root_file), "HCCL_BUFFSIZE": "8", **(extra or {})},
            ),
            cwd=sim.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    for r, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}\n{stdout}\n{stderr}"
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def _check(outs):
    for r, out in enumerate(outs):
        assert out["size_id"] == [2, r]
        # 2 x HCCL_BUFFSIZE (8 MB) on the rank's device, outside any allocation, and back at destroy.
        assert out["buffers"] == 16 << 20
        assert out["given_back"] == 16 << 20
        assert out["all_reduce"] == [1.5 + 3.0, -4.0, 6.5, 1000.0]
        assert out["broadcast"] == [10, 11, 12, 13, 14, 15]
        assert out["all_gather"] == [0.5, 0.25, 1.5, 1.25]
        assert out["recv"] == [0.0, 0.0, 0.0]
        assert out["unknown_dtype"] == 1  # HCCL_E_PARA
        assert out["int128"] == 5  # HCCL_E_NOT_SUPPORT
        assert out["no_avg_in_hccl"] == 1
        assert out["null_comm"] == 2  # HCCL_E_PTR
        assert out["root_out_of_range"] == 1
        assert out["count_overflow"] == 1
        assert out["error_string"] == "timeout"
        assert out["async_error"] == 0
        assert out["destroyed_again"] == 1
    # Reduce-scatter with MAX over int16: rank r's share is the max over ranks of the slice.
    contributions = [[(k + 1) * (i + 1) * (-1) ** i for i in range(4)] for k in range(2)]
    maxes = [max(c[i] for c in contributions) for i in range(4)]
    assert outs[0]["reduce_scatter"] == maxes[:2] and outs[1]["reduce_scatter"] == maxes[2:]


def test_hccl_root_info_client_as_vllm_ascend_loads_it(sim):
    _check(_ranks(sim))


def test_hccl_rank_table_init(sim):
    table = {
        "status": "completed",
        "version": "1.0",
        "server_count": "1",
        "server_list": [
            {
                "server_id": "node_0",
                "device": [
                    {"device_id": "0", "device_ip": "192.168.1.8", "rank_id": "0"},
                    {"device_id": "1", "device_ip": "192.168.1.9", "rank_id": "1"},
                ],
            }
        ],
        # Different tables must not meet at the same root: a unique field per test run.
        "tms_test_run": str(time.monotonic_ns()),
    }
    path = sim.tmp / "rank_table.json"
    path.write_text(json.dumps(table))
    _check(_ranks(sim, extra={"RANK_TABLE": str(path)}))


LONELY = r"""
import ctypes, json, time
acl = ctypes.CDLL("libascendcl.so")
hccl = ctypes.CDLL("libhccl.so")
class RootInfo(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 4108)]
out = {}
comm = ctypes.c_void_p()
info = RootInfo()
assert hccl.HcclGetRootInfo(ctypes.byref(info)) == 0
out["no_device_set"] = hccl.HcclCommInitRootInfo(2, ctypes.byref(info), 0, ctypes.byref(comm))
assert acl.aclrtSetDevice(0) == 0
assert hccl.HcclGetRootInfo(ctypes.byref(info)) == 0
start = time.monotonic()
out["never_joined"] = hccl.HcclCommInitRootInfo(2, ctypes.byref(info), 0, ctypes.byref(comm))
out["seconds"] = time.monotonic() - start
out["garbage_root_info"] = hccl.HcclCommInitRootInfo(2, ctypes.byref(RootInfo()), 1, ctypes.byref(comm))
out["rank_out_of_range"] = hccl.HcclCommInitRootInfo(2, ctypes.byref(info), 2, ctypes.byref(comm))
out["missing_rank_table"] = hccl.HcclCommInitClusterInfo(b"/nonexistent/rank_table.json", 0, ctypes.byref(comm))
print(json.dumps(out))
"""


def test_hccl_connect_timeout_and_bad_init(sim):
    proc = sim.python(LONELY, devices=1, memory="2GiB", extra={"TMS_SIM_HCCL_CONNECT_TIMEOUT": "2"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["no_device_set"] == 15  # HCCL_E_RUNTIME: aclrtSetDevice first
    assert out["never_joined"] == 9, out  # HCCL_E_TIMEOUT
    assert 1.5 < out["seconds"] < 15, out
    assert out["garbage_root_info"] == 1
    assert out["rank_out_of_range"] == 1
    assert out["missing_rank_table"] == 10  # HCCL_E_OPEN_FILE_FAILURE


ONE_PROCESS = r"""
import ctypes, json, struct
acl = ctypes.CDLL("libascendcl.so")
hccl = ctypes.CDLL("libhccl.so")
class Item(ctypes.Structure):  # HcclSendRecvItem
    _fields_ = [("type", ctypes.c_int), ("buf", ctypes.c_void_p), ("count", ctypes.c_uint64),
                ("dataType", ctypes.c_int), ("remoteRank", ctypes.c_uint32)]
comms = (ctypes.c_void_p * 2)()
assert hccl.HcclCommInitAll(2, (ctypes.c_int32 * 2)(0, 1), comms) == 0
comms = [ctypes.c_void_p(c) for c in comms]
streams, bufs, a2a_in, a2a_out = [], [], [], []
def device(values):
    raw = struct.pack(f"<{len(values)}f", *values)
    p = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(p), ctypes.c_size_t(len(raw)), 0) == 0
    assert acl.aclrtMemcpy(p, ctypes.c_size_t(len(raw)), raw, ctypes.c_size_t(len(raw)), 1) == 0
    return p
for d in range(2):
    assert acl.aclrtSetDevice(d) == 0
    s = ctypes.c_void_p()
    assert acl.aclrtCreateStream(ctypes.byref(s)) == 0
    streams.append(s)
    bufs.append((device([d + 1.0] * 4), device([0.0] * 4)))
    a2a_in.append(device([10.0 * d + k for k in range(4)]))
    a2a_out.append(device([0.0] * 4))
# Each rank sends its first buffer to the other and receives into its second, items in
# opposite orders on the two ranks: as one batch neither can wait on the other.
for d in range(2):
    peer = 1 - d
    send, recv = Item(0, bufs[d][0], 4, 4, peer), Item(1, bufs[d][1], 4, 4, peer)
    items = (Item * 2)(*((send, recv) if d == 0 else (recv, send)))
    assert hccl.HcclBatchSendRecv(items, 2, comms[d], streams[d]) == 0
    assert hccl.HcclAlltoAll(a2a_in[d], ctypes.c_uint64(2), 4, a2a_out[d], ctypes.c_uint64(2), 4, comms[d], streams[d]) == 0
out = {"mismatched_alltoall": hccl.HcclAlltoAll(a2a_in[0], ctypes.c_uint64(2), 4, a2a_out[0], ctypes.c_uint64(1), 4, comms[0], streams[0])}
def host(p):
    buf = ctypes.create_string_buffer(16)
    assert acl.aclrtMemcpy(buf, ctypes.c_size_t(16), p, ctypes.c_size_t(16), 2) == 0
    return list(struct.unpack("<4f", buf.raw))
for d in range(2):
    assert acl.aclrtSetDevice(d) == 0
    assert acl.aclrtSynchronizeStream(streams[d]) == 0
out["received"] = [host(bufs[d][1]) for d in range(2)]
out["all_to_all"] = [host(a2a_out[d]) for d in range(2)]
for d in range(2):
    assert hccl.HcclCommDestroy(comms[d]) == 0
print(json.dumps(out))
"""


def test_hccl_one_process_two_devices_batch_send_recv_and_all_to_all(sim):
    proc = sim.python(ONE_PROCESS, devices=2, memory="2GiB", extra={"HCCL_BUFFSIZE": "8"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["received"] == [[2.0] * 4, [1.0] * 4]
    # Rank d's slice p (2 elements) goes to rank p's slot d.
    assert out["all_to_all"] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
    assert out["mismatched_alltoall"] == 1


UNDER_HOOK = r"""
import ctypes, json, os, sys
acl = ctypes.CDLL("libascendcl.so")
# As vllm-ascend's communicator loads it: by name, names looked up on that handle.
hccl = ctypes.CDLL("libhccl.so")
hook = ctypes.CDLL(os.environ["TMS_HOOK"])
class RootInfo(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 4108)]
class Config(ctypes.Structure):  # HcclCommConfig's head, as HcclCommConfigInit fills it
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("reserved", ctypes.c_uint64), ("hcclBufferSize", ctypes.c_uint32), ("rest", ctypes.c_byte * 252)]
def free_bytes(dev):
    assert acl.aclrtSetDevice(dev) == 0
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert acl.aclrtGetMemInfo(1, ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value
out = {}
before = [free_bytes(0), free_bytes(1)]
comms = (ctypes.c_void_p * 2)()
assert hccl.HcclCommInitAll(2, (ctypes.c_int32 * 2)(0, 1), comms) == 0
assert acl.aclrtSetDevice(1) == 0
info, one = RootInfo(), ctypes.c_void_p()
assert hccl.HcclGetRootInfo(ctypes.byref(info)) == 0
cfg = Config(ctypes.sizeof(Config), 0xF0F0F0F0, 1, 0, 4)
assert hccl.HcclCommInitRootInfoConfig(1, ctypes.byref(info), 0, ctypes.byref(cfg), ctypes.byref(one)) == 0
out["taken"] = [b - free_bytes(d) for d, b in enumerate(before)]
out["handles"] = [comms[0], comms[1], one.value]
print("ready " + json.dumps(out), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "pause":
        print("pause_nccl=%d pause_all=%d resume_nccl=%d" % (hook.tms_pause(b"nccl"), hook.tms_pause(None), hook.tms_resume(b"nccl")), flush=True)
    elif cmd == "destroy":
        assert hccl.HcclCommDestroy(ctypes.c_void_p(comms[0])) == 0
        print("destroyed", flush=True)
    else:
        break
"""


def test_hccl_communicators_are_measured_under_the_hook_and_cannot_be_paused(sim):
    # issue 32: HCCL cannot release a live communicator's buffers, so tms shows what they cost.
    from test_nccl_pause import _ctl_binary

    ctl = _ctl_binary(sim.hook)
    control = sim.tmp / "control"
    control.mkdir(mode=0o700)
    name = f"hccl-{time.monotonic_ns()}"
    env = sim.env(
        devices=2,
        memory="2GiB",
        preload=sim.hook,
        extra={"TMS_HOOK": str(sim.hook), "HCCL_BUFFSIZE": "16", "TMS_CONTROL": "1", "TMS_CONTROL_DIR": str(control), "TMS_NAME": name},
    )
    script = sim.tmp / "hccl_under_hook.py"
    script.write_text(UNDER_HOOK)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=sim.tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(cmd):
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    def ctl_json(*args):
        r = subprocess.run([str(ctl), "--dir", str(control), *args], capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout, r.stderr

    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready "), ready + proc.stderr.read() if proc.poll() is not None else ready
        out = json.loads(ready.split(" ", 1)[1])
        mib = 1 << 20
        # HcclCommInitAll: 2 x HCCL_BUFFSIZE (16 MB) per device; the config's 4 MB on device 1.
        assert out["taken"] == [32 * mib, 32 * mib + 8 * mib], out
        # The hook serves its control socket from a thread of its own, which may start after the
        # script's "ready": look until it is there (as a launcher would), at most 10 s.
        deadline = time.monotonic() + 10
        while True:
            rc, stdout, stderr = ctl_json("status", name, "--json")
            if rc == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert rc == 0, stderr
        comms = json.loads(stdout)[0]["status"]["communicators"]
        seen = sorted((c["handle"], c["library"], c["device"], c["persistent_bytes"], c["suspendable_bytes"]) for c in comms)
        h = out["handles"]
        assert seen == sorted([(h[0], "hccl", 0, 32 * mib, 0), (h[1], "hccl", 1, 32 * mib, 0), (h[2], "hccl", 1, 8 * mib, 0)]), comms
        rc, stdout, _ = ctl_json("list", "--json")
        row = json.loads(stdout)[0]
        assert row["communicators"] == [
            {"library": "hccl", "count": 3, "suspendable_bytes": 0, "persistent_bytes": 72 * mib, "suspended": 0, "suspended_bytes": 0}
        ], row
        rc, stdout, _ = ctl_json("list")
        assert "3 hccl communicator(s): buffers 72.0 MiB (HCCL cannot release them" in stdout, stdout
        rc, stdout, _ = ctl_json("status", name)
        assert stdout.count("cannot be released (HCCL_BUFFSIZE sizes them)") == 3, stdout
        # Tag nccl fails, saying why; every tag at once and a resume are no error.
        assert ask("pause") == "pause_nccl=1 pause_all=0 resume_nccl=0"
        rc, stdout, stderr = ctl_json("pause", name, "--tag", "nccl")
        assert rc == 1 and "HCCL communicators cannot be suspended" in stdout + stderr, (rc, stdout, stderr)
        assert ask("destroy") == "destroyed"
        rc, stdout, _ = ctl_json("list", "--json")
        assert json.loads(stdout)[0]["communicators"][0]["count"] == 2, stdout
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
