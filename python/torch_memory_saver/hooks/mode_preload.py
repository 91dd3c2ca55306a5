"""Preload mode: the hook is in LD_PRELOAD, and children get it through configure_subprocess()."""

import os
from contextlib import contextmanager

from tms import TMS_ERR_NO_DRIVER, TmsError, preload_with, preloaded_hook

from ..utils import change_env, get_binary_path_from_package
from .base import HookUtilBase


class HookUtilModePreload(HookUtilBase):
    def get_path_binary(self):
        path = preloaded_hook()
        if path is None:
            raise TmsError(
                TMS_ERR_NO_DRIVER,
                "hook_mode='preload' needs the hook in LD_PRELOAD (start the process inside "
                f"configure_subprocess(), or with LD_PRELOAD=<the library>); LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}",
            )
        return path


@contextmanager
def configure_subprocess():
    """Children started inside the block preload the hook: first in LD_PRELOAD, the only hook
    entry there (another copy already listed is replaced, not kept beside it), the rest kept."""
    path = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    with change_env("LD_PRELOAD", preload_with(path, os.environ.get("LD_PRELOAD"))):
        yield
