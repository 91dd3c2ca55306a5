"""Shared fixtures of the real-consumer tests: every test runs its scenario in a fresh Python
process on a private simulated node, with the simulator's environment (tms-sim env) and, where
asked, a memory-saver library preloaded. The harness (tests/tests/torch.rs) sets:

  TMS_TEST_SIM           the tms-sim CLI, whose `env --json` gives each scenario's environment
  TMS_TEST_HOOK          libtms_hook.so
  TMS_TEST_TMP           a scratch folder for this run
  TMS_TEST_WHEEL         the tms-memory-saver wheel built by scripts/build-wheel.sh

On a real GPU (scripts/gpu-check.sh run) TMS_TEST_REAL_DEVICE=1 replaces the simulator: the
scenarios run on the machine's device, and the simulator's variables are neither needed nor set.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from variants import SITE, UPSTREAM_PRELOAD

REAL_DEVICE = os.environ.get("TMS_TEST_REAL_DEVICE") == "1"


def free_port():
    """A TCP port nothing listens on now, for a rendezvous: the kernel's pick, bound and released,
    as the frameworks choose theirs. A port derived from the pid and the clock can land on one in
    use (a peer test's store, another program's ephemeral port) and fail the rendezvous with
    EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _required(name):
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: run these tests through `cargo test -p tms-e2e --test torch`")
    return value


def sim_env(*args):
    """`tms-sim env --json ARGS`: what puts a process on the simulator, as the simulator's own CLI
    says (so that no test writes its variables or library paths)."""
    out = subprocess.run(
        [_required("TMS_TEST_SIM"), "env", "--json", *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        pytest.fail(f"tms-sim env {' '.join(args)} failed: {out.stderr}")
    return json.loads(out.stdout)


class SimRun:
    """Runs Python snippets on a simulated node of its own."""

    def __init__(self, tmp):
        self.hook = Path(_required("TMS_TEST_HOOK"))
        self.tmp = Path(tmp)
        self.node = f"torch-{uuid.uuid4().hex[:12]}"
        # Folders put before the simulator's on PYTHONPATH (an installed wheel's site folder).
        self.python_path = []
        if REAL_DEVICE:
            self.lib_dir = None
            # The outer PYTHONPATH, which tests put before their own folders.
            self.sim_python = os.environ.get("PYTHONPATH", "")
            return
        # The runtime-named links and the start-up hook folder, for tests that look at them.
        prepend = sim_env()["prepend"]
        self.lib_dir = Path(prepend["LD_LIBRARY_PATH"])
        self.sim_python = prepend["PYTHONPATH"]

    def env(self, devices=1, memory="4GiB", preload=None, extra=None, npu_only=False):
        if REAL_DEVICE:
            # The machine's own environment (a dry run of the kit on the simulator keeps its
            # TMS_SIM_* and PYTHONPATH, which a GPU machine does not have).
            env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_PRELOAD")) or k.startswith("TMS_SIM_")}
            outer = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
            env.update({"PYTHONPATH": ":".join(self.python_path + outer), "PYTHONUNBUFFERED": "1"})
            if preload:
                env["LD_PRELOAD"] = str(preload)
            env.update(extra or {})
            return env
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_PRELOAD"))}
        args = ["--node", self.node, "--dir", str(self.tmp), "--devices", str(devices), "--memory", memory]
        # torch_npu refuses to start beside a CUDA device: its scenarios see NPUs only.
        doc = sim_env(*args, *(["--npu-only"] if npu_only else []))
        # Folders the simulator prepends replace the outer ones: each scenario sees only its own;
        # on PYTHONPATH, after a test's own folders.
        for name, folder in doc["prepend"].items():
            env[name] = ":".join(self.python_path + [folder]) if name == "PYTHONPATH" else folder
        env.update(doc["set"])
        env["PYTHONUNBUFFERED"] = "1"
        if preload:
            env["LD_PRELOAD"] = str(preload)
        env.update(extra or {})
        return env

    def python(self, code, timeout=240, as_file=False, python=sys.executable, **kw):
        """Runs `code` (dedented) with `python` and returns the completed process; stdout/stderr
        as text. `as_file`: run it as a script file (multiprocessing's spawn needs an importable
        main)."""
        code = textwrap.dedent(code)
        argv = [str(python), "-c", code]
        if as_file:
            script = self.tmp / f"scenario_{uuid.uuid4().hex[:8]}.py"
            script.write_text(code)
            argv = [str(python), str(script)]
        return subprocess.run(
            argv,
            env=self.env(**kw),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.tmp,
        )

    def ok(self, code, **kw):
        """Runs `code`, requires exit 0, and returns the `KEY=VALUE` lines it printed as a dict."""
        proc = self.python(code, **kw)
        assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)

    def compat_dir(self):
        """A folder where our hook carries torch_memory_saver's preload file name."""
        d = self.tmp / "compat"
        d.mkdir(exist_ok=True)
        link = d / "torch_memory_saver_hook_mode_preload.abi3.so"
        if not link.exists():
            link.symlink_to(self.hook)
        return d


@pytest.fixture
def sim(tmp_path):
    return SimRun(tmp_path)


def _pip(python, *args):
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True, capture_output=True, text=True
    )


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory):
    """The wheel installed with pip into a folder of its own (put first on PYTHONPATH, its
    torch_memory_saver stands in front of upstream's in the test environment)."""
    wheel = _required("TMS_TEST_WHEEL")
    site = tmp_path_factory.mktemp("wheel-site")
    _pip(sys.executable, "install", "--no-deps", "--no-index", "--target", str(site), wheel)
    return site


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory):
    """A new virtual environment with only the wheel installed by pip; PyTorch (and numpy) are
    reached through a .pth file naming the test environment's site-packages, after the venv's
    own. Returns (python, site-packages)."""
    import sysconfig

    wheel = _required("TMS_TEST_WHEEL")
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    python = venv / "bin" / "python"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
    if made.returncode == 0:
        _pip(python, "install", "--no-deps", "--no-index", wheel)
    else:
        # No ensurepip (Debian without python3-venv): this interpreter's pip installs into it.
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
        _pip(sys.executable, "--python", str(python), "install", "--no-deps", "--no-index", wheel)
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )
    (site / "zz-torch-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


@pytest.fixture
def which(request, sim):
    """The variant (variants.py) named by the test's `which` parameter, set up on `sim`."""
    if request.param == "upstream" and not (SITE / UPSTREAM_PRELOAD).exists():
        pytest.skip("torch_memory_saver's own package is not installed here")
    if request.param == "wheel":
        sim.python_path.insert(0, str(request.getfixturevalue("wheel_site")))
    return request.param
