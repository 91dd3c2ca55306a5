"""Pause with backup of a fragmented PyTorch pool: only its live blocks against whole segments.

A training step's memory as the caching allocator leaves it before the trainer sleeps: weights and
AdamW's two states in use, the step's gradients and activations freed but cached in the region's
segments. Each round pauses and resumes the region once with live-only backup and once with
whole-segment backup (order alternating), and every live tensor is checked after each resume.
Prints one line per round and the medians.

Run it under the hook, on the simulator or a GPU (docs/perf.md has the command):
    LD_PRELOAD=.../libtms_hook.so python scripts/bench-live-only.py [--layers 16] [--rounds 7]
"""

import argparse
import statistics
import time

import torch

import tms

MIB = 1 << 20


def build(layers, hidden, batch):
    """Weights, AdamW state and a freed step's gradients and activations in region "train"."""
    with tms.region("train", enable_cpu_backup=True):
        params = [torch.nn.Parameter(torch.randn(hidden, 2 * hidden, device="cuda") * 0.02) for _ in range(layers)]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        acts = []
        for p in params:
            acts.append(torch.randn(batch, 2 * hidden, device="cuda"))  # the forward pass keeps these
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)  # gradients freed, as a trainer does before it sleeps
        del acts  # the backward pass is over
    torch.cuda.synchronize()
    return params, opt


def live_tensors(params, opt):
    return params + [s for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.is_cuda]


def region_bytes():
    pools = [pool for key, pool in tms.saver.shared().mem_pools.items() if key[0] == "train"]
    segments = [s for pool in pools for s in torch.cuda.memory_snapshot(pool.id)]
    total = sum(s["total_size"] for s in segments)
    used = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] != "inactive")
    return len(segments), total, used


def cycle(live_only, tensors, want):
    start = time.perf_counter()
    paused = tms.pause_report("train", live_only=live_only)
    pause_s = time.perf_counter() - start
    start = time.perf_counter()
    resumed = tms.resume_report("train")
    resume_s = time.perf_counter() - start
    assert all(torch.equal(t.cpu(), w) for t, w in zip(tensors, want)), "a live tensor changed"
    return {
        "pause_ms": pause_s * 1e3,
        "hook_pause_ms": paused["elapsed_ns"] / 1e6,
        "resume_ms": resume_s * 1e3,
        "copied": paused["backup_bytes"],
        "skipped": paused["backup_bytes_skipped"],
        "restored": resumed["backup_bytes"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    params, opt = build(args.layers, args.hidden, args.batch)
    tensors = live_tensors(params, opt)
    want = [t.cpu() for t in tensors]
    n, total, used = region_bytes()
    print(f"region: {n} segments, {total / MIB:.1f} MiB; in use {used / MIB:.1f} MiB ({100 * used / total:.1f}%)")
    for live_only in (True, False):  # first pauses pin their buffers: not timed
        cycle(live_only, tensors, want)
    rows = {True: [], False: []}
    for r in range(args.rounds):
        for live_only in ((True, False) if r % 2 == 0 else (False, True)):
            row = cycle(live_only, tensors, want)
            rows[live_only].append(row)
            label = "live only" if live_only else "whole"
            print(
                f"round {r} {label:9}: pause {row['pause_ms']:8.1f} ms (hook {row['hook_pause_ms']:8.1f}), "
                f"resume {row['resume_ms']:8.1f} ms, copied {row['copied'] / MIB:7.1f} MiB, "
                f"skipped {row['skipped'] / MIB:7.1f} MiB"
            )
    print("median            pause ms  hook pause ms  resume ms  copied MiB  skipped MiB")
    for live_only in (True, False):
        med = {k: statistics.median(row[k] for row in rows[live_only]) for k in rows[live_only][0]}
        label = "live only" if live_only else "whole segments"
        print(
            f"{label:16} {med['pause_ms']:9.1f} {med['hook_pause_ms']:14.1f} {med['resume_ms']:10.1f} "
            f"{med['copied'] / MIB:11.1f} {med['skipped'] / MIB:12.1f}"
        )


if __name__ == "__main__":
    main()
