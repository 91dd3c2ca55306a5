"""Helpers torch_memory_saver's modules (and its users' tests) import from here."""

from functools import lru_cache
from pathlib import Path

from tms import TMS_ERR_NO_DRIVER, TmsError, change_env, packaged_hook, preloaded_hook

__all__ = ["change_env", "get_binary_path_from_package", "is_xpu"]


@lru_cache(maxsize=1)
def is_xpu() -> bool:
    """tms drives CUDA and Ascend devices; Intel XPU is not one of them."""
    return False


def _suffixes():
    """The copy named for the CUDA major of the torch in use first (as upstream picks it)."""
    import sys  # noqa: PLC0415

    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) or ""
    first = f"_cu{cuda.split('.')[0]}" if cuda[:1].isdigit() else ""
    return [first] + [s for s in ("", "_cu13", "_cu12") if s != first]


def get_binary_path_from_package(stem: str) -> Path:
    """The installed hook under torch_memory_saver's name ``stem`` (``<stem>.abi3.so``, or the
    ``_cu13``/``_cu12`` copies: one library serves every CUDA major), in site-packages or next
    to this package; else ``$TMS_LIBRARY``, the hook in LD_PRELOAD, or an install prefix's."""
    here = Path(__file__).resolve().parent
    for d in (here.parent, here):
        for suffix in _suffixes():
            candidate = d / f"{stem}{suffix}.abi3.so"
            if candidate.is_file():
                return candidate
    fallback = packaged_hook("torch" if "torch" in stem.rsplit("_mode_", 1)[-1] else "preload") or preloaded_hook()
    if fallback:
        return Path(fallback)
    raise TmsError(
        TMS_ERR_NO_DRIVER,
        f"{stem}.abi3.so is not installed next to torch_memory_saver ({here.parent}): reinstall "
        "the tms-memory-saver wheel, or set LD_PRELOAD / TMS_LIBRARY to libtms_hook.so yourself",
    )

