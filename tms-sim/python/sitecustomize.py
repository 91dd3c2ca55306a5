"""tms-sim's Python start-up hook (on PYTHONPATH through `tms-sim env`).

Costs nothing until a program imports torch (no import beyond what Python has already loaded).
Then, before torch loads, it loads the simulator ($TMS_SIM_LIB, soname libcudart.so.13) and its
CUDA 12 name (cuda12/libtms_sim_cuda12.so beside it, soname libcudart.so.12) so that torch's `NEEDED libcudart.so.13` (or
`.12`, for a CUDA 12 build) binds to it instead of the runtime its RPATH names (a simulator
already loaded with LD_PRELOAD is fine too); right after torch has loaded, it installs the CPU
compute layer (`tms_sim_torch.install()`) unless TMS_SIM_TORCH_LAYER=0, and its kernels for
torch_npu's device right after torch_npu loads (`tms_sim_torch.install_npu()`). The layer itself
checks that the simulator is the CUDA runtime in use, so on a real GPU or NPU nothing changes.

A `sitecustomize` later on sys.path (which this file shadows) is run too.
"""

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
        return
    # A CUDA 12 build of torch needs libcudart.so.12 the same way: tms-sim-lib/cuda12/ holds an
    # object with that soname and no functions of its own (its references bind to the simulator).
    _load_name(lib, "cuda12", "libtms_sim_cuda12.so", "CUDA 12 builds of torch would load NVIDIA's runtime")
    # torch's libtorch_cuda.so needs libnccl.so.2 by its RPATH too: nccl/ holds an object with
    # that soname whose NCCL references bind to the simulator (torch.distributed's "nccl").
    _load_name(lib, "nccl", "libtms_sim_nccl.so", "torch would load NVIDIA's NCCL")


def _load_name(lib, folder, file, otherwise):
    """Loads a soname stand-in from tms-sim-lib/FOLDER/ beside the simulator, if it is there."""
    import ctypes

    path = os.path.join(os.path.dirname(lib), folder, file)
    if os.path.exists(path):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            sys.stderr.write(f"tms-sim: cannot load {path} ({otherwise}): {exc}\n")


def _install_layer():
    if os.environ.get("TMS_SIM_TORCH_LAYER", "1") == "0":
        return
    try:
        import tms_sim_torch

        tms_sim_torch.install()
    except Exception as exc:  # never break `import torch`; kernels then raise as without the layer
        sys.stderr.write(f"tms-sim: the CPU compute layer for torch is not installed: {exc!r}\n")


def _install_npu_layer():
    # torch_npu imported after torch (its device-backend autoload off): its kernels are registered
    # now, so the layer's PrivateUse1 kernels can replace them. Within torch's own import (the
    # autoload), `install()` after torch does it instead.
    if os.environ.get("TMS_SIM_TORCH_LAYER", "1") == "0":
        return
    try:
        import tms_sim_torch

        tms_sim_torch.install_npu()
    except Exception as exc:  # never break `import torch_npu`; its operators then fail as without
        sys.stderr.write(f"tms-sim: the CPU compute layer for torch_npu is not installed: {exc!r}\n")


class _TorchImportHook:
    """A meta path finder that wraps the loading of the top-level `torch` package, and then of
    `torch_npu`, once each."""

    def __init__(self):
        self.pending = {"torch": (_load_simulator, _install_layer), "torch_npu": (None, _install_npu_layer)}

    def find_spec(self, name, path=None, target=None):
        hooks = self.pending.pop(name, None)
        if hooks is None:
            return None
        if not self.pending:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        before, after = hooks
        spec = None
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            if before is not None:
                before()
            original_exec(module)
            after()

        spec.loader.exec_module = exec_module
        return spec


def _chain():
    """Runs the next `sitecustomize.py` on sys.path, which this module shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        d = os.path.abspath(entry or os.getcwd())
        if d == here:
            continue
        path = os.path.join(d, "sitecustomize.py")
        if os.path.isfile(path):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_tms_sim_chained_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                sys.stderr.write(f"tms-sim: {path} failed: {exc!r}\n")
            return


if "torch" not in sys.modules and (
    os.environ.get("TMS_SIM_LIB") or os.environ.get("TMS_SIM_TORCH_LAYER", "1") != "0"
):
    sys.meta_path.insert(0, _TorchImportHook())
_chain()
