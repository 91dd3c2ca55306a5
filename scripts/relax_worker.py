"""The worker-protocol client under its old name, for programs that `import relax_worker`.

The client is `tms.worker`, installed with the tms package (the wheel, install.sh). This file
makes it importable as `relax_worker`: from python/ next to this folder in a checkout or the
hardware kit (that copy matches these scripts), else from the installed tms package.
"""

import os
import sys

_checkout = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
if os.path.isdir(os.path.join(_checkout, "tms")) and _checkout not in sys.path:
    sys.path.insert(0, _checkout)
try:
    from tms import worker as _worker
except ImportError as e:
    raise ImportError(
        f"relax_worker: the tms package has no worker module ({e}); install this release's tms wheel "
        "or run from a checkout (python/ beside scripts/)"
    ) from e

sys.modules[__name__] = _worker
