"""Only live bytes cross the bus: a region's pool fragmented the way training leaves it (weights,
optimizer state, the optimizer step's temporaries and a freed set of activations) is paused with
backup through tms and through torch_memory_saver. The pause copies exactly the blocks PyTorch's
caching allocator has in use, as its snapshot says, every live tensor comes back identical, and
with TMS_BACKUP_LIVE_ONLY=0 the whole segments are copied again."""

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python"

FRAGMENTED = """
import os, torch, tms
import torch_memory_saver
MIB = 1 << 20
API = os.environ["LIVE_TEST_API"]
saver = torch_memory_saver.torch_memory_saver if API == "facade" else tms

def region():
    return saver.region(tag="train", enable_cpu_backup=True)

g = torch.Generator().manual_seed(0)
def randn(*shape):
    return torch.randn(*shape, generator=g).cuda()

with region():
    # Every tensor above 1 MiB: PyTorch's large pool, where free blocks are at least 1 MiB.
    params = [randn(1536, 1024) for _ in range(4)]              # 6 MiB each
    grads = [randn(1536, 1024) for _ in range(4)]
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    acts = [randn(1280, 1024) for _ in range(6)]                # 5 MiB each
    # An Adam-style step: its temporaries are freed blocks inside the segments afterwards.
    for p, gr, m, v in zip(params, grads, exp_avg, exp_avg_sq):
        m.mul_(0.9).add_(gr * 0.1)
        v.mul_(0.999).add_(gr * gr * 0.001)
        p.sub_(m / (v.sqrt() + 1e-8) * 1e-3)
    del grads, acts[::2]                                        # the backward pass is over
torch.cuda.synchronize()
live = params + exp_avg + exp_avg_sq + acts
want = [t.cpu() for t in live]

pools = [pool for key, pool in tms.saver.shared().mem_pools.items() if key[0] == "train"]
segments = [s for pool in pools for s in torch.cuda.memory_snapshot(pool.id)]
total = sum(s["total_size"] for s in segments)
in_use = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] != "inactive")
print("segments=%d" % len(segments))
print("region_bytes=%d" % total)
print("live_bytes=%d" % in_use)
print("small_free=%d" % sum(1 for s in segments for b in s["blocks"] if b["state"] == "inactive" and b["size"] < MIB))

if API != "facade":
    report = tms.pause_report("train")
else:
    saver.pause("train")
    report = tms.control.status(os.getpid())["last_pause"]
print("copied=%d" % report["backup_bytes"])
print("skipped=%d" % report["backup_bytes_skipped"])
print("paused_bytes=%d" % report["bytes_done"])
saver.resume("train")
print("identical=%s" % all(torch.equal(t.cpu(), w) for t, w in zip(live, want)))
# The allocator reuses the freed blocks after the resume: the next pause must not skip them.
with region():
    again = randn(1280, 1024)
torch.cuda.synchronize()
want_again = again.cpu()
saver.pause("train")
saver.resume("train")
print("reused_block_identical=%s" % torch.equal(again.cpu(), want_again))
"""


@pytest.mark.parametrize("api", ["tms", "facade", "tms-torch-mode"])
@pytest.mark.parametrize("live_only", ["1", "0"])
def test_a_fragmented_pool_copies_only_its_live_blocks(sim, api, live_only, request):
    # A checkout's python/ holds both packages; the hardware kit's only `tms`: there the wheel's.
    package = PACKAGE if (PACKAGE / "torch_memory_saver").is_dir() else request.getfixturevalue("wheel_site")
    extra = {
        "PYTHONPATH": f"{sim.sim_python}:{package}",
        "LIVE_TEST_API": api,
        "TMS_BACKUP_LIVE_ONLY": live_only,
    }
    preload = sim.hook
    if api == "tms-torch-mode":
        # PyTorch's pluggable allocator makes the pool's segments through tms_torch_malloc.
        extra["TMS_LIBRARY"] = str(sim.hook)
        preload = None
    out = sim.ok(FRAGMENTED, preload=preload, extra=extra)
    region, live = int(out["region_bytes"]), int(out["live_bytes"])
    assert out["small_free"] == "0", out  # the scenario keeps to blocks the hook can skip whole
    assert live < region, out
    assert out["identical"] == "True", out
    assert out["reused_block_identical"] == "True", out
    assert int(out["paused_bytes"]) == region, out
    if live_only == "1":
        assert int(out["copied"]) == live, out
        assert int(out["skipped"]) == region - live, out
    else:
        assert int(out["copied"]) == region, out
        assert int(out["skipped"]) == 0, out
