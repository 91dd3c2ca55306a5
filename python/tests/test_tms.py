"""Tests of the tms Python package on the simulator, with CPython only (torch tests skip cleanly).

Expected environment (tests/tests/python.rs sets it up): LD_PRELOAD = the installed compatibility
file name, LD_LIBRARY_PATH = the simulator's runtime-named links, TMS_SIM_* = a private node,
TMS_CONTROL_DIR = a private socket folder, PYTHONPATH = the installed package, TMS_PREFIX = the
install prefix.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import unittest

import tms
from tms import control

MiB = 1 << 20


def cudart():
    lib = ctypes.CDLL("libcudart.so.12")
    return lib


def free_mem(rt):
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert rt.cudaMemGetInfo(ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value


def malloc(rt, n):
    p = ctypes.c_void_p()
    rc = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
    return rc, p


def has_torch_device():
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


class PreloadMode(unittest.TestCase):
    def test_found_under_the_compatibility_name(self):
        self.assertEqual(tms.hook_mode(), "preload")
        self.assertIn("torch_memory_saver_hook_mode_preload", tms.library_path())

    def test_region_pause_resume_and_reports(self):
        rt = cudart()
        with tms.region("py-weights", enable_cpu_backup=True):
            rc, p = malloc(rt, 6 * MiB)
        self.assertEqual(rc, 0)
        data = bytes((i * 13) % 251 for i in range(6 * MiB))
        self.assertEqual(rt.cudaMemcpy(p, ctypes.c_char_p(data), ctypes.c_size_t(len(data)), 1), 0)
        before = free_mem(rt)
        rep = tms.pause_report("py-weights")
        self.assertEqual(rep["allocations_done"], 1)
        self.assertEqual(rep["bytes_done"], 6 * MiB)
        # Without torch no allocator says which bytes are free: the whole allocation is copied.
        self.assertEqual((rep["backup_bytes"], rep["backup_bytes_skipped"]), (6 * MiB, 0))
        self.assertEqual(free_mem(rt) - before, 6 * MiB)
        st = {s["tag"]: s for s in tms.status()}
        self.assertEqual(st["py-weights"]["allocations_paused"], 1)
        self.assertEqual(tms.pause_report("py-weights")["allocations_skipped"], 1)
        tms.resume("py-weights")
        out = ctypes.create_string_buffer(len(data))
        self.assertEqual(rt.cudaMemcpy(out, p, ctypes.c_size_t(len(data)), 2), 0)
        self.assertEqual(out.raw, data)
        self.assertEqual(rt.cudaFree(p), 0)

    def test_outside_a_region_nothing_is_tracked(self):
        rt = cudart()
        with tms.disable():
            rc, p = malloc(rt, 2 * MiB)
        self.assertEqual(rc, 0)
        self.assertEqual(tms.pause_report("default")["allocations_done"], 0)
        self.assertEqual(rt.cudaFree(p), 0)

    def test_out_of_memory_on_resume_raises_and_loses_nothing(self):
        rt = cudart()
        with tms.region("py-kv", enable_cpu_backup=True):
            rc, p = malloc(rt, 4 * MiB)
        self.assertEqual(rc, 0)
        pattern = (ctypes.c_uint8 * (4 * MiB))(*([7] * (4 * MiB)))
        self.assertEqual(rt.cudaMemcpy(p, pattern, ctypes.c_size_t(4 * MiB), 1), 0)
        tms.pause("py-kv")
        # Someone else takes the memory while it is paused.
        with tms.disable():
            rc, hog = malloc(rt, free_mem(rt) - 1 * MiB)
        self.assertEqual(rc, 0)
        with self.assertRaises(tms.TmsError) as cm:
            tms.resume("py-kv")
        self.assertEqual(cm.exception.code, tms.TMS_ERR_OUT_OF_MEMORY)
        self.assertEqual(cm.exception.report["allocations_done"], 0)
        self.assertIn("Nothing is lost", str(cm.exception))
        self.assertEqual(rt.cudaFree(hog), 0)
        tms.resume("py-kv")
        back = (ctypes.c_uint8 * (4 * MiB))()
        self.assertEqual(rt.cudaMemcpy(back, p, ctypes.c_size_t(4 * MiB), 2), 0)
        self.assertEqual(bytes(back), bytes(pattern))
        self.assertEqual(rt.cudaFree(p), 0)

    def test_the_margin_guards_allocation_not_resume(self):
        # torch_memory_saver's semantics: a waking job must get its memory back even when the
        # margin is not free; only new region allocations are refused.
        rt = cudart()
        with tms.region("py-margin"):
            rc, p = malloc(rt, 4 * MiB)
        self.assertEqual(rc, 0)
        tms.pause("py-margin")
        tms.torch_memory_saver.memory_margin_bytes = free_mem(rt)
        try:
            with tms.region("py-margin"):
                rc, q = malloc(rt, 2 * MiB)
            self.assertEqual(rc, 2, "cudaErrorMemoryAllocation when the margin would not stay free")
            tms.resume("py-margin")
        finally:
            tms.set_memory_margin_bytes(0)
        self.assertEqual(tms.memory_margin_bytes, 0)
        self.assertEqual(rt.cudaFree(p), 0)

    def test_object_api_matches_torch_memory_saver(self):
        tms_obj = tms.torch_memory_saver
        for name in ("region", "cuda_graph", "disable", "pause", "resume", "get_cpu_backup"):
            self.assertTrue(callable(getattr(tms_obj, name)), name)
        self.assertTrue(tms_obj.enabled)
        self.assertEqual(tms_obj.hook_mode, "preload")
        # TMS_HOOK_MODE, as torch_memory_saver's Ascend build reads it: the default mode, and a
        # variable the hook knows (no "not a variable tms reads" warning once it runs).
        code = textwrap.dedent(
            """
            import ctypes
            from torch_memory_saver import torch_memory_saver as saver
            print(saver.hook_mode)
            rt = ctypes.CDLL("libcudart.so.12")
            p = ctypes.c_void_p()
            with saver.region(tag="py-hook-mode"):
                assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(2 << 20)) == 0
            print(saver._impl._hook_mode)
            """
        )
        for mode in ("torch", "preload"):
            out = subprocess.run(
                [sys.executable, "-c", code], env=dict(os.environ, TMS_HOOK_MODE=mode), capture_output=True, text=True
            )
            self.assertEqual((out.returncode, out.stdout.split()), (0, [mode, mode]), out.stderr)
            self.assertNotIn("TMS_HOOK_MODE", out.stderr)
        bad = subprocess.run(
            [sys.executable, "-c", "from torch_memory_saver import torch_memory_saver as s; s.hook_mode"],
            env=dict(os.environ, TMS_HOOK_MODE="cuda"), capture_output=True, text=True,
        )
        self.assertIn("ValueError: TMS_HOOK_MODE='cuda': use 'preload' or 'torch'", bad.stderr)

    def test_configure_subprocess_propagates_the_preload(self):
        path = tms.library_path()
        env_before = os.environ.get("LD_PRELOAD")
        os.environ.pop("LD_PRELOAD", None)
        try:
            with tms.configure_subprocess():
                out = subprocess.run(
                    [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"],
                    capture_output=True, text=True, check=True,
                )
            self.assertEqual(out.stdout.strip().split(":")[0], path)
            self.assertNotIn("LD_PRELOAD", os.environ)
        finally:
            if env_before is not None:
                os.environ["LD_PRELOAD"] = env_before

    def test_control_client_pauses_another_process(self):
        child_code = textwrap.dedent(
            """
            import ctypes, sys, tms
            rt = ctypes.CDLL("libcudart.so.12")
            p = ctypes.c_void_p()
            with tms.region("remote", enable_cpu_backup=True):
                assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(8 << 20)) == 0
            data = bytes(range(256)) * (8 << 12)
            assert rt.cudaMemcpy(p, ctypes.c_char_p(data), ctypes.c_size_t(len(data)), 1) == 0
            print("ready", flush=True)
            sys.stdin.readline()
            out = ctypes.create_string_buffer(len(data))
            rc = rt.cudaMemcpy(out, p, ctypes.c_size_t(len(data)), 2)
            print("intact" if rc == 0 and out.raw == data else f"broken rc={rc}", flush=True)
            """
        )
        env = dict(os.environ, TMS_NAME="py-remote")
        child = subprocess.Popen([sys.executable, "-c", child_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            self.assertEqual(child.stdout.readline().strip(), "ready")
            listed = subprocess.run([sys.executable, "-m", "tms.control", "list", "--json"], capture_output=True, text=True, check=True)
            # The module ran as a program without runpy's "found in sys.modules" warning.
            self.assertNotIn("RuntimeWarning", listed.stderr)
            rows = [r for r in json.loads(listed.stdout) if r["pid"] == child.pid]
            self.assertEqual(rows[0]["status"]["name"], "py-remote")
            reports = control.pause("py-remote")
            self.assertEqual(reports[0]["bytes_done"], 8 * MiB)
            self.assertEqual(control.status(child.pid)["tags"][0]["allocations_paused"], 1)
            with self.assertRaises(control.TargetNotFound):
                control.pause("nobody-by-this-name")
            cli = subprocess.run([sys.executable, "-m", "tms.control", "resume", str(child.pid), "--json"], capture_output=True, text=True)
            self.assertEqual(cli.returncode, 0, cli.stderr)
            self.assertEqual(json.loads(cli.stdout)[0]["report"]["bytes_done"], 8 * MiB)
            child.stdin.write("go\n")
            child.stdin.flush()
            self.assertEqual(child.stdout.readline().strip(), "intact")
        finally:
            child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()

    def test_stopped_processes_are_asked_at_once_and_cost_one_timeout(self):
        # The client asked processes one after another, each with a timeout per read: three
        # stopped processes held a list for three timeouts or more.
        child_code = textwrap.dedent(
            """
            import ctypes, sys, tms
            rt = ctypes.CDLL("libcudart.so.12")
            p = ctypes.c_void_p()
            with tms.region("stopped"):
                assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(2 << 20)) == 0
            print("ready", flush=True)
            sys.stdin.readline()
            """
        )
        env = dict(os.environ, TMS_NAME="py-stopped")
        children = [
            subprocess.Popen([sys.executable, "-c", child_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(3)
        ]
        try:
            for child in children:
                self.assertEqual(child.stdout.readline().strip(), "ready")
            # The socket is served by a thread the first region allocation starts: wait for it.
            deadline = time.monotonic() + 10
            while {c.pid for c in children} - {pid for pid, _ in control.sockets()}:
                self.assertLess(time.monotonic(), deadline, "the children never served their sockets")
                time.sleep(0.05)
            for child in children:
                os.kill(child.pid, signal.SIGSTOP)
            start = time.monotonic()
            rows = [r for r in control.list_processes(timeout=1.0) if r["pid"] in {c.pid for c in children}]
            took = time.monotonic() - start
            self.assertEqual(len(rows), 3, rows)
            self.assertTrue(all("error" in r for r in rows), rows)
            self.assertLess(took, 2.5, f"list_processes took {took:.1f}s with three stopped processes")
            start = time.monotonic()
            with self.assertRaises((OSError, control.ControlError)):
                control.pause("py-stopped", timeout=1.0)  # found by its name file, without asking
            self.assertLess(time.monotonic() - start, 2.5)
        finally:
            for child in children:
                os.kill(child.pid, signal.SIGCONT)
                child.kill()
                child.wait()
                child.stdin.close()
                child.stdout.close()


class TorchModeWithoutPreload(unittest.TestCase):
    """Loaded with ctypes (not preloaded), the library interposes nothing; tms_torch_malloc is
    the way in."""

    def test_no_interposition_and_torch_entry_points(self):
        code = textwrap.dedent(
            """
            import ctypes, tms
            assert tms.hook_mode() == "torch", tms.hook_mode()
            lib = ctypes.CDLL(tms.library_path())
            rt = ctypes.CDLL("libcudart.so.12")
            p = ctypes.c_void_p()
            with tms.disable():
                pass
            lib.tms_set_interesting_region(True)
            assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(2 << 20)) == 0
            assert tms.status() == [], "a plain cudaMalloc must not be tracked in torch mode"
            lib.tms_torch_malloc.restype = ctypes.c_void_p
            lib.tms_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            lib.tms_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            q = lib.tms_torch_malloc(4 << 20, 0, None)
            assert q
            assert tms.pause_report(None)["bytes_done"] == 4 << 20
            tms.resume(None)
            lib.tms_torch_free(q, 4 << 20, 0, None)
            assert rt.cudaFree(p) == 0
            print("torch-mode ok")
            """
        )
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["TMS_LIBRARY"] = os.path.join(os.environ["TMS_PREFIX"], "lib", "libtms_hook.so")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("torch-mode ok", out.stdout)


def private_tms_references(package_dir):
    """(file, line, name) for each import or attribute of a private tms module (``tms._x``) in the
    sources under ``package_dir``."""
    import ast  # noqa: PLC0415

    found = []
    for folder, _, files in os.walk(package_dir):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tms":
                    names = [f"tms.{node.attr}"]
                for n in names:
                    parts = n.split(".")
                    if parts[0] == "tms" and any(p.startswith("_") for p in parts[1:]):
                        found.append((os.path.relpath(path, package_dir), node.lineno, n))
    return found


class LiveOnly(unittest.TestCase):
    def test_free_blocks_are_read_from_a_segment_end_to_end(self):
        from tms.saver import _dead_blocks

        segment = {
            "address": 1 << 30,
            "total_size": 10 * MiB,
            "blocks": [
                {"size": 2 * MiB, "state": "active_allocated"},
                {"size": 3 * MiB, "state": "inactive"},
                {"size": 1 * MiB, "state": "active_pending_free"},
                {"size": 4 * MiB, "state": "inactive"},
            ],
        }
        self.assertEqual(_dead_blocks(segment), [((1 << 30) + 2 * MiB, 3 * MiB), ((1 << 30) + 6 * MiB, 4 * MiB)])

    def test_the_variable_turns_it_off_and_a_bad_value_keeps_it_on(self):
        from tms.saver import _live_only_default

        for value, want in [(None, True), ("0", False), ("off", False), ("1", True), ("maybe", True)]:
            with tms.change_env("TMS_BACKUP_LIVE_ONLY", value) if value is not None else _unset("TMS_BACKUP_LIVE_ONLY"):
                self.assertEqual(_live_only_default(), want, value)

    def test_a_range_outside_every_region_allocation_is_refused(self):
        from tms._lib import MemRange

        rt = cudart()
        rc, p = malloc(rt, MiB)
        self.assertEqual(rc, 0)
        r = (MemRange * 1)(MemRange(p.value, 4096))
        self.assertEqual(tms.saver.shared().cdll.tms_mark_dead(r, 1), tms.TMS_ERR_INVALID)
        self.assertEqual(rt.cudaFree(p), 0)


def _unset(name):
    import contextlib

    @contextlib.contextmanager
    def gone():
        old = os.environ.pop(name, None)
        try:
            yield
        finally:
            if old is not None:
                os.environ[name] = old

    return gone()


class GraphRegistration(unittest.TestCase):
    def run_child(self, value):
        # A child of its own: the setting is the process's, said once per process. The hook sets
        # it at the process's first region allocation (NCCL reads it later), in the C environment.
        env = {k: v for k, v in os.environ.items() if k != "NCCL_GRAPH_REGISTER"}
        if value is not None:
            env["NCCL_GRAPH_REGISTER"] = value
        code = textwrap.dedent(
            """
            import ctypes, tms
            rt = ctypes.CDLL("libcudart.so.12")
            for _ in range(2):
                with tms.region("graph-pool"):
                    p = ctypes.c_void_p()
                    assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1 << 20)) == 0
            libc = ctypes.CDLL(None)
            libc.getenv.restype = ctypes.c_char_p
            print(libc.getenv(b"NCCL_GRAPH_REGISTER").decode())
            """
        )
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    def test_a_pausable_graph_pool_turns_graph_registration_off_saying_so_when_the_user_had_it_on(self):
        out = self.run_child("1")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "0")
        self.assertEqual(out.stderr.count("NCCL_GRAPH_REGISTER=0 set for this process (was 1)"), 1, out.stderr)
        # NCCL's default (unset) is filled in without a warning, and a 0 left as it is.
        for value in [None, "0"]:
            out = self.run_child(value)
            self.assertEqual((out.returncode, out.stdout.strip()), (0, "0"), (value, out.stderr))
            self.assertNotIn("NCCL_GRAPH_REGISTER", out.stderr, value)


class Boundaries(unittest.TestCase):
    def test_torch_memory_saver_is_a_facade_over_public_tms(self):
        import torch_memory_saver  # noqa: PLC0415

        found = private_tms_references(os.path.dirname(torch_memory_saver.__file__))
        self.assertEqual(found, [], "torch_memory_saver reaches into private tms modules")
        # The check itself sees what it looks for.
        import tempfile  # noqa: PLC0415

        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "probe.py"), "w") as f:
                f.write("from tms._lib import load\nimport tms\nfrom tms import saver\ntms._saver\n")
            found = private_tms_references(d)
        self.assertEqual(found, [("probe.py", 1, "tms._lib"), ("probe.py", 1, "tms._lib.load"), ("probe.py", 4, "tms._saver")])

    def test_the_saver_package_carries_none_of_the_runners_python(self):
        import importlib.util  # noqa: PLC0415

        for name in ("tms.worker", "tms.ray.bridge"):
            self.assertIsNone(importlib.util.find_spec(name), f"{name} belongs to relax-colocate")


@unittest.skipUnless(has_torch_device(), "needs torch with a CUDA device (run by scripts/gpu-check.sh)")
class WithTorch(unittest.TestCase):
    def test_tensors_pause_and_resume_in_place(self):
        import torch

        with tms.region("torch", enable_cpu_backup=True):
            x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        ptr = x.data_ptr()
        expect = x.clone().cpu()
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        tms.pause("torch")
        free_after, _ = torch.cuda.mem_get_info()
        self.assertGreaterEqual(free_after - free_before, x.numel() * 4)
        tms.resume("torch")
        self.assertEqual(x.data_ptr(), ptr)
        self.assertTrue(torch.equal(x.cpu(), expect))


if __name__ == "__main__":
    unittest.main()
