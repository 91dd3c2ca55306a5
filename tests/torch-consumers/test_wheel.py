"""The tms-memory-saver wheel as a user meets it: `pip install` into a fresh virtual environment
(torch reached through a .pth file), then torch_memory_saver programs run unchanged on the
simulated device, in preload and torch modes. Each scenario checks a torch_memory_saver semantic
that SGLang, slime or verl rely on; the comment says which.
"""

import subprocess

import torch_build

MIB = 1 << 20
# The name slime preloads for this torch's CUDA major; the wheel ships every one.
PRELOAD_CU13 = torch_build.upstream_preload_name()


def _run(sim, fresh_venv, code, preload=True, **kw):
    python, site = fresh_venv
    return sim.ok(code, python=python, preload=site / PRELOAD_CU13 if preload else None, memory="2GiB", **kw)


def test_pip_install_gives_the_whole_replacement(fresh_venv):
    python, site = fresh_venv
    for mode in ("preload", "torch"):
        for cuda in ("", "_cu12", "_cu13"):
            assert (site / f"torch_memory_saver_hook_mode_{mode}{cuda}.abi3.so").is_file(), (mode, cuda)
    probe = subprocess.run(
        [str(python), "-c", "import torch_memory_saver, tms; print(torch_memory_saver.__file__); print(tms.__file__)"],
        capture_output=True, text=True, check=True,
    )
    for line in probe.stdout.split():
        assert line.startswith(str(site)), probe.stdout
    lib = subprocess.run([str(python), "-m", "tms", "library"], capture_output=True, text=True, check=True)
    assert lib.stdout.strip().startswith(str(site / "torch_memory_saver_hook_mode_preload")), lib.stdout
    ctl = subprocess.run([str(python.parent / "tms-ctl"), "--help"], capture_output=True, text=True)
    assert ctl.returncode == 0 and "pause" in ctl.stdout, ctl.stdout + ctl.stderr
    # The worker-protocol client ships in the wheel: an external relax-colocate worker needs
    # nothing from a checkout.
    worker = subprocess.run(
        [str(python), "-c", "from tms import worker; print(worker.__file__, worker.PROTOCOL)"],
        capture_output=True, text=True, check=True,
    )
    assert worker.stdout.startswith(str(site)) and worker.stdout.split()[-1] == "1", worker.stdout


UPSTREAM_PROGRAM = """
import os, torch
from torch_memory_saver import torch_memory_saver as saver

MIB = 1 << 20
def free():
    return torch.cuda.mem_get_info()[0]

print("hook_mode=%s" % saver.hook_mode)
pattern = torch.arange(16 * MIB, dtype=torch.int64).to(torch.uint8)
with saver.region(tag="weights", enable_cpu_backup=True):
    w = pattern.cuda()
with saver.region(tag="kv_cache"):
    kv = torch.ones(16 * MIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()

f0 = free()
saver.pause("weights")
print("freed_weights=%d" % (free() - f0))
backup = saver.get_cpu_backup(w)
print("backup_while_paused=%s" % (backup is not None and torch.equal(backup, pattern)))
saver.pause("kv_cache")
saver.resume("weights")
saver.resume("kv_cache")
print("weights_back=%s" % torch.equal(w.cpu(), pattern))
# slime pushes weights from get_cpu_backup whenever it is not None: after resume it must be None
# unless retention was asked for.
print("backup_after_resume=%s" % (saver.get_cpu_backup(w) is not None))
saver.retain_cpu_backup = True
print("retain=%s" % saver.retain_cpu_backup)
saver.pause("weights"); saver.resume("weights")
kept = saver.get_cpu_backup(w)
print("retained_after_resume=%s" % (kept is not None and torch.equal(kept, pattern)))
saver.retain_cpu_backup = False

# The margin guards region allocations (a silent no-op would let them take the last memory).
saver.memory_margin_bytes = free()
try:
    with saver.region(tag="extra"):
        torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    print("margin_refused=False")
except torch.OutOfMemoryError:
    print("margin_refused=True")
saver.memory_margin_bytes = 0

# Disk backup: the contents go to files under the directory while paused, and come back.
disk_dir = os.path.join(os.getcwd(), "disk-backups")
saver.set_disk_backup_dir(disk_dir)
with saver.region(tag="spill", enable_disk_backup=True):
    s = (pattern[: 8 * MIB] ^ 0x5A).cuda()
torch.cuda.synchronize()
saver.pause("spill")
files = os.listdir(disk_dir)
print("disk_files=%d" % len(files))
print("disk_bytes=%d" % sum(os.path.getsize(os.path.join(disk_dir, f)) for f in files))
saver.resume("spill")
print("disk_back=%s" % torch.equal(s.cpu(), pattern[: 8 * MIB] ^ 0x5A))
print("disk_files_after=%d" % len(os.listdir(disk_dir)))

# The pageable backend keeps contents too.
with saver.region(tag="pageable", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    m = pattern[: 4 * MIB].cuda()
torch.cuda.synchronize()
saver.pause("pageable"); saver.resume("pageable")
print("mmap_back=%s" % torch.equal(m.cpu(), pattern[: 4 * MIB]))

# SGLang sets the mode before first use; setting it again to the same mode is harmless.
saver.hook_mode = "preload"
try:
    saver.hook_mode = "torch"
    print("late_mode_change=accepted")
except RuntimeError:
    print("late_mode_change=refused")
try:
    with saver.region(enable_cpu_backup=False, cpu_backup_backend="mmap"):
        pass
except ValueError as e:
    print("backend_without_backup=ValueError")
try:
    with saver.region(enable_cpu_backup=True, enable_disk_backup=True):
        pass
except ValueError:
    print("cpu_and_disk=ValueError")
"""


def test_a_torch_memory_saver_program_runs_unchanged(sim, fresh_venv):
    out = _run(sim, fresh_venv, UPSTREAM_PROGRAM)
    assert out["hook_mode"] == "preload"
    assert int(out["freed_weights"]) >= 16 * MIB, out
    assert out["backup_while_paused"] == "True", out
    assert out["weights_back"] == "True", out
    assert out["backup_after_resume"] == "False", out
    assert out["retain"] == "True", out
    assert out["retained_after_resume"] == "True", out
    assert out["margin_refused"] == "True", out
    assert int(out["disk_files"]) >= 1 and int(out["disk_bytes"]) >= 8 * MIB, out
    assert out["disk_back"] == "True", out
    assert out["disk_files_after"] == "0", out
    assert out["mmap_back"] == "True", out
    assert out["late_mode_change"] == "refused", out
    assert out["backend_without_backup"] == "ValueError", out
    assert out["cpu_and_disk"] == "ValueError", out


TORCH_MODE = """
import torch, torch_memory_saver
saver = torch_memory_saver.torch_memory_saver
saver.hook_mode = "torch"
MIB = 1 << 20
pattern = torch.arange(8 * MIB, dtype=torch.int64).to(torch.uint8)
with saver.region(tag="weights", enable_cpu_backup=True):
    w = pattern.cuda()
with saver.disable():
    plain = torch.ones(8 * MIB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
f0 = torch.cuda.mem_get_info()[0]
saver.pause("weights")
print("freed=%d" % (torch.cuda.mem_get_info()[0] - f0))
saver.resume("weights")
print("hook_mode=%s" % saver.hook_mode)
print("weights_back=%s" % torch.equal(w.cpu(), pattern))
print("plain_untouched=%s" % bool(plain.sum().item() == 8 * MIB))
"""


def test_torch_mode_needs_no_preload(sim, fresh_venv):
    out = _run(sim, fresh_venv, TORCH_MODE, preload=False)
    assert out["hook_mode"] == "torch"
    assert int(out["freed"]) >= 8 * MIB, out
    assert out["weights_back"] == "True", out
    assert out["plain_untouched"] == "True", out


RESUME_FAILS = """
import torch, tms
from torch_memory_saver import torch_memory_saver as saver
MIB = 1 << 20
pattern = torch.arange(64 * MIB, dtype=torch.int64).to(torch.uint8)
with saver.region(tag="weights", enable_cpu_backup=True):
    w = pattern.cuda()
torch.cuda.synchronize()
saver.pause("weights")
# Another process (here: plain memory) takes the device while the trainer sleeps.
with saver.disable():
    hog = torch.empty(torch.cuda.mem_get_info()[0] - 16 * MIB, dtype=torch.uint8, device="cuda")
try:
    saver.resume("weights")
    print("resume=returned")
except tms.TmsError as e:
    print("resume=raised")
    print("code=%d" % e.code)
    print("failed=%d" % e.report["allocations_failed"])
del hog
torch.cuda.empty_cache()
saver.resume("weights")
print("weights_back=%s" % torch.equal(w.cpu(), pattern))
"""


def test_a_resume_without_memory_raises_and_loses_nothing(sim, fresh_venv):
    # Upstream's Python ignores the code and the job dies later on an unmapped address.
    out = _run(sim, fresh_venv, RESUME_FAILS)
    assert out["resume"] == "raised", out
    assert out["code"] == "2", out
    assert out["weights_back"] == "True", out


NO_PRELOAD = """
import torch_memory_saver, tms
try:
    with torch_memory_saver.torch_memory_saver.region():
        pass
    print("outcome=ran")
except tms.TmsError as e:
    print("outcome=TmsError")
    print("mentions_fix=%s" % ("configure_subprocess" in str(e) and "hook_mode='torch'" in str(e)))
"""


def test_preload_mode_without_the_hook_says_how_to_fix_it(sim, fresh_venv):
    out = _run(sim, fresh_venv, NO_PRELOAD, preload=False)
    assert out["outcome"] == "TmsError", out
    assert out["mentions_fix"] == "True", out


ONE_HOOK_IN_CHILDREN = """
import multiprocessing as mp, os, sys

def child(q):
    import torch
    from torch_memory_saver import torch_memory_saver as saver
    entries = [p for p in os.environ["LD_PRELOAD"].split(":") if "torch_memory_saver" in p or "tms_hook" in p]
    with saver.region(tag="kv_cache"):
        t = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    f0 = torch.cuda.mem_get_info()[0]
    saver.pause("kv_cache")
    q.put((len(entries), torch.cuda.mem_get_info()[0] - f0))
    saver.resume("kv_cache")

if __name__ == "__main__":
    import torch_memory_saver
    # The parent already runs with the hook (as an SGLang server launched by slime does), plus an
    # unrelated library that must stay.
    os.environ["LD_PRELOAD"] = os.environ["LD_PRELOAD"] + ":" + os.environ["OTHER_LIB"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with torch_memory_saver.configure_subprocess():
        print("child_env=%s" % os.environ["LD_PRELOAD"])
        p = ctx.Process(target=child, args=(q,))
        p.start()
    n, freed = q.get(timeout=200)
    p.join(60)
    print("hook_entries=%d" % n)
    print("child_freed=%d" % freed)
    print("child_exit=%s" % p.exitcode)
"""


def test_configure_subprocess_leaves_one_hook_in_the_child(sim, fresh_venv):
    # SGLang's mode_preload asserts exactly one matching LD_PRELOAD entry in the child.
    other = sim.tmp / "libother.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(other), "-x", "c", "-"], input="int other_lib;", text=True, check=True)
    out = _run(sim, fresh_venv, ONE_HOOK_IN_CHILDREN, as_file=True, extra={"OTHER_LIB": str(other)})
    assert out["hook_entries"] == "1", out
    assert str(other) in out["child_env"], out
    assert int(out["child_freed"]) >= 16 * MIB, out
    assert out["child_exit"] == "0", out
