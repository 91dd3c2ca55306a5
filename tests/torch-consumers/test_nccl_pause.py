"""Tag `nccl` under an unchanged torch.distributed program (issue 32): ranks with the hook
preloaded, a default NCCL process group and a second one from `new_group`; the communicators
PyTorch makes are paused and resumed through tms's Python API and through tms-ctl from outside.

One start of the ranks serves every case of this file (PyTorch's import and the process groups'
set-up are most of the time): the ranks run a small command loop (RANK_SERVER), and each test
drives them over stdin/stdout, in file order.

On the simulator: 2 ranks on 2 devices. On a real GPU (the hardware kit) NCCL refuses two ranks of
one communicator on the same device ("Duplicate GPU detected", ncclInvalidUsage), and a kit
machine may have one GPU, so there each group is a 1-rank communicator, which NCCL still gives
buffers that ncclCommSuspend releases.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REAL_DEVICE, SimRun, free_port

RANK_SERVER = r"""
import json, os, sys, time, traceback
import torch, torch.distributed as dist
from datetime import timedelta
import tms

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank % torch.cuda.device_count())
# As a training script sets them up: the default group, then a second one over the same ranks.
dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
groups = {"world": None, "second": dist.new_group(ranks=list(range(world)))}

def free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]

def broadcast(name, seed):
    # The last rank's values, different per call, so a stale buffer cannot pass for a result.
    src = world - 1
    want = torch.arange(4096, dtype=torch.float32) * (seed + 1) + src
    x = (want if rank == src else torch.full((4096,), -1.0)).cuda()
    start = time.monotonic()
    try:
        dist.broadcast(x, src=src, group=groups[name])
        torch.cuda.synchronize()
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"ok": bool(torch.equal(x.cpu(), want)), "seconds": time.monotonic() - start}

def report(fn):
    before = free()
    try:
        r = fn("nccl")
    except tms.TmsError as e:
        return {"raised": str(e)}
    return {"report": r, "free_before": before, "free_after": free()}

def handle(cmd, arg):
    if cmd == "free":
        return {"free": free()}
    if cmd == "broadcast":
        name, seed = arg.split()
        return broadcast(name, int(seed))
    if cmd == "pause":
        return report(tms.pause_report)
    if cmd == "resume":
        return report(tms.resume_report)
    if cmd == "destroy":
        before = free()
        dist.destroy_process_group()
        return {"free_before": before, "free_after": free()}
    raise ValueError(cmd)

for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "quit":
        break
    try:
        out = handle(cmd, arg)
    except Exception:
        out = {"exception": traceback.format_exc()}
    print("@" + json.dumps(out), flush=True)
"""

WORLD = 1 if REAL_DEVICE else 2


def _ctl_binary(hook):
    """tms-ctl beside the hook: target/<profile>/ in a checkout, bin/ beside lib/ in the kit."""
    for p in (Path(hook).parent / "tms-ctl", Path(hook).parent.parent / "bin" / "tms-ctl"):
        if p.is_file():
            return p
    return shutil.which("tms-ctl")


class Ranks:
    def __init__(self, sim):
        self.sim = sim
        self.ctl = _ctl_binary(sim.hook)
        self.control_dir = sim.tmp / "control"
        self.control_dir.mkdir(mode=0o700, exist_ok=True)
        script = sim.tmp / "rank_server.py"
        script.write_text(RANK_SERVER)
        port = free_port()
        self.name = f"pg-{os.getpid()}"
        package = Path(__file__).resolve().parents[2] / "python"
        self.procs = []
        self.logs = []
        for rank in range(WORLD):
            extra = {
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TMS_SIM_NCCL_CONNECT_TIMEOUT": "60",
                "TMS_CONTROL": "1",
                "TMS_CONTROL_DIR": str(self.control_dir),
                "TMS_NAME": self.name,
            }
            env = sim.env(devices=WORLD, memory="2GiB", preload=sim.hook, extra=extra)
            if package.is_dir():  # python/ of a checkout, or of the hardware kit
                env["PYTHONPATH"] = ":".join(p for p in (env.get("PYTHONPATH"), str(package)) if p)
            p = subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                cwd=sim.tmp,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            self.procs.append(p)
            self.logs.append([])

    def _read(self, rank, timeout):
        """The rank's next answer; its other output is kept for failure messages."""
        p, log = self.procs[rank], self.logs[rank]
        box = []

        def reader():
            for line in p.stdout:
                if line.startswith("@"):
                    box.append(json.loads(line[1:]))
                    return
                log.append(line)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout)
        if not box:
            raise AssertionError(f"rank {rank} gave no answer within {timeout} s:\n{''.join(log[-40:])}")
        return box[0]

    def ask(self, cmd, timeout=120):
        """Sends `cmd` to every rank at once (collectives need them all) and returns the answers."""
        for p in self.procs:
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
        answers = [self._read(r, timeout) for r in range(WORLD)]
        for r, a in enumerate(answers):
            assert "exception" not in a, f"rank {r}: {cmd}: {a['exception']}"
        return answers

    def tms_ctl(self, *args):
        assert self.ctl, "tms-ctl not found beside the hook"
        return subprocess.run(
            [str(self.ctl), "--dir", str(self.control_dir), "--json", *args], capture_output=True, text=True, timeout=60
        )

    def status(self):
        out = self.tms_ctl("status", self.name)
        assert out.returncode == 0, out.stdout + out.stderr
        return {row["pid"]: row["status"] for row in json.loads(out.stdout)}

    def close(self):
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    r = Ranks(SimRun(tmp_path_factory.mktemp("nccl-pause")))
    # Every process group's communicator exists only after its first collective.
    for name in ("world", "second"):
        for a in r.ask(f"broadcast {name} 0", timeout=240):
            assert a["ok"], a
    yield r
    r.close()


def _nccl_lacks_suspend():
    """On a real GPU: whether PyTorch's NCCL predates ncclCommSuspend/ncclCommMemStats (2.29.7;
    PyTorch 2.11's wheels bring 2.28.9). The simulator's NCCL always has them."""
    if not REAL_DEVICE:
        return False
    import torch

    return tuple(torch.cuda.nccl.version()) < (2, 29, 7)


LACKS_SUSPEND = _nccl_lacks_suspend()
needs_suspend = pytest.mark.skipif(
    LACKS_SUSPEND, reason="this PyTorch's NCCL predates ncclCommSuspend and ncclCommMemStats (2.29.7)"
)


def _comms(status):
    return status.get("communicators", [])


def test_status_shows_the_communicators_of_both_process_groups(ranks):
    st = ranks.status()
    assert sorted(st) == sorted(p.pid for p in ranks.procs), st
    for pid, s in st.items():
        comms = _comms(s)
        assert len(comms) == 2, f"pid {pid}: one communicator per process group: {comms}"
        print(f"pid {pid}: {comms}")
        for c in comms:
            assert not c["suspended"], comms
            # A 1-rank communicator on a GPU may have no peer buffers; NCCL's figure is shown.
            assert c["suspendable_bytes"] > 0 or REAL_DEVICE, comms
        assert len({c["device"] for c in comms}) == 1, comms


def test_pause_frees_exactly_the_suspendable_bytes_and_is_idempotent(ranks):
    if LACKS_SUSPEND:
        # The pause fails, and nothing is suspended; tms-ctl's report names the NCCL it needs.
        for a in ranks.ask("pause"):
            assert "raised" in a, a
        out = ranks.tms_ctl("pause", ranks.name, "--tag", "nccl")
        assert out.returncode != 0 and "2.29.7" in out.stdout, out.stdout + out.stderr
        for s in ranks.status().values():
            assert not any(c["suspended"] for c in _comms(s)), s
        pytest.skip("this PyTorch's NCCL predates ncclCommSuspend (2.29.7): the refusal was checked")
    suspendable = {pid: sum(c["suspendable_bytes"] for c in _comms(s)) for pid, s in ranks.status().items()}
    for round in range(2):
        answers = ranks.ask("pause")
        for proc, a in zip(ranks.procs, answers):
            assert "raised" not in a, a
            r, rose = a["report"], a["free_after"] - a["free_before"]
            if round == 0:
                assert (r["allocations_done"], r["bytes_done"]) == (2, suspendable[proc.pid]), a
                if REAL_DEVICE:
                    # The driver's free memory moves in pages and other processes may allocate.
                    assert rose >= r["bytes_done"] - (2 << 20), a
                else:
                    assert rose == r["bytes_done"], a
            else:
                assert (r["allocations_done"], r["allocations_skipped"], r["bytes_skipped"]) == (
                    0,
                    2,
                    suspendable[proc.pid],
                ), a
                assert rose == 0 or REAL_DEVICE, a
    for s in ranks.status().values():
        assert all(c["suspended"] and c["suspended_by_tms"] for c in _comms(s)), s


@needs_suspend
def test_a_collective_while_suspended_raises_nccl_s_error_without_hanging(ranks):
    for group in ("world", "second"):
        for a in ranks.ask(f"broadcast {group} 1", timeout=90):
            assert a["seconds"] < 30, a
            if REAL_DEVICE:
                # What NVIDIA's NCCL does here is recorded in the kit's log; never a hang.
                print(f"{group}: a broadcast while suspended: {a}")
                assert a["ok"] or "NCCL" in a["error"], a
                continue
            assert not a["ok"], a
            # ProcessGroupNCCL raises at once ("NCCL Broadcast failed: invalid usage"), with NCCL's
            # last error, which names the way out.
            assert a["error"].startswith("RuntimeError: NCCL Broadcast failed: invalid usage"), a
            if not REAL_DEVICE:
                assert "ncclCommResume" in a["error"], a


@needs_suspend
def test_resume_makes_the_next_broadcast_correct_and_is_idempotent(ranks):
    for round in range(2):
        answers = ranks.ask("resume")
        for a in answers:
            r = a["report"]
            assert r["allocations_done"] == (2 if round == 0 else 0), a
            assert r["allocations_skipped"] == (0 if round == 0 else 2), a
            if not REAL_DEVICE:
                assert a["free_before"] - a["free_after"] == (r["bytes_done"] if round == 0 else 0), a
    for group in ("world", "second"):
        for a in ranks.ask(f"broadcast {group} 2"):
            assert a["ok"], a


@needs_suspend
def test_tms_ctl_pauses_and_resumes_the_process_groups_from_outside(ranks):
    before = [a["free"] for a in ranks.ask("free")]
    suspendable = {pid: sum(c["suspendable_bytes"] for c in _comms(s)) for pid, s in ranks.status().items()}
    out = ranks.tms_ctl("pause", ranks.name, "--tag", "nccl")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {row["pid"]: row for row in json.loads(out.stdout)}
    after = [a["free"] for a in ranks.ask("free")]
    for i, p in enumerate(ranks.procs):
        assert rows[p.pid]["report"]["bytes_done"] == suspendable[p.pid], rows
        if not REAL_DEVICE:
            assert after[i] - before[i] == suspendable[p.pid], (before, after, rows)
    for a in ranks.ask("broadcast second 3", timeout=90):
        assert (not a["ok"] and "invalid usage" in a["error"].lower()) or REAL_DEVICE, a
    out = ranks.tms_ctl("resume", ranks.name, "--tag", "nccl")
    assert out.returncode == 0, out.stdout + out.stderr
    for a in ranks.ask("broadcast second 4") + ranks.ask("broadcast world 5"):
        assert a["ok"], a
    if not REAL_DEVICE:
        assert [a["free"] for a in ranks.ask("free")] == before


@needs_suspend
def test_process_groups_destroyed_while_suspended_leave_nothing_behind(ranks):
    totals = {pid: sum(c["suspendable_bytes"] + c["persistent_bytes"] for c in _comms(s)) for pid, s in ranks.status().items()}
    persistent = {pid: sum(c["persistent_bytes"] for c in _comms(s)) for pid, s in ranks.status().items()}
    for a in ranks.ask("pause"):
        assert a["report"]["allocations_done"] == 2, a
    answers = ranks.ask("destroy")
    for p, a in zip(ranks.procs, answers):
        if not REAL_DEVICE:
            # What stayed while suspended comes back with the communicators.
            assert a["free_after"] - a["free_before"] == persistent[p.pid], (a, totals)
    for pid, s in ranks.status().items():
        assert _comms(s) == [], s
    # Resuming the tag afterwards finds nothing to do and raises nothing.
    for a in ranks.ask("resume"):
        assert "raised" not in a and a["report"]["allocations_done"] == 0, a
