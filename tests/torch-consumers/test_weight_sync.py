"""Weight sync between a trainer and a rollout engine, re-enacted with real PyTorch on the
simulator's libnccl.so.2 (and libhccl.so) the way the RL frameworks drive it: the call sequences
were read at the upstream commits each test names; the code here is our own.

Each test starts its ranks once (one torch start per process) and runs several rounds in them;
the processes meet through files in the test's scratch folder where the frameworks use Ray or HTTP
(requests, replies), and through TCP stores and communicators exactly as the frameworks do.
Every wait is bounded: control files, stores and communicators have short timeouts, and every
process has one.
"""

import json
import subprocess
import sys
import time

import pytest
from conftest import REAL_DEVICE, free_port

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only: needs as many devices as ranks")

# Shared by the rank programs: control files (the stand-in for Ray calls / HTTP requests) and
# byte-exact checksums of tensors.
COMMON = r"""
import hashlib, json, os, time, torch
CTL = os.environ["CTL"]

def post(name, obj):
    tmp = os.path.join(CTL, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, os.path.join(CTL, name))

def await_file(name, timeout=60.0):
    path = os.path.join(CTL, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} never came")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)

def digest(t):
    return hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

def model(seed, device):
    # A small decoder's parameter list: bf16 matrices and fp32 norms, about 3 MiB in all.
    g = torch.Generator().manual_seed(seed)
    specs = []
    for layer in range(3):
        specs += [(f"model.layers.{layer}.self_attn.qkv_proj.weight", (384, 128), torch.bfloat16),
                  (f"model.layers.{layer}.mlp.gate_up_proj.weight", (512, 128), torch.bfloat16),
                  (f"model.layers.{layer}.mlp.down_proj.weight", (128, 256), torch.bfloat16),
                  (f"model.layers.{layer}.input_layernorm.weight", (128,), torch.float32)]
    specs += [("model.norm.weight", (128,), torch.float32), ("lm_head.weight", (1000, 128), torch.bfloat16),
              ("model.rotary.inv_freq", (7, 3), torch.float32)]
    return {n: torch.randn(s, generator=g).to(d).to(device) for n, s, d in specs}
"""

# ---- SGLang's named group, driven as slime drives it ------------------------------------------

SGLANG_SLIME = COMMON + r"""
import inspect
from datetime import timedelta
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ROLE = os.environ["ROLE"]
out = {}

def join_named_group(backend, init_method, world_size, rank, group_name, timeout):
    # A second "world" beside the process's default group: its own TCP rendezvous, its store
    # prefixed by the group's name, a process group made by torch's helper and registered with
    # its ranks, as SGLang's init_custom_process_group does.
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg

timeout = timedelta(seconds=60)
if ROLE == "trainer":
    torch.cuda.set_device(0)
    # Megatron's own world (one rank here).
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['TRAIN_PORT']}", rank=0, world_size=1)
    engine_gpus = [int(os.environ["ENGINE_TP"])]
    world_size = sum(engine_gpus) + 1
    offsets = [1 + sum(engine_gpus[:i]) for i in range(len(engine_gpus))]
    group_name = "slime-pp_0"
    init = dict(master_address="127.0.0.1", master_port=int(os.environ["GROUP_PORT"]), world_size=world_size,
                group_name=group_name, backend="nccl")
    # engine.init_weights_update_group.remote(...) for every engine, then the trainer joins as rank 0,
    # then ray.get on the engines' replies.
    for i, off in enumerate(offsets):
        post(f"engine{i}-init", dict(init, rank_offset=off))
    group = join_named_group("nccl", f"tcp://127.0.0.1:{init['master_port']}", world_size, 0, group_name, timeout)
    for tp in range(engine_gpus[0]):
        assert await_file(f"engine0-tp{tp}-init-reply")["success"]
    params = model(seed=1, device="cuda")
    seq = 0
    def request(obj):
        global seq
        post(f"req-{seq:04d}", obj)
        seq += 1
        return seq - 1
    def await_replies(n):
        for tp in range(engine_gpus[0]):
            assert await_file(f"reply-{n:04d}-tp{tp}")["success"]
    def buckets(limit):
        # Bucketed by bytes in parameter order, like --update-weight-buffer-size.
        bucket, size = [], 0
        for name, t in params.items():
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(name)
            size += nbytes
        if bucket:
            yield bucket
    request({"kind": "snapshot", "label": "before"})
    # Version 1: per-tensor broadcasts, each bucket announced to the engine first.
    nb = 0
    for names in buckets(256 << 10):
        n = request({"kind": "update", "names": names, "dtypes": [str(params[k].dtype).replace("torch.", "") for k in names],
                     "shapes": [list(params[k].shape) for k in names], "group_name": group_name, "weight_version": "1"})
        handles = [dist.broadcast(params[k].data, 0, group=group, async_op=True) for k in names]
        for h in handles:
            h.wait()
        await_replies(n)
        nb += 1
    out["buckets_v1"] = nb
    out["v1"] = {k: digest(t) for k, t in params.items()}
    request({"kind": "snapshot", "label": "v1"})
    # A training step changes every weight; version 2 goes as flattened buckets (one flat tensor
    # of bytes per bucket, one broadcast).
    with torch.no_grad():
        for t in params.values():
            t.mul_(-0.5).add_(0.25)
    out["v2"] = {k: digest(t) for k, t in params.items()}
    nb = 0
    for names in buckets(1 << 20):
        meta, flat, offset = [], [], 0
        for k in names:
            b = params[k].reshape(-1).view(torch.uint8)
            meta.append({"name": k, "dtype": str(params[k].dtype).replace("torch.", ""), "shape": list(params[k].shape),
                         "start": offset, "end": offset + b.numel()})
            flat.append(b)
            offset += b.numel()
        flat = torch.cat(flat)
        n = request({"kind": "update_flat", "meta": meta, "bytes": offset, "group_name": group_name, "weight_version": "2"})
        dist.broadcast(flat, 0, group=group)
        await_replies(n)
        nb += 1
    out["buckets_v2"] = nb
    request({"kind": "snapshot", "label": "v2"})
    n = request({"kind": "destroy", "group_name": group_name})
    await_replies(n)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
else:
    tp = int(os.environ["TP_RANK"])
    tp_size = int(os.environ["ENGINE_TP"])
    torch.cuda.set_device(1 + tp)
    # The engine's own tensor-parallel world: SGLang requires it before a weights-update group.
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['ENGINE_PORT']}", rank=tp, world_size=tp_size)
    params = model(seed=99, device="cuda")  # the engine starts from other weights
    where = {k: t.data_ptr() for k, t in params.items()}
    req = await_file("engine0-init")
    rank = req["rank_offset"] + tp
    groups = {req["group_name"]: join_named_group(
        req["backend"], f"tcp://{req['master_address']}:{req['master_port']}", req["world_size"], rank, req["group_name"], timeout)}
    out["rank"] = rank
    post(f"engine0-tp{tp}-init-reply", {"success": True})
    def load_weights(pairs):
        with torch.no_grad():
            for name, w in pairs:
                params[name].copy_(w)
    n = 0
    while True:
        req = await_file(f"req-{n:04d}")
        kind = req["kind"]
        if kind == "snapshot":
            out[req["label"]] = {k: digest(t) for k, t in params.items()}
            n += 1
            continue
        if kind == "update":
            group = groups[req["group_name"]]
            recv = [torch.empty(s, dtype=DTYPES[d], device="cuda") for d, s in zip(req["dtypes"], req["shapes"])]
            handles = [dist.broadcast(w, src=0, group=group, async_op=True) for w in recv]
            for h in handles:
                h.wait()
            load_weights(zip(req["names"], recv))
        elif kind == "update_flat":
            flat = torch.empty(req["bytes"], dtype=torch.uint8, device="cuda")
            dist.broadcast(flat, src=0, group=groups[req["group_name"]])
            load_weights((m["name"], flat[m["start"]:m["end"]].view(DTYPES[m["dtype"]]).view(m["shape"])) for m in req["meta"])
        elif kind == "destroy":
            dist.destroy_process_group(groups.pop(req["group_name"]))
        torch.cuda.synchronize()
        post(f"reply-{n:04d}-tp{tp}", {"success": True})
        n += 1
        if kind == "destroy":
            break
    out["storage_kept"] = all(params[k].data_ptr() == p for k, p in where.items())
    out["dtypes"] = {k: str(t.dtype) for k, t in params.items()}
    dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def _run_ranks(sim, program, ranks, devices, extra=None, timeout=120):
    """Starts one process per entry of `ranks` (its own environment), waits for all, and returns
    each one's RESULT object; any failure or timeout fails the test with every rank's output."""
    script = sim.tmp / f"ranks_{time.monotonic_ns()}.py"
    script.write_text(program)
    ctl = sim.tmp / f"ctl_{time.monotonic_ns()}"
    ctl.mkdir()
    procs = []
    for env in ranks:
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=sim.env(
                    devices=devices,
                    memory="2GiB",
                    extra={"CTL": str(ctl), "OMP_NUM_THREADS": "1", **(extra or {}), **env},
                ),
                cwd=sim.tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(f"--- rank process {i} (exit {p.returncode})\n{o}" for i, (p, o) in enumerate(zip(procs, outs)))
    results = []
    for p, o in zip(procs, outs):
        assert p.returncode == 0, report
        line = [l for l in o.splitlines() if l.startswith("RESULT ")]
        assert line, report
        results.append(json.loads(line[-1][len("RESULT "):]))
    return results


def test_sglang_weights_update_group_with_slime_s_bucket_loop(sim):
    """Re-enacts the non-colocated weight update of slime over SGLang's weights-update group:

    - sgl-project/sglang python/sglang/srt/model_executor/model_runner.py @ 01cc04e2,
      `ModelRunner.init_weights_update_group` (rank = rank_offset + tp_rank; the default torch
      group must exist; `init_custom_process_group(backend, init_method="tcp://addr:port",
      world_size, rank, group_name)`: rendezvous, a store prefixed with the group name,
      `distributed_c10d._new_process_group_helper`, `_world.pg_group_ranks`) and
      `update_weights_from_distributed` (per tensor `torch.empty(shape, dtype)` and
      `broadcast(src=0, group, async_op=True)`, wait on all, then `load_weights`; with
      `load_format="flattened_bucket"` one flat tensor, one broadcast, then the tensors rebuilt).
    - THUDM/slime slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py
      @ 02a644a7 (`connect_rollout_engines` / `update_weights`): group "slime-pp_{pp_rank}",
      world_size = engine GPUs + 1, engine i at rank_offset = cumulative GPUs + 1; the engines
      are asked to init first, the trainer joins as rank 0 with the nccl backend, then waits for
      the engines' replies; per bucket (by `--update-weight-buffer-size`) the engine is told the
      names, dtypes and shapes, each tensor is broadcast from rank 0 with `async_op=True`, the
      handles waited, then the engine's reply awaited.

    Here: a trainer (rank 0, device 0, its own one-rank default group) and one engine of
    tensor-parallel size 2 (ranks 1 and 2, devices 1 and 2, their own two-rank default group).
    Version 1 goes per tensor in 256 KiB buckets, version 2 (after a "training step") as
    flattened 1 MiB buckets of bytes. The engine's weights must equal the trainer's byte for byte
    after each version (bf16 and fp32, checked by SHA-256 of the bytes), and must differ before.
    """
    # TORCH_DIST_USE_NCCL2=0: "nccl" is ProcessGroupNCCL, as in the torch releases SGLang and slime
    # pin. (This torch's default "nccl2" splits a new group from a default group bound to a
    # device, and a group made with no global ranks, as SGLang's helper makes it, is then not
    # joined: `_new_process_group_helper` returns NON_GROUP_MEMBER.)
    ports = {k: str(free_port()) for k in ("TRAIN_PORT", "ENGINE_PORT", "GROUP_PORT")}
    common = {"ENGINE_TP": "2", "TORCH_DIST_USE_NCCL2": "0", "TMS_SIM_NCCL_CONNECT_TIMEOUT": "60", **ports}
    trainer, e0, e1 = _run_ranks(
        sim,
        SGLANG_SLIME,
        [{"ROLE": "trainer"}, {"ROLE": "engine", "TP_RANK": "0"}, {"ROLE": "engine", "TP_RANK": "1"}],
        devices=3,
        extra=common,
    )
    assert trainer["buckets_v1"] >= 4 and trainer["buckets_v2"] >= 2, trainer
    assert [e0["rank"], e1["rank"]] == [1, 2]
    names = set(trainer["v1"])
    assert len(names) == 15
    for engine in (e0, e1):
        assert engine["before"].keys() == names
        assert all(engine["before"][k] != trainer["v1"][k] for k in names), "the engine started with the trainer's weights"
        assert engine["v1"] == trainer["v1"], "per-tensor buckets: the engine's weights differ from the trainer's"
        assert engine["v2"] == trainer["v2"], "flattened buckets: the engine's weights differ from the trainer's"
        assert all(trainer["v1"][k] != trainer["v2"][k] for k in names)
        assert engine["storage_kept"], "loading must write into the engine's own parameters"
        assert {engine["dtypes"][k] for k in names} == {"torch.bfloat16", "torch.float32"}


# ---- verl's stateless group with a ctypes communicator ----------------------------------------

VERL_STATELESS = COMMON + r"""
import ctypes, pickle
from datetime import timedelta
from torch.distributed import TCPStore

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD"])
torch.cuda.set_device(RANK)
out = {"rank": RANK}

class StatelessGroup:
    # A group that is only a TCP store: rank 0 serves it and waits for the others, the others
    # connect; objects go through it pickled under per-broadcast keys.
    def __init__(self, port, timeout_s):
        self.store = TCPStore("127.0.0.1", port, WORLD, RANK == 0, timedelta(seconds=timeout_s))
        self.count = 0
    def broadcast_obj(self, obj, src):
        key = f"broadcast_from/{src}/{self.count}"
        self.count += 1
        if RANK == src:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]

NCCL_DTYPE = {torch.uint8: 1, torch.float32: 7, torch.bfloat16: 9}  # nccl.h's ncclDataType_t

class CtypesNccl:
    # libnccl.so.2 loaded by ctypes, the unique id from rank 0 handed over by the stateless group,
    # every rank's ncclCommInitRank, a 1-element warm-up all-reduce, collectives on torch streams.
    def __init__(self, group, device):
        lib = self.lib = ctypes.CDLL("libnccl.so.2")
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        version = ctypes.c_int()
        self.check(lib.ncclGetVersion(ctypes.byref(version)))
        out["nccl_version"] = version.value
        uid = NcclUniqueId()
        if RANK == 0:
            self.check(lib.ncclGetUniqueId(ctypes.byref(uid)))
        raw = group.broadcast_obj(bytes(uid.internal), src=0)
        ctypes.memmove(ctypes.byref(uid), raw, 128)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.check(lib.ncclCommInitRank(ctypes.byref(self.comm), WORLD, uid, RANK))
            warm = torch.zeros(1, device=device)
            self.all_reduce(warm)
            torch.cuda.current_stream().synchronize()
    def check(self, r):
        if r != 0:
            raise RuntimeError(f"NCCL error {r}: {self.lib.ncclGetErrorString(r).decode()}")
    def all_reduce(self, t, stream=None):
        stream = stream or torch.cuda.current_stream()
        self.check(self.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), NCCL_DTYPE[t.dtype], 0, self.comm,
                                          stream.cuda_stream))
    def broadcast(self, t, src, stream=None):
        stream = stream or torch.cuda.current_stream()
        send = t.data_ptr() if src == RANK else None  # only the root has a send buffer
        self.check(self.lib.ncclBroadcast(send, t.data_ptr(), t.numel(), NCCL_DTYPE[t.dtype], src, self.comm,
                                          stream.cuda_stream))
    def destroy(self):
        self.check(self.lib.ncclCommDestroy(self.comm))

def attempt(what, fn):
    start = time.monotonic()
    try:
        fn()
        out[what] = "ok"
    except Exception as e:
        out[what] = f"{type(e).__name__}: {e}"[:400]
    out[what + "_s"] = round(time.monotonic() - start, 2)

# Round 1: the creation calls not awaited together. The rollout ranks come to the store while
# the actor's call (dispatched, never awaited) has not run; it runs after they have given up.
race_timeout = float(os.environ["RACE_STORE_TIMEOUT"])
if RANK == 0:
    for r in range(1, WORLD):
        await_file(f"race-gave-up-{r}")
    attempt("race", lambda: StatelessGroup(int(os.environ["RACE_PORT"]), race_timeout))
else:
    attempt("race", lambda: CtypesNccl(StatelessGroup(int(os.environ["RACE_PORT"]), race_timeout), RANK))
    post(f"race-gave-up-{RANK}", {})

# Round 2: every rank's creation awaited together.
group = StatelessGroup(int(os.environ["GROUP_PORT"]), 30)
comm = CtypesNccl(group, RANK)
params = model(seed=1 if RANK == 0 else 99, device="cuda")
out["before"] = {k: digest(t) for k, t in params.items()}
# The actor broadcasts each tensor of its weights info from rank 0; a rollout rank receives into a
# new tensor and loads it. Every other tensor goes on a side stream ordered against the current one.
side = torch.cuda.Stream()
for i, (name, t) in enumerate(params.items()):
    buf = t if RANK == 0 else torch.empty_like(t)
    if i % 2:
        side.wait_stream(torch.cuda.current_stream())
        comm.broadcast(buf, 0, side)
        torch.cuda.current_stream().wait_stream(side)
    else:
        comm.broadcast(buf, 0)
    if RANK != 0:
        with torch.no_grad():
            t.copy_(buf)
torch.cuda.synchronize()
out["nccl"] = {k: digest(t) for k, t in params.items()}
comm.destroy()

# Round 3: the same rendezvous with libhccl.so on ACL streams, as vllm-ascend's communicator does
# it (no torch_npu: the bytes go through host copies). The actor trains a step first.
if os.environ.get("WITH_HCCL") == "1":
    with torch.no_grad():
        if RANK == 0:
            for t in params.values():
                t.mul_(-0.5).add_(0.25)
    acl = ctypes.CDLL("libascendcl.so")
    hccl = ctypes.CDLL("libhccl.so")
    hccl.HcclGetErrorString.restype = ctypes.c_char_p
    class RootInfo(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 4108)]
    def ok(r, what):
        if r != 0:
            raise RuntimeError(f"{what}: {r}")
    HCCL_DTYPE = {torch.float32: 4, torch.bfloat16: 11}  # HcclDataType
    ok(acl.aclrtSetDevice(RANK), "aclrtSetDevice")
    stream = ctypes.c_void_p()
    ok(acl.aclrtCreateStream(ctypes.byref(stream)), "aclrtCreateStream")
    hgroup = StatelessGroup(int(os.environ["HCCL_PORT"]), 30)
    info = RootInfo()
    if RANK == 0:
        ok(hccl.HcclGetRootInfo(ctypes.byref(info)), "HcclGetRootInfo")
    ctypes.memmove(ctypes.byref(info), hgroup.broadcast_obj(bytes(info.internal), src=0), 4108)
    hcomm = ctypes.c_void_p()
    ok(hccl.HcclCommInitRootInfo(WORLD, ctypes.byref(info), RANK, ctypes.byref(hcomm)), "HcclCommInitRootInfo")
    def device_copy(data, nbytes):
        p = ctypes.c_void_p()
        ok(acl.aclrtMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes), 0), "aclrtMalloc")
        if data is not None:
            ok(acl.aclrtMemcpy(p, ctypes.c_size_t(nbytes), data, ctypes.c_size_t(nbytes), 1), "aclrtMemcpy H2D")
        return p
    warm = device_copy(bytes(4), 4)
    ok(hccl.HcclAllReduce(warm, warm, ctypes.c_uint64(1), 4, 0, hcomm, stream), "HcclAllReduce")
    ok(acl.aclrtSynchronizeStream(stream), "warm-up")
    bufs = {}
    for name, t in params.items():
        raw = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        bufs[name] = device_copy(raw if RANK == 0 else None, len(raw))
        ok(hccl.HcclBroadcast(bufs[name], ctypes.c_uint64(t.numel()), HCCL_DTYPE[t.dtype], 0, hcomm, stream), name)
    ok(acl.aclrtSynchronizeStream(stream), "aclrtSynchronizeStream")
    for name, t in params.items():
        n = t.numel() * t.element_size()
        host = ctypes.create_string_buffer(n)
        ok(acl.aclrtMemcpy(host, ctypes.c_size_t(n), bufs[name], ctypes.c_size_t(n), 2), "aclrtMemcpy D2H")
        if RANK != 0:
            with torch.no_grad():
                t.copy_(torch.frombuffer(bytearray(host.raw), dtype=torch.uint8).view(t.dtype).view(t.shape))
    out["hccl"] = {k: digest(t) for k, t in params.items()}
    ok(hccl.HcclCommDestroy(hcomm), "HcclCommDestroy")
print("RESULT " + json.dumps(out))
"""


def test_verl_stateless_group_ctypes_nccl_and_hccl_and_the_creation_race(sim):
    """Re-enacts verl's weight sync between disjoint actor and rollout pools over a stateless group
    and a ctypes communicator (verl PR 5043, merged as 064b4552; volcengine/verl):

    - verl/experimental/fully_async_policy/param_sync.py `ParameterSynchronizer._init_sync_group`
      (NPU branch; read at the versions the index holds, e.g. file id 36226540969): the address
      and a free port (bind-and-release) from actor worker 0, then
      `actor_wg.create_weight_sync_group(addr, port, 0, n)` dispatched and NOT awaited, and
      `ray.get(rollout_wg.create_weight_sync_group(addr, port, n_actor, n))` awaited alone; the
      workers' `create_weight_sync_group` (rank = own rank + rank_offset) call
      `stateless_init_process_group` (verl/utils/distributed.py, vLLM's example helper):
      `StatelessProcessGroup.create(host, port, rank, world_size)` (a TCPStore, rank 0 its
      server) and `PyNcclCommunicator(pg, device)` (vllm/distributed/device_communicators/
      pynccl.py: libnccl.so.2 by ctypes, `ncclGetUniqueId` on rank 0, the id through
      `broadcast_obj`, `ncclCommInitRank` under `torch.cuda.device`, a 1-element warm-up
      all-reduce, `ncclBroadcast` with a null send buffer off the root on the caller's torch
      stream); `sync_rollout_weights` broadcasts each tensor of the weights info from rank 0 and
      the rollout loads it.
    - The race the PR's review named: the rollout ranks can join before rank 0 has created the
      store, and the actor's creation is never awaited. Round 1 makes the actor's call run after
      the rollouts' store timeout (3 s): both sides must fail within their timeouts (the rollouts
      cannot reach a store; the actor's store sees no clients), never hang.
    - Round 2: every rank's creation awaited together: the communicator forms and the rollouts'
      weights equal the actor's byte for byte (bf16 and fp32; half of the tensors on a side stream).
    - Round 3, Ascend: the same rendezvous with libhccl.so as vllm-ascend's pyhccl communicator
      makes it (vllm_ascend/distributed/device_communicators/pyhccl.py @ 1e263aec,
      pyhccl_wrapper.py @ 2568f302: `HcclGetRootInfo` on rank 0, the 4108-byte root info through
      the stateless group, `HcclCommInitRootInfo`, a warm-up all-reduce, `HcclBroadcast` on an
      ACL stream), after a training step; the rollouts get the new weights byte for byte.
    """
    ports = {k: str(free_port()) for k in ("RACE_PORT", "GROUP_PORT", "HCCL_PORT")}
    common = {
        "WORLD": "3",
        "RACE_STORE_TIMEOUT": "3",
        "WITH_HCCL": "1",
        "HCCL_BUFFSIZE": "8",
        "TMS_SIM_NCCL_CONNECT_TIMEOUT": "20",
        "TMS_SIM_HCCL_CONNECT_TIMEOUT": "20",
        **ports,
    }
    started = time.monotonic()
    actor, *rollouts = _run_ranks(sim, VERL_STATELESS, [{"RANK": str(r)} for r in range(3)], devices=3, extra=common)
    took = time.monotonic() - started
    # Round 1: not awaited together, both sides fail, each within its store timeout.
    for r in rollouts:
        assert "timed out" in r["race"] and "connect" in r["race"], r["race"]  # no store to reach
        assert 2.5 < r["race_s"] < 15, r
    assert "waiting for clients" in actor["race"], actor["race"]  # its store: no one came
    assert 2.5 < actor["race_s"] < 15, actor
    assert took < 100, f"the ranks took {took:.0f} s"
    # Round 2: awaited together, the rollouts' weights are the actor's.
    assert actor["nccl_version"] == 23007  # the simulator's library, not a real NCCL
    names = set(actor["nccl"])
    assert len(names) == 15
    for r in rollouts:
        assert all(r["before"][k] != actor["before"][k] for k in names), "the rollout started with the actor's weights"
        assert r["nccl"] == actor["nccl"], f"rank {r['rank']}: weights differ from the actor's after the NCCL sync"
    # Round 3: HCCL, after a training step.
    assert all(actor["hccl"][k] != actor["nccl"][k] for k in names)
    for r in rollouts:
        assert r["hccl"] == actor["hccl"], f"rank {r['rank']}: weights differ from the actor's after the HCCL sync"
