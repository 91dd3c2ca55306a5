"""Fixtures shared by the CPU layer's tests."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def tms_torch_mode():
    """The repository's `tms` package over libtms_hook.so in torch mode (the harness names the hook
    it built in TMS_TEST_HOOK: its target folder may be elsewhere, CARGO_TARGET_DIR); skipped
    when the hook is not built or is preloaded."""
    hooks = [os.environ.get("TMS_TEST_HOOK", "")]
    hooks += [os.path.join(ROOT, "target", p, "libtms_hook.so") for p in ("debug", "release")]
    hook = next((h for h in hooks if os.path.isfile(h)), None)
    if hook is None or not os.path.isdir(os.path.join(ROOT, "python", "tms")):
        pytest.skip("libtms_hook.so or the tms package is not built")
    os.environ.setdefault("TMS_LIBRARY", hook)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import tms

    if tms.hook_mode() != "torch":
        pytest.skip("the hook is preloaded; this test uses torch mode")
    return tms
