"""Collectives in CUDA graphs on the simulator: an unchanged torch.distributed program captures
`dist.all_reduce` in `torch.cuda.graph` and replays it, as SGLang's decode graphs do with their
tensor-parallel all-reduce (NCCL user guide, "CUDA Graphs": collectives can be captured since
NCCL 2.9, and every rank captures and replays the same sequence)."""

import json

import pytest
from conftest import REAL_DEVICE
from test_nccl import _launch

pytestmark = pytest.mark.skipif(REAL_DEVICE, reason="simulator-only: the real NCCL needs as many GPUs as ranks")

CAPTURE_PROGRAM = r"""
import json, os, torch, torch.distributed as dist
from datetime import timedelta
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=60))
out = {}
x = torch.zeros(1 << 16, device="cuda")
# Warm-up on a side stream, as torch.cuda.graph's documentation asks.
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    dist.all_reduce(x)
    z = x * 2 + 1
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
x.fill_(100.0 + rank)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    dist.all_reduce(x)
    z = x * 2 + 1
torch.cuda.synchronize()
# Capturing performs nothing: the peers' data has not moved yet.
out["after_capture"] = x[:2].tolist()
out["replays"] = []
for i in range(4):
    x.copy_(torch.arange(1 << 16, dtype=torch.float32, device="cuda") * (rank + 1) + i)
    g.replay()
    torch.cuda.synchronize()
    out["replays"].append([z[:3].tolist(), float(z[-1])])
# An eager collective after the replays still pairs with the peer's.
w = torch.full((8,), float(rank + 1), device="cuda")
dist.all_reduce(w)
out["eager_after"] = w[:2].tolist()
del g
torch.cuda.synchronize()
dist.destroy_process_group()
with open(os.environ["OUT"], "w") as f:
    json.dump(out, f)
"""


def test_an_all_reduce_captured_in_a_cuda_graph_replays_with_the_peers(sim):
    procs = _launch(sim, 2, CAPTURE_PROGRAM)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out}"
    n = 1 << 16
    for rank in range(2):
        r = json.loads((sim.tmp / f"rank{rank}.json").read_text())
        # The capture ran nothing: x is still this rank's own.
        assert r["after_capture"] == [100.0 + rank] * 2, r
        for i, (head, last) in enumerate(r["replays"]):
            # Each replay sums both ranks' arange * (rank + 1) + i, then doubles and adds 1.
            want = [2 * (k * 1 + i) + 2 * (k * 2 + i) + 1 for k in range(3)]
            assert head == want, (i, head, want)
            assert last == 2 * ((n - 1) + i) + 2 * ((n - 1) * 2 + i) + 1, (i, last)
        assert r["eager_after"] == [3.0, 3.0], r
