"""libtms_hook.so under real PyTorch and torch_memory_saver 0.0.10's own Python package (preload
mode, our hook under its file name), side by side with torch_memory_saver's own library."""

import importlib.util

import pytest
import torch_build
from variants import SITE

# These scenarios run torch_memory_saver's own Python package (over its library and over ours): on
# a GPU machine where it is not installed (the hardware kit), there is nothing to compare.
if importlib.util.find_spec("torch_memory_saver") is None:
    pytest.skip("torch_memory_saver's own package is not installed here", allow_module_level=True)


def _preload(sim, which):
    if which == "ours":
        return sim.compat_dir() / "torch_memory_saver_hook_mode_preload.abi3.so"
    return SITE / torch_build.upstream_preload_name()


CYCLE = """
import torch, torch_memory_saver
saver = torch_memory_saver.torch_memory_saver
MIB = 1 << 20
pattern = (torch.arange(64 * MIB, dtype=torch.int64) * 2654435761 >> 7).to(torch.uint8)
outside = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
outside.copy_(pattern[: 8 * MIB])
with saver.region(tag="weights", enable_cpu_backup=True):
    w = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
with saver.region(tag="kv_cache"):
    kv = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
w.copy_(pattern)
torch.cuda.synchronize()
ptr = w.data_ptr()
free0 = torch.cuda.mem_get_info()[0]
saver.pause("weights")
free1 = torch.cuda.mem_get_info()[0]
saver.pause("kv_cache")
free2 = torch.cuda.mem_get_info()[0]
saver.resume("weights")
saver.resume("kv_cache")
free3 = torch.cuda.mem_get_info()[0]
print("freed_weights=%d" % (free1 - free0))
print("freed_kv=%d" % (free2 - free1))
print("regained=%d" % (free2 - free3))
print("same_ptr=%s" % (w.data_ptr() == ptr))
print("same_bytes=%s" % bool(torch.equal(w.cpu(), pattern)))
print("outside_kept=%s" % bool(torch.equal(outside.cpu(), pattern[: 8 * MIB])))
backup = saver.get_cpu_backup(w)
print("backup_after_resume=%s" % (backup is not None))
"""


@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_pause_frees_and_resume_restores_real_tensors(sim, which):
    out = sim.ok(CYCLE, preload=_preload(sim, which), memory="2GiB")
    assert int(out["freed_weights"]) >= 64 << 20, out
    assert int(out["freed_kv"]) >= 32 << 20, out
    assert int(out["regained"]) >= 96 << 20, out
    assert out["same_ptr"] == "True"
    assert out["same_bytes"] == "True"
    assert out["outside_kept"] == "True"


@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_no_cpu_backup_is_handed_out_after_resume(sim, which):
    # slime pushes whatever get_cpu_backup returns: a stale snapshot would be old weights.
    out = sim.ok(CYCLE, preload=_preload(sim, which), memory="2GiB")
    assert out["backup_after_resume"] == "False"


@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_retained_backup_is_handed_out_after_resume(sim, which):
    out = sim.ok(CYCLE, preload=_preload(sim, which), memory="2GiB", extra={"TMS_RETAIN_CPU_BACKUP": "1"})
    assert out["backup_after_resume"] == "True"


RSS = """
import torch, torch_memory_saver
saver = torch_memory_saver.torch_memory_saver
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
n = 256 << 20
torch.cuda.synchronize()
r0 = rss()
with saver.region(tag="weights", enable_cpu_backup=True, cpu_backup_backend="mmap"):
    w = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
r1 = rss()
saver.pause("weights")
torch.cuda.synchronize()
r2 = rss()
saver.resume("weights")
torch.cuda.synchronize()
r3 = rss()
print("alloc=%d" % (r1 - r0))
print("pause=%d" % (r2 - r1))
print("resume=%d" % (r3 - r2))
print("kept=%s" % bool((w == 7).all().item()))
"""


@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_a_cpu_backup_shows_in_rss_and_device_memory_does_not(sim, which):
    # torch_memory_saver's own suite (cpu_backup.run_rss) reads VmRSS to see an mmap backup come
    # and go: the device's bytes must not count there, as on a GPU (tms-sim drops its view's pages).
    out = sim.ok(RSS, preload=_preload(sim, which), memory="2GiB")
    n, slack = 256 << 20, 64 << 20
    assert int(out["alloc"]) < slack, out
    assert int(out["pause"]) >= n - slack, out
    assert int(out["resume"]) <= -(n - slack), out
    assert out["kept"] == "True", out


def test_region_memory_has_no_cuda_ipc_handle_as_on_a_gpu(sim):
    # Region memory is made with cuMemCreate, which CUDA IPC cannot export: transfer buffers that
    # another process opens must be allocated outside regions (README). The simulator refuses it
    # as a GPU does, so a consumer that tries finds out here, not on the cluster.
    out = sim.ok(
        """
        import torch, torch_memory_saver
        from torch.multiprocessing.reductions import reduce_tensor
        saver = torch_memory_saver.torch_memory_saver
        with saver.region(tag="weights"):
            w = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        plain = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
        reduce_tensor(plain)
        print("plain_shared=True")
        try:
            reduce_tensor(w)
            print("region_shared=True")
        except RuntimeError as e:
            print("region_shared=False")
        """,
        preload=_preload(sim, "ours"),
    )
    assert out["plain_shared"] == "True"
    assert out["region_shared"] == "False"


@pytest.mark.parametrize("which", ["ours", "upstream"])
def test_disk_backup_round_trips_through_files(sim, which):
    disk = sim.tmp / "disk"
    disk.mkdir()
    out = sim.ok(
        f"""
        import os, torch, torch_memory_saver
        saver = torch_memory_saver.torch_memory_saver
        saver.set_disk_backup_dir({str(disk)!r})
        src = (torch.arange(3 << 20, dtype=torch.int64) * 40503 % 65521).to(torch.float32)
        with saver.region(tag="w", enable_disk_backup=True):
            w = torch.empty(3 << 20, dtype=torch.float32, device="cuda")
        w.copy_(src)
        free0 = torch.cuda.mem_get_info()[0]
        saver.pause("w")
        files = os.listdir({str(disk)!r})
        size = sum(os.path.getsize(os.path.join({str(disk)!r}, f)) for f in files)
        print("freed=%d" % (torch.cuda.mem_get_info()[0] - free0))
        print("on_disk=%d" % size)
        saver.resume("w")
        print("same=%s" % bool(torch.equal(w.cpu(), src)))
        """,
        preload=_preload(sim, which),
    )
    assert int(out["freed"]) >= 12 << 20, out
    assert int(out["on_disk"]) >= 12 << 20, out
    assert out["same"] == "True"
