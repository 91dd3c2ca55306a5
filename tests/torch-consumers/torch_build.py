"""Facts about the PyTorch build under test, read from its installed files: the scenarios run in
fresh processes, so the test process itself never imports torch."""

import re
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])


def _version_file():
    return (SITE / "torch" / "version.py").read_text()


def cuda_major():
    """"13" for the CUDA 13.2 build, "12" for the CUDA 12.8 one."""
    return re.search(r"^cuda[^=]*=\s*'(\d+)\.", _version_file(), re.M).group(1)


def version():
    """(major, minor) of torch itself."""
    found = re.search(r"^__version__[^=]*=\s*'(\d+)\.(\d+)", _version_file(), re.M)
    return tuple(int(n) for n in found.groups())


def upstream_preload_name():
    """The file of torch_memory_saver's preload library that matches this torch's CUDA major, as
    slime puts in LD_PRELOAD (torch_memory_saver ships one per major)."""
    return f"torch_memory_saver_hook_mode_preload_cu{cuda_major()}.abi3.so"
