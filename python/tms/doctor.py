"""``python -m tms doctor [--json]``: checks an installation as a whole and says what to fix.

Each check prints one line, ``ok``, ``note`` (worth knowing, nothing wrong) or ``PROBLEM`` with the
fix on the next line:

- the wheel's files under torch_memory_saver's names are still ours (a framework that pins
  torch_memory_saver, installed after the wheel, writes upstream's over them);
- the hook ``python -m tms library`` names, and the one ``configure_subprocess()`` (SGLang's
  scheduler, slime's actors) would preload: present, tms's own, built for this host's CPU;
- ``LD_PRELOAD`` of this environment: which hook it names, if any;
- the device runtime a hooked process will bind: the CUDA driver and its version, CANN's runtime,
  or the simulator;
- allocator settings under which hooked memory cannot be paused (``expandable_segments``);
- the control folder and the hooked processes serving in it.

Exit 0 when nothing is a problem, 1 otherwise. It loads no hook and no framework: only files are
read and the vendor runtime's version is asked.
"""

import ctypes
import json
import os
import platform
import sys

# ELF e_machine values (System V ABI): what a library was built for.
_MACHINES = {3: "x86", 62: "x86_64", 40: "arm", 183: "aarch64", 243: "riscv64", 21: "ppc64"}
# A name only tms's hook exports (torch_memory_saver's libraries have the tms_* names it shares).
_OURS = b"tms_pause_report\x00"


def host_arch():
    m = platform.machine()
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(m, m)


def library_facts(path):
    """(machine, ours, error) of the shared library at ``path``, read from the file alone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, False, str(e)
    if data[:4] != b"\x7fELF" or len(data) < 20:
        return None, False, "not an ELF shared library"
    machine = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
    return _MACHINES.get(machine, f"machine {machine}"), _OURS in data, None


class Doctor:
    def __init__(self):
        self.findings = []

    def add(self, check, status, detail, fix=None):
        self.findings.append({"check": check, "status": status, "detail": detail, "fix": fix})

    @property
    def problems(self):
        return [f for f in self.findings if f["status"] == "problem"]

    def hook_file(self, check, path, role):
        """Checks one hook library: there, tms's, this host's architecture."""
        machine, ours, error = library_facts(path)
        host = host_arch()
        if error:
            self.add(check, "problem", f"{role} {path}: {error}", "reinstall the tms-memory-saver wheel for this host")
        elif machine != host:
            self.add(
                check, "problem",
                f"{role} {path} is built for {machine}, and this host is {host}: the loader will not load it",
                f"install the manylinux2014_{host} wheel (scripts/build-wheel.sh --arch {host} builds it on any "
                "machine with cargo)",
            )
        elif not ours:
            self.add(
                check, "problem",
                f"{role} {path} is not tms's hook (another torch_memory_saver's library)",
                "reinstall the tms-memory-saver wheel after the framework: "
                f"{sys.executable} -m pip install --force-reinstall --no-deps <the wheel>",
            )
        else:
            self.add(check, "ok", f"{role} {path} (tms, {machine})")

    def check_files(self):
        try:
            import _tms_install_check as check
        except ImportError:
            self.add("install", "note", "not installed by the wheel (a checkout or scripts/install.sh): pip's files not checked")
            return
        site = os.path.dirname(os.path.abspath(check.__file__))
        found = check.problems(site)
        if found is None:
            self.add("install", "note", f"no tms-memory-saver RECORD in {site}: pip's files not checked")
        elif found[0] or found[1]:
            text = check.message(site, *found).strip().split("\n")
            self.add("install", "problem", text[0], "; or ".join(line.strip() for line in text[1:]))
        else:
            self.add("install", "ok", f"tms-memory-saver {check.VERSION}'s files in {site} are its own")

    def check_hooks(self):
        from ._lib import TmsError, packaged_hook, preloaded_hook

        installed = packaged_hook("preload")
        if installed is None:
            self.add("hook", "problem", "no hook installed (python -m tms library finds none)",
                     "pip install the tms-memory-saver wheel, or set TMS_LIBRARY to libtms_hook.so")
        else:
            self.hook_file("hook", installed, "installed hook")
        try:
            preloaded = preloaded_hook()
        except TmsError as e:
            self.add("LD_PRELOAD", "problem", str(e), "leave exactly one hook in LD_PRELOAD")
            preloaded = None
        else:
            if preloaded:
                self.hook_file("LD_PRELOAD", preloaded, "LD_PRELOAD's hook")
            else:
                self.add("LD_PRELOAD", "note", "names no hook here; frameworks set it for the processes that allocate "
                         "(configure_subprocess), or preload it yourself for your own")
        child = preloaded or installed
        if child:
            self.add("configure_subprocess", "ok" if child in (installed, preloaded) else "note",
                     f"children started under configure_subprocess() preload {child}")

    def check_runtime(self):
        found = []
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            cuda = None
        if cuda is not None:
            if hasattr(cuda, "tms_sim_stats"):
                found.append("the simulator (tms-sim) as the CUDA driver")
            else:
                v = ctypes.c_int(0)
                ok = cuda.cuDriverGetVersion(ctypes.byref(v)) == 0
                found.append(f"CUDA driver {v.value // 1000}.{v.value % 1000 // 10}" if ok else "a CUDA driver")
        try:
            acl = ctypes.CDLL("libascendcl.so")
        except OSError:
            acl = None
        if acl is not None:
            if hasattr(acl, "tms_sim_stats"):
                found.append("the simulator (tms-sim) as CANN's runtime")
            else:
                home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
                found.append("CANN's runtime (libascendcl.so" + (f", {home}" if home else "") + ")")
        if found:
            self.add("runtime", "ok", "a hooked process binds " + " and ".join(found))
        else:
            self.add(
                "runtime", "problem",
                "neither libcuda.so.1 (the NVIDIA driver) nor libascendcl.so (CANN) loads here: a hooked process "
                "passes every allocation through and nothing can be paused",
                "NVIDIA: install the driver; Ascend: source CANN's set_env.sh (e.g. "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh); without a device: eval \"$(tms-sim env)\"",
            )

    def check_allocator(self):
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            value = os.environ.get(name, "")
            for kv in value.split(","):
                key, _, on = kv.partition(":")
                if key.strip() == "expandable_segments" and on.strip().lower() == "true":
                    self.add(
                        "allocator", "problem",
                        f"{name}={value}: expandable segments allocate through driver calls the hook never sees, "
                        "so a pause frees nothing",
                        f"set {name} without expandable_segments:True (colocated setups use False)",
                    )
                    return
        self.add("allocator", "ok", "no expandable_segments: PyTorch's segments go through the hook")

    def check_control(self):
        from . import control

        d = control.socket_dir()
        if not os.path.isdir(d):
            self.add("control", "note", f"{d} does not exist yet: the first hooked process makes it")
            return
        live = control.sockets(d, reap=False)
        pids = ", ".join(str(pid) for pid, _ in live[:8]) + (", ..." if len(live) > 8 else "")
        self.add("control", "ok", f"{d}: {len(live)} hooked process(es) serving" + (f" ({pids})" if live else ""))

    def run(self):
        for step in (self.check_files, self.check_hooks, self.check_runtime, self.check_allocator, self.check_control):
            try:
                step()
            except Exception as e:  # a check that fails says so; the others still run
                self.add(step.__name__[6:], "problem", f"the check itself failed: {e!r}", "report it")
        return self


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tms doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object: {ok, findings: [...]}")
    args = parser.parse_args(argv)
    doctor = Doctor().run()
    if args.json:
        print(json.dumps({"ok": not doctor.problems, "host": host_arch(), "findings": doctor.findings}, indent=2))
    else:
        for f in doctor.findings:
            label = {"ok": "ok", "note": "note", "problem": "PROBLEM"}[f["status"]]
            print(f"{label:<8} {f['check']}: {f['detail']}")
            if f["fix"]:
                print(f"{'':<8}   fix: {f['fix']}")
        n = len(doctor.problems)
        print("\n" + ("no problem found" if n == 0 else f"{n} problem(s): fix them in the order above"))
    return 1 if doctor.problems else 0
