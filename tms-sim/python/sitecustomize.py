"""tms-sim's Python start-up hook (on PYTHONPATH through `tms-sim env`).

Costs nothing until a program imports torch. Then, before torch loads, it loads the simulator
($TMS_SIM_LIB, soname libcudart.so.13) so that torch's `NEEDED libcudart.so.13` binds to it
instead of the runtime its RPATH names; after torch has loaded, it installs the CPU compute layer
(tms_sim_torch) unless TMS_SIM_TORCH_LAYER=0.
"""

import importlib.abc
import importlib.machinery
import os
import sys


def _load_simulator():
    lib = os.environ.get("TMS_SIM_LIB")
    if not lib:
        return
    import ctypes

    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        sys.stderr.write(f"tms-sim: cannot load TMS_SIM_LIB={lib}: {exc}\n")


def _install_layer():
    if os.environ.get("TMS_SIM_TORCH_LAYER", "1") == "0":
        return
    try:
        import tms_sim_torch
    except ImportError:
        return
    tms_sim_torch.install()


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loading of the top-level `torch` package, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            _load_simulator()
            original_exec(module)
            _install_layer()

        loader.exec_module = exec_module
        return spec


if os.environ.get("TMS_SIM_LIB") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _TorchImportHook())
