"""The three memory-saver variants a real-consumer test runs under (the `which` fixture of
conftest.py): `ours`, our hook under upstream's file name with upstream's Python package;
`wheel`, our wheel's Python package and hook (what `pip install tms-memory-saver` gives);
`upstream`, torch_memory_saver 0.0.10 whole."""

import os
import sysconfig
from pathlib import Path

import torch_build

# Where torch_memory_saver 0.0.10's package and libraries are: this Python's site-packages, or the
# folder the hardware kit carries them in (TMS_TEST_UPSTREAM_SITE, also on PYTHONPATH there).
SITE = Path(os.environ.get("TMS_TEST_UPSTREAM_SITE") or sysconfig.get_paths()["purelib"])
# torch_memory_saver's preload library for this torch's CUDA major (the file slime preloads).
UPSTREAM_PRELOAD = torch_build.upstream_preload_name()
WHICH = ["ours", "wheel", "upstream"]


def preload_for(sim, which):
    """The library a preload-mode scenario of variant `which` puts in LD_PRELOAD."""
    if which == "ours":
        return sim.compat_dir() / "torch_memory_saver_hook_mode_preload.abi3.so"
    if which == "wheel":
        # The name slime puts in LD_PRELOAD, in the wheel's site folder.
        return Path(sim.python_path[0]) / UPSTREAM_PRELOAD
    return SITE / UPSTREAM_PRELOAD
