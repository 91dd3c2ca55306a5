"""torch_npu programs through the tms-memory-saver wheel, written once for either accelerator.

On an Ascend NPU with torch_npu (the kit: `npu-check.sh run DIR OUT` sets TMS_TEST_DEVICE=npu and
TMS_TEST_REAL_DEVICE=1) each program imports torch_npu and runs on device "npu", with
`torch.npu.mem_get_info` as the free-memory probe: torch_npu's caching allocator takes its memory
with `aclrtMalloc`/`aclrtMallocAlign32` (preload mode: the hook catches them) or through
`NPUPluggableAllocator` (torch mode). In CI the very same programs run with torch_npu on the
simulator's Ascend devices (TMS_TEST_DEVICE=npu, set by tests/tests/torch.rs; their operators
computed by tms_sim_torch's CPU layer), so only the hardware differs on a 910B. Unset, the device
is "cuda" (a GPU, or the simulator's CUDA devices).

Each program checks what an RL framework relies on when it pauses a rollout or trainer: pause
frees the region's device memory, resume gives the same addresses and contents, memory outside the
region and in other tags is untouched, the CPU backup is handed out only while paused, and the
freed memory really is usable by others in between.
"""

import os

import pytest
import torch_build

DEVICE = os.environ.get("TMS_TEST_DEVICE", "cuda")
if DEVICE not in ("cuda", "npu"):
    raise ValueError(f"TMS_TEST_DEVICE must be cuda or npu, not {DEVICE!r}")

MIB = 1 << 20

PRELUDE = """
import os, torch
DEV = {device!r}
if DEV == "npu":
    import torch_npu  # noqa: F401 (registers torch.npu and the "npu" device)
acc = getattr(torch, DEV)
from torch_memory_saver import torch_memory_saver as saver
saver.hook_mode = {mode!r}
MIB = 1 << 20
def free():
    acc.synchronize()
    return acc.mem_get_info()[0]
"""

TAGS = """
pattern = (torch.arange(32 * MIB, dtype=torch.int64) * 2654435761 >> 11).to(torch.uint8)
outside = pattern[: 4 * MIB].to(DEV)
with saver.region(tag="weights", enable_cpu_backup=True):
    w = pattern.to(DEV)
with saver.region(tag="kv_cache"):
    kv = torch.full((8 * MIB,), 3, dtype=torch.uint8, device=DEV)
w_ptr, kv_ptr = w.data_ptr(), kv.data_ptr()
f0 = free()
saver.pause("weights")
f1 = free()
print("freed_weights=%d" % (f1 - f0))
backup = saver.get_cpu_backup(w)
print("backup_while_paused=%s" % (backup is not None and torch.equal(backup, pattern)))
kv.add_(1)  # another tag stays usable while weights are paused
print("kv_works=%s" % bool((kv.cpu() == 4).all()))
saver.pause("kv_cache")
f2 = free()
print("freed_kv=%d" % (f2 - f1))
saver.resume("weights")
saver.resume("kv_cache")
print("regained=%d" % (f2 - free()))
print("same_ptrs=%s" % (w.data_ptr() == w_ptr and kv.data_ptr() == kv_ptr))
print("weights_back=%s" % torch.equal(w.cpu(), pattern))
print("outside_kept=%s" % torch.equal(outside.cpu(), pattern[: 4 * MIB]))
print("backup_after_resume=%s" % (saver.get_cpu_backup(w) is not None))
"""

CYCLES = """
torch.manual_seed(0)
a = torch.randn(512, 512)
with saver.region(tag="weights", enable_cpu_backup=True):
    w = a.to(DEV)
x = torch.randn(512, 512).to(DEV)
first = (w @ x).cpu()
ptr = w.data_ptr()
ok = True
for step in range(20):
    saver.pause("weights")
    saver.resume("weights")
    ok = ok and w.data_ptr() == ptr and torch.equal((w @ x).cpu(), first)
print("cycles_ok=%s" % ok)
"""

FREED_IS_USABLE = """
with saver.region(tag="kv_cache"):
    kv = torch.full((64 * MIB,), 9, dtype=torch.uint8, device=DEV)
# Fill the device but for 96 MiB, outside any region: 128 MiB more fits only once the pause has
# freed the KV cache's 64 MiB.
filler = torch.empty(((free() - 96 * MIB) // (2 * MIB)) * 2 * MIB, dtype=torch.uint8, device=DEV)
saver.pause("kv_cache")
other = torch.ones(128 * MIB, dtype=torch.uint8, device=DEV)
other.mul_(5)
print("other_ok=%s" % bool((other.cpu() == 5).all()))
del other
acc.empty_cache()
saver.resume("kv_cache")
kv.fill_(7)
print("kv_usable=%s" % bool((kv.cpu() == 7).all()))
"""


def _run(sim, fresh_venv, mode, body):
    python, site = fresh_venv
    code = PRELUDE.format(device=DEVICE, mode=mode) + body
    # torch_npu's torch is a CPU build (no CUDA major): the wheel's unversioned name serves it.
    name = torch_build.upstream_preload_name() if DEVICE == "cuda" else "torch_memory_saver_hook_mode_preload.abi3.so"
    preload = site / name if mode == "preload" else None
    # torch_npu starts only where CUDA has no device: on the simulator its NPUs come alone.
    return sim.ok(code, python=python, preload=preload, memory="2GiB", npu_only=DEVICE == "npu")


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_tags_pause_free_and_resume_restore(sim, fresh_venv, mode):
    out = _run(sim, fresh_venv, mode, TAGS)
    assert int(out["freed_weights"]) >= 32 * MIB, out
    assert out["backup_while_paused"] == "True", out
    assert out["kv_works"] == "True", out
    assert int(out["freed_kv"]) >= 8 * MIB, out
    assert int(out["regained"]) >= 40 * MIB, out
    assert out["same_ptrs"] == "True", out
    assert out["weights_back"] == "True", out
    assert out["outside_kept"] == "True", out
    assert out["backup_after_resume"] == "False", out


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_twenty_cycles_keep_a_matmul_exact(sim, fresh_venv, mode):
    out = _run(sim, fresh_venv, mode, CYCLES)
    assert out["cycles_ok"] == "True", out


@pytest.mark.parametrize("mode", ["preload", "torch"])
def test_memory_freed_by_a_pause_is_usable_by_others(sim, fresh_venv, mode):
    out = _run(sim, fresh_venv, mode, FREED_IS_USABLE)
    assert out["other_ok"] == "True", out
    assert out["kv_usable"] == "True", out
