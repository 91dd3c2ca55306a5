"""The tms-memory-saver wheel as a user meets it: `pip install` into a fresh virtual environment
(torch reached through a .pth file), then torch_memory_saver programs run unchanged on the
simulated device, in preload and torch modes. Each scenario checks a torch_memory_saver semantic
that SGLang, slime or verl rely on; the comment says which.

The last tests replay what pip does to the wheel when a framework's install pins
torch_memory_saver (a distribution of another name owning the same files), in a virtual
environment of their own, and check that the damage is named, with the command that repairs it.
"""

import base64
import fcntl
import hashlib
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch_build
from conftest import REAL_DEVICE

MIB = 1 << 20
# The name slime preloads for this torch's CUDA major; the wheel ships every one.
PRELOAD_CU13 = torch_build.upstream_preload_name()


def _run(sim, fresh_venv, code, preload=True, **kw):
    python, site = fresh_venv
    return sim.ok(code, python=python, preload=site / PRELOAD_CU13 if preload else None, memory="2GiB", **kw)


def test_pip_install_gives_the_whole_replacement(fresh_venv):
    python, site = fresh_venv
    # The start-up check of a healthy install says nothing.
    quiet = subprocess.run([str(python), "-c", "pass"], capture_output=True, text=True, check=True)
    assert quiet.stderr == "", quiet.stderr
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
    # The wheel is the saver alone: its public core and control from Ray are there, the runner's
    # Python (the worker-protocol client, the Ray bridge) is not (relax-colocate carries it).
    probe = (
        "import importlib.util as u\n"
        "for m in ('tms.saver', 'tms.ray', 'tms.worker', 'tms.ray.bridge', 'relax_worker'):\n"
        "    print(m, u.find_spec(m) is not None)\n"
    )
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.split() == [
        "tms.saver", "True", "tms.ray", "True", "tms.worker", "False", "tms.ray.bridge", "False", "relax_worker", "False",
    ], found.stdout


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


def _doctor(python, env=None):
    """`python -m tms doctor --json`: (exit code, {check: finding})."""
    got = subprocess.run([str(python), "-m", "tms", "doctor", "--json"], capture_output=True, text=True, env=env)
    assert got.returncode in (0, 1), got.stdout + got.stderr
    doc = __import__("json").loads(got.stdout)
    return got.returncode, {f["check"]: f for f in doc["findings"]}


def test_doctor_passes_a_whole_install_and_finds_a_hook_for_another_cpu(sim, fresh_venv, tmp_path):
    python, site = fresh_venv
    hook = site / PRELOAD_CU13
    code, found = _doctor(python, sim.env(preload=hook))
    assert code == 0, found
    assert found["install"]["status"] == "ok" and found["hook"]["status"] == "ok", found
    assert found["LD_PRELOAD"]["status"] == "ok" and str(hook) in found["LD_PRELOAD"]["detail"], found
    assert found["runtime"]["status"] == "ok", found
    # A wheel for the other architecture (its e_machine says so): named, with the build to use.
    host = __import__("platform").machine()
    data = bytearray(hook.read_bytes())
    other, machine = ("aarch64", 183) if host == "x86_64" else ("x86_64", 62)
    data[18:20] = machine.to_bytes(2, "little")
    foreign = tmp_path / "torch_memory_saver_hook_mode_preload.abi3.so"
    foreign.write_bytes(bytes(data))
    code, found = _doctor(python, sim.env(extra={"TMS_LIBRARY": str(foreign)}))
    assert code == 1, found
    hook_line = found["hook"]
    assert hook_line["status"] == "problem" and f"built for {other}" in hook_line["detail"], hook_line
    assert f"--arch {'x86_64' if host == 'x86_64' else host}" in hook_line["fix"], hook_line
    # expandable segments: nothing a pause could free.
    code, found = _doctor(python, sim.env(preload=hook, extra={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))
    assert code == 1 and found["allocator"]["status"] == "problem", found


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


# --- pip and torch_memory_saver's files ---------------------------------------------------------
# SGLang, slime and verl install torch_memory_saver with a pin (==0.0.10, 0.0.9, 0.0.8). pip knows
# our distribution as tms-memory-saver, so it installs theirs over our files without a word, and
# `pip uninstall torch_memory_saver` deletes them while tms-memory-saver stays listed.

# torch_memory_saver's wheels on the package index (what the pins install), checked by hash.
UPSTREAM_WHEEL_PINS = (
    "torch_memory_saver==0.0.10 --hash=sha256:786e18755a9af255ae692b0e19a62ff06861dbf55a19fa8545e62a100ab5a28f",
    "torch_memory_saver==0.0.9 --hash=sha256:0cf26332993649f8ea1b95d7307dfba3a95ee6cee53de84a3e561fb21752b584",
)


def _pip(python, *args):
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _framework_wheel(folder, module, pin):
    """A wheel standing for a framework (distribution and module `module`) whose requirements pin
    torch_memory_saver==`pin`."""
    info = f"{module}-1.0.dist-info"
    files = {
        f"{module}.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n"
        f"Requires-Dist: torch_memory_saver=={pin}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tms-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A folder for `pip --no-index --find-links`: torch_memory_saver 0.0.10's and 0.0.9's wheels
    (3 MB, downloaded once into ${XDG_CACHE_HOME:-~/.cache}/tms/upstream-wheel) and two
    frameworks' pinning them (a_framework: 0.0.10, an_older_framework: 0.0.9)."""
    if REAL_DEVICE:
        pytest.skip("pip's handling of the wheel is checked by the test suite, not the hardware kit")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tms" / "upstream-wheel"
    cache.mkdir(parents=True, exist_ok=True)
    with open(f"{cache}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = cache / ".tms-pin"
        if not (stamp.exists() and stamp.read_text() == "\n".join(UPSTREAM_WHEEL_PINS)):
            for old in cache.glob("*.whl"):
                old.unlink()
            pins = cache / "pins.txt"
            for pin in UPSTREAM_WHEEL_PINS:  # one at a time: pip resolves a file's lines together
                pins.write_text(pin + "\n")
                got = _pip(sys.executable, "download", "-q", "--no-deps", "--only-binary", ":all:", "--require-hashes",
                           "-r", str(pins), "-d", str(cache))
                assert got.returncode == 0, f"could not download {pin.split()[0]}'s wheel (is the package index reachable?)\n{got.stderr}"
            stamp.write_text("\n".join(UPSTREAM_WHEEL_PINS))
    folder = tmp_path_factory.mktemp("index")
    for wheel in cache.glob("*.whl"):
        (folder / wheel.name).symlink_to(wheel)
    _framework_wheel(folder, "a_framework", "0.0.10")
    _framework_wheel(folder, "an_older_framework", "0.0.9")
    return folder


@pytest.fixture(scope="module")
def pip_venv(tmp_path_factory, index):
    """A virtual environment with the wheel installed by its own pip, seeing no other
    site-packages (fresh_venv sees the test environment's torch_memory_saver, which pip would take
    as installed). Returns (python, site-packages, wheel)."""
    wheel = str(Path(os.environ["TMS_TEST_WHEEL"]).resolve())
    venv = tmp_path_factory.mktemp("pip") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    got = _pip(python, "install", "-q", "--no-deps", "--no-index", wheel)
    assert got.returncode == 0, got.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    return python, site, wheel


def _repair_command(python, wheel):
    """What the check names to put tms back."""
    return f"{python} -m pip install --force-reinstall --no-deps {shlex.quote(wheel)}"


def _startup_says(python):
    """What an interpreter that runs nothing prints (the start-up check's warning, if any)."""
    return subprocess.run([str(python), "-c", "pass"], capture_output=True, text=True, check=True).stderr


def _assert_tms_is_back(python, site, wheel):
    assert _startup_says(python) == "", "a repaired install still warns"
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("torch_memory_saver"):
                assert (site / name).read_bytes() == z.read(name), f"{name} is not the wheel's"
    probe = subprocess.run([str(python), "-c", "import tms, torch_memory_saver; print(tms.library_path())"],
                           capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.strip().startswith(str(site)), probe.stdout + probe.stderr


def _assert_named_with_repair(python, wheel, said):
    repair = _repair_command(python, wheel)
    warning = _startup_says(python)
    assert "tms-memory-saver" in warning and said in warning and repair in warning, warning
    imported = subprocess.run([str(python), "-c", "import tms"], capture_output=True, text=True)
    assert imported.returncode != 0 and "ImportError" in imported.stderr and repair in imported.stderr, imported.stderr
    fixed = subprocess.run(shlex.split(repair), capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_a_framework_pinning_torch_memory_saver_installed_after_the_wheel_is_named_and_repaired(pip_venv, index):
    python, site, wheel = pip_venv
    assert _startup_says(python) == ""
    got = _pip(python, "install", "--no-index", "--find-links", str(index), "a_framework")
    assert got.returncode == 0 and "torch_memory_saver-0.0.10" in got.stdout, got.stdout + got.stderr
    # The doctor still runs (`import tms` refuses, `python -m tms` does not) and names both the
    # files and the hook SGLang's configure_subprocess would now preload.
    code, found = _doctor(python)
    assert code == 1 and found["install"]["status"] == "problem" and "replaced" in found["install"]["detail"], found
    assert found["hook"]["status"] == "problem" and "not tms's hook" in found["hook"]["detail"], found
    assert "--force-reinstall --no-deps" in found["install"]["fix"], found
    # pip has put upstream's hook and Python package over ours: every start-up says so, and
    # `import tms` refuses with the same repair.
    _assert_named_with_repair(python, wheel, "replaced")
    _assert_tms_is_back(python, site, wheel)
    # torch_memory_saver 0.0.10 stays recorded: the pin is satisfied and pip leaves our files alone.
    again = _pip(python, "install", "--no-index", "--find-links", str(index), "torch_memory_saver==0.0.10")
    assert again.returncode == 0 and "already satisfied" in again.stdout, again.stdout + again.stderr
    _assert_tms_is_back(python, site, wheel)
    # A framework pinning another version: pip uninstalls 0.0.10 (our files with it) and writes
    # 0.0.9's; named again, repaired again.
    older = _pip(python, "install", "--no-index", "--find-links", str(index), "an_older_framework")
    assert older.returncode == 0 and "torch_memory_saver-0.0.9" in older.stdout, older.stdout + older.stderr
    _assert_named_with_repair(python, wheel, "replaced")
    _assert_tms_is_back(python, site, wheel)


def test_pip_uninstall_torch_memory_saver_after_the_wheel_is_named_and_repaired(pip_venv, index):
    python, site, wheel = pip_venv
    # torch_memory_saver recorded beside the wheel, as the test above (or any framework) leaves it.
    _pip(python, "install", "-q", "--no-index", "--find-links", str(index), "a_framework")
    subprocess.run(shlex.split(_repair_command(python, wheel)), check=True, capture_output=True)
    _assert_tms_is_back(python, site, wheel)
    got = _pip(python, "uninstall", "-y", "torch_memory_saver")
    assert got.returncode == 0 and "Successfully uninstalled torch_memory_saver" in got.stdout, got.stdout + got.stderr
    # Our files went with it while tms-memory-saver stays listed.
    assert not (site / PRELOAD_CU13).exists()
    _assert_named_with_repair(python, wheel, "missing")
    _assert_tms_is_back(python, site, wheel)
