"""Many pause/resume cycles of a churning PyTorch pool with every restore verified.

Each cycle is a training step's memory traffic in region "train" (with a CPU backup): the
optimizer updates the weights, a batch of activations of a size that changes from cycle to cycle
is made and freed (the caching allocator splits, reuses and grows its segments), then the region
is paused and resumed with restore verification on (TMS_VERIFY_RESTORE: each backup checksummed
at the pause, every restored byte read back and compared at the resume) and every live tensor is
compared with its copy taken before the pause. Every batch size runs once before cycle 1, so that
the caching allocator holds the segments the run needs; free device memory is read after the
first cycle's resume and after the last (and what the device holds beyond PyTorch's pool); a pause or resume that fails, a checksum mismatch (TMS_ERR_CORRUPT) or
a changed tensor stops the run with its cycle number.

Run it under the hook, on the simulator or a GPU (docs/perf.md has the command and results):
    TMS_VERIFY_RESTORE=1 LD_PRELOAD=.../libtms_hook.so python scripts/soak-verify.py [--cycles 1000]
Prints a progress line every 100 cycles and a JSON summary last; exit 0 when every cycle matched
and free memory came back within --tolerance-mib, 1 otherwise.
"""

import argparse
import json
import os
import sys
import time

import torch

import tms

MIB = 1 << 20


def build(layers, hidden):
    with tms.region("train", enable_cpu_backup=True):
        params = [torch.nn.Parameter(torch.randn(hidden, hidden, device="cuda") * 0.02) for _ in range(layers)]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    return params, opt


def step(params, opt, hidden, batch):
    """One training step in the region: activations of `batch` rows made and freed."""
    with tms.region("train", enable_cpu_backup=True):
        x = torch.randn(batch, hidden, device="cuda")
        acts = []
        for p in params:
            x = torch.tanh(x @ p)
            acts.append(x)
        loss = x.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del acts, x, loss
    torch.cuda.synchronize()


def batch_rows(cycle):
    """64 to 1,024 rows, in an order that makes segments split, grow and be reused as real steps
    do."""
    return 64 * (1 + (cycle * 7) % 16)


def live(params, opt):
    return params + [s for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.is_cuda]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tolerance-mib", type=float, default=1.0)
    args = ap.parse_args()
    if os.environ.get("TMS_VERIFY_RESTORE", "0").strip() in ("", "0"):
        tms.set_verify_restore(True)
    torch.manual_seed(0)
    params, opt = build(args.layers, args.hidden)
    # Every batch size once first, so that the caching allocator holds the segments the run needs
    # before cycle 1 is measured: what it caches is PyTorch's, not a leak.
    for k in range(16):
        step(params, opt, args.hidden, batch_rows(k))
    free_first = outside_first = None
    copied = skipped = 0
    start = time.monotonic()
    for cycle in range(1, args.cycles + 1):
        # Batches of 64 to 1,024 rows: segments split, grow and are reused as real steps do.
        step(params, opt, args.hidden, batch_rows(cycle))
        tensors = live(params, opt)
        want = [t.detach().cpu() for t in tensors]
        paused = tms.pause_report("train")
        resumed = tms.resume_report("train")
        for name, r in (("pause", paused), ("resume", resumed)):
            if r.get("error"):
                print(json.dumps({"cycle": cycle, name: r}), file=sys.stderr)
                return 1
        changed = [i for i, (t, w) in enumerate(zip(tensors, want)) if not torch.equal(t.detach().cpu(), w)]
        if changed:
            print(json.dumps({"cycle": cycle, "changed_tensors": changed}), file=sys.stderr)
            return 1
        copied += paused["backup_bytes"]
        skipped += paused.get("backup_bytes_skipped", 0)
        free, total = torch.cuda.mem_get_info()
        # What the device holds beyond PyTorch's pool: the hook's and the driver's own.
        outside = total - free - torch.cuda.memory_reserved()
        if cycle == 1:
            free_first, outside_first = free, outside
        if cycle % 100 == 0:
            print(f"cycle {cycle}: free {free / MIB:.1f} MiB (cycle 1: {free_first / MIB:.1f}), "
                  f"{time.monotonic() - start:.1f} s", flush=True)
    drift = (free - free_first) / MIB
    summary = {
        "cycles": args.cycles,
        "mismatches": 0,
        "free_mib_after_cycle_1": free_first / MIB,
        "free_mib_after_last_cycle": free / MIB,
        "free_drift_mib": drift,
        "outside_pool_drift_mib": (outside - outside_first) / MIB,
        "pool_reserved_mib": torch.cuda.memory_reserved() / MIB,
        "backup_mib_copied": copied / MIB,
        "backup_mib_skipped_dead": skipped / MIB,
        "seconds": time.monotonic() - start,
        "device_total_mib": total / MIB,
    }
    print(json.dumps(summary))
    return 0 if abs(drift) <= args.tolerance_mib else 1


if __name__ == "__main__":
    sys.exit(main())
