"""Rust parts of the tms-memory-saver wheel (metadata is in pyproject.toml).

The hook is one library for every CUDA major and for Ascend. It is installed at the top of
site-packages under each name torch_memory_saver's users refer to: slime builds LD_PRELOAD from
``<site-packages>/torch_memory_saver_hook_mode_preload_cu13.abi3.so`` (cu12 and unsuffixed as
fallbacks), and code written for upstream's torch mode loads the ``hook_mode_torch`` names.
Wheels cannot hold symbolic links, so these are copies, made by setuptools-rust from one cargo
build (the later ones are cargo cache hits). build_py adds tms_memory_saver.pth, the start-up
check of those files (python/_tms_install_check.py).
"""

import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustBin, RustExtension

HOOK_NAMES = [
    f"torch_memory_saver_hook_mode_{mode}{cuda}"
    for mode in ("preload", "torch")
    for cuda in ("", "_cu12", "_cu13")
]

# A wheel carries no debug info (the exported symbols stay): 3 MB a copy instead of 15.
os.environ.setdefault("CARGO_PROFILE_RELEASE_DEBUG", "0")
os.environ.setdefault("CARGO_PROFILE_RELEASE_STRIP", "debuginfo")

# Run at every interpreter start-up from the top of site-packages: a few stat calls, silent when
# torch_memory_saver's files are the wheel's, one warning with the repair when pip replaced or
# removed them (python/_tms_install_check.py).
PTH_NAME = "tms_memory_saver.pth"
PTH_LINE = "import _tms_install_check; _tms_install_check.at_startup()\n"


class BuildPyWithStartupCheck(build_py):
    """build_py, plus the start-up check's .pth file at the top of the wheel."""

    def run(self):
        super().run()
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "python", "_tms_install_check.py")) as f:
            checked = re.search(r'^VERSION = "([^"]+)"', f.read(), re.M).group(1)
        if checked != self.distribution.get_version():
            raise SystemExit(
                f"python/_tms_install_check.py says VERSION = {checked!r}, pyproject.toml {self.distribution.get_version()!r}: "
                "the check finds the wheel's RECORD by that version"
            )
        os.makedirs(self.build_lib, exist_ok=True)
        with open(os.path.join(self.build_lib, PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


options = {"bdist_wheel": {"py_limited_api": "cp38"}}
# Only a build linked against glibc 2.17 (cargo-zigbuild's <arch>-unknown-linux-gnu.2.17) may
# claim manylinux2014, for the architecture it was built for (torch_memory_saver ships
# manylinux2014_x86_64 and manylinux2014_aarch64); scripts/build-wheel.sh checks every ELF file's
# machine and symbol versions before it says so.
_target = os.environ.get("CARGO_BUILD_TARGET", "")
if _target.endswith("-unknown-linux-gnu.2.17"):
    _arch = _target.split("-", 1)[0]
    if _arch not in ("x86_64", "aarch64"):
        raise SystemExit(f"setup.py: no manylinux2014 platform tag for CARGO_BUILD_TARGET={_target}")
    options["bdist_wheel"]["plat_name"] = f"manylinux2014_{_arch}"

setup(
    rust_extensions=[
        RustExtension(name, path="tms-hook/Cargo.toml", binding=Binding.NoBinding, py_limited_api=True)
        for name in HOOK_NAMES
    ]
    + [RustBin("tms-ctl", path="tms-ctl/Cargo.toml")],
    cmdclass={"build_py": BuildPyWithStartupCheck},
    options=options,
)
