"""Scenarios only a real device can answer (the hardware kit runs them; on the simulator they are
skipped, saying why): collective communication through NCCL on region memory."""

import os

import pytest
import torch_build
from conftest import REAL_DEVICE, free_port

# The kit's dry run in CI is "a real device" whose driver is the simulator (TMS_SIM_* set): no NCCL.
ON_SIMULATOR = not REAL_DEVICE or bool(os.environ.get("TMS_SIM_NODE"))
pytestmark = pytest.mark.skipif(ON_SIMULATOR, reason="NCCL needs a real GPU (scripts/gpu-check.sh run)")

MIB = 1 << 20


NCCL_ON_REGION_MEMORY = """
import torch, torch.distributed as dist, torch_memory_saver
saver = torch_memory_saver.torch_memory_saver
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.cuda.set_device(0)
with saver.region(tag="weights", enable_cpu_backup=True):
    t = torch.arange(4 * {mib}, dtype=torch.float32, device="cuda")
ptr = t.data_ptr()
dist.all_reduce(t)
torch.cuda.synchronize()
print("before=%s" % bool(torch.equal(t.cpu(), torch.arange(4 * {mib}, dtype=torch.float32))))
f0 = torch.cuda.mem_get_info()[0]
saver.pause("weights")
print("freed=%d" % (torch.cuda.mem_get_info()[0] - f0))
saver.resume("weights")
dist.all_reduce(t, op=dist.ReduceOp.SUM)
t.mul_(2)
dist.all_reduce(t)
torch.cuda.synchronize()
print("after=%s" % bool(torch.equal(t.cpu(), torch.arange(4 * {mib}, dtype=torch.float32) * 2)))
print("same_ptr=%s" % (t.data_ptr() == ptr))
dist.destroy_process_group()
"""


def test_single_rank_nccl_all_reduce_on_region_memory_across_a_pause(sim, fresh_venv):
    python, site = fresh_venv
    out = sim.ok(
        NCCL_ON_REGION_MEMORY.format(port=free_port(), mib=MIB),
        python=python,
        preload=site / torch_build.upstream_preload_name(),
    )
    assert out["before"] == "True", out
    assert int(out["freed"]) >= 16 * MIB, out
    assert out["after"] == "True", out
    assert out["same_ptr"] == "True", out
