"""Our own Python package (python/tms) with real PyTorch: regions keep PyTorch's caching
allocator from handing one tag's cached block to another tag, in both hook modes."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python"

ISOLATION = """
import torch, tms
MIB = 1 << 20
with tms.region("A"):
    a = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
a_ptr = a.data_ptr()
del a  # its block stays in the caching allocator, tagged A in the hook
with tms.region("B", enable_cpu_backup=True):
    b = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
b.copy_(torch.arange(8 * MIB, dtype=torch.int64).to(torch.uint8))
with tms.disable():
    c = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
print("b_reused_a=%s" % (b.data_ptr() == a_ptr))
print("c_reused_a=%s" % (c.data_ptr() == a_ptr))
free0 = torch.cuda.mem_get_info()[0]
tms.pause("B")
print("freed_b=%d" % (torch.cuda.mem_get_info()[0] - free0))
tms.resume("B")
print("b_intact=%s" % bool(torch.equal(b.cpu(), torch.arange(8 * MIB, dtype=torch.int64).to(torch.uint8))))
"""


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_regions_get_their_own_pools(sim, mode, request):
    # The checkout's package; in the hardware kit (no checkout) the installed wheel's.
    package = PACKAGE if PACKAGE.is_dir() else request.getfixturevalue("wheel_site")
    extra = {"PYTHONPATH": f"{sim.sim_python}:{package}"}
    if mode == "torch":
        extra["TMS_LIBRARY"] = str(sim.hook)
    out = sim.ok(ISOLATION, preload=sim.hook if mode == "preload" else None, extra=extra)
    assert out["b_reused_a"] == "False", out
    assert out["c_reused_a"] == "False", out
    assert int(out["freed_b"]) >= 8 << 20, out
    assert out["b_intact"] == "True", out


VERIFY = """
import torch, tms
MIB = 1 << 20
tms.set_verify_restore(True)
with tms.region("w", enable_cpu_backup=True):
    w = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
w.copy_(torch.arange(4 * MIB, dtype=torch.int64).to(torch.uint8))
want = w.cpu()
tms.pause("w")
tms.resume("w")
print("clean=%s" % bool(torch.equal(w.cpu(), want)))
tms.pause("w")
backup = tms.get_cpu_backup(w, zero_copy=True)
backup[3 * MIB + 7] += 1  # host memory written while paused
try:
    tms.resume("w")
    print("raised=False")
except tms.TmsError as e:
    print("raised=True")
    print("code=%d" % e.code)
print("mapped=%s" % bool(w.cpu().numel() == 4 * MIB))
print("differs_at_the_write=%s" % bool(int(w[3 * MIB + 7].item()) == (int(want[3 * MIB + 7].item()) + 1) % 256))
"""


def test_verify_restore_turns_a_corrupted_backup_into_an_error(sim, request):
    package = PACKAGE if PACKAGE.is_dir() else request.getfixturevalue("wheel_site")
    out = sim.ok(VERIFY, preload=sim.hook, extra={"PYTHONPATH": f"{sim.sim_python}:{package}"})
    assert out["clean"] == "True", out
    assert out["raised"] == "True" and out["code"] == "7", out  # TMS_ERR_CORRUPT
    # The memory stays mapped, with what the backup held: the caller decides what to do.
    assert out["mapped"] == "True" and out["differs_at_the_write"] == "True", out
