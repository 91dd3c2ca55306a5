"""torch_memory_saver's Python API, served by tms (libtms_hook.so).

Installed by the tms-memory-saver wheel in place of the torch_memory_saver package: code written
for torch_memory_saver (SGLang, slime, verl) runs unchanged. Where upstream would exit the
process or ignore a failed pause/resume, this raises ``tms.TmsError`` with what was done; ``tms``
has the extras (reports, status, the control socket).
"""

from tms import TmsError

from .entrypoint import TorchMemorySaver
from .hooks.mode_preload import configure_subprocess

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "TmsError"]

# The process-wide object every framework imports.
torch_memory_saver = TorchMemorySaver()
