"""tms_sim_torch: run unchanged PyTorch CUDA programs on the tms simulator.

The simulator (`libtms_sim.so`, standing in for libcudart/libcuda) emulates a CUDA device on host
memory but runs no kernels. This package registers CPU implementations for the CUDA dispatch key of
every aten op that would launch a kernel, so those ops compute on the CPU, directly in the
simulated device memory, while allocation, frees, views, streams, events and plain copies stay on
the simulated device. See `_layer` for how, and README.md next to this package for the limits.
torch_npu's "npu" device (PrivateUse1) on the simulated Ascend devices gets the same kernels
(`_npu`), registered once torch_npu is imported (`install_npu()`).

`install()` is called by the simulator's `sitecustomize` right after `import torch` (unless
`TMS_SIM_TORCH_LAYER=0`); it only activates when the simulator's runtime is the one loaded.
"""

import os
import sys
import threading

__all__ = ["install", "install_npu", "installed", "on_simulator", "set_async"]

_lock = threading.Lock()
_state = {"installed": False, "npu": False, "error": None}


def on_simulator():
    """True when the process's CUDA runtime is the simulator's (so no real GPU is in use)."""
    from . import _layer

    return _layer._runtime() is not None


def installed():
    return _state["installed"]


def install(force=False):
    """Registers the CPU kernels (idempotent; thread-safe). Returns True when the layer is active.

    Without `force`, does nothing (returns False) when `TMS_SIM_TORCH_LAYER=0` or when the
    simulator is not the loaded CUDA runtime: on a real GPU the layer never activates.
    """
    with _lock:
        if _state["installed"]:
            return True
        if not force and os.environ.get("TMS_SIM_TORCH_LAYER", "1") == "0":
            return False
        from . import _layer

        if _layer._runtime() is None:
            if force:
                raise _layer.LayerError(
                    "tms_sim_torch: the simulator is not this process's CUDA runtime "
                    "(load it first: LD_PRELOAD or TMS_SIM_LIB with the simulator's sitecustomize)"
                )
            return False
        _layer.register()
        _state["installed"] = True
        if "torch_npu" in sys.modules:  # loaded with torch (its device-backend autoload)
            _install_npu()
        return True


def install_npu():
    """Registers the CPU kernels of torch_npu's "npu" device, once torch_npu is imported (its own
    registrations would replace them otherwise); sitecustomize calls it right after `import
    torch_npu`. Does nothing unless the layer is installed. Returns True when they are active."""
    with _lock:
        if not _state["installed"]:
            return False
        return _install_npu()


def _install_npu():
    if not _state["npu"]:
        from . import _layer, _npu

        _npu.register(_layer._rt)
        _state["npu"] = True
    return True


def set_async(on=True):
    """Whether the layer's kernels are queued on their streams, asynchronous to the host as on a
    GPU (True, the default), or computed in the calling thread (False; `TMS_SIM_TORCH_ASYNC=0`
    starts with False). Returns the previous setting. See `_layer` and docs/simulator.md."""
    from . import _layer

    return _layer.set_async(on)
