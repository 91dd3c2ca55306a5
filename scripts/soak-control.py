#!/usr/bin/env python3
"""Control-plane soak: many control requests against one hooked process, its memory sampled.

    scripts/soak-control.sh [--requests N]        (builds, points at the simulator, runs this)

A hooked process (python3 with libtms_hook.so preloaded, on tms-sim) holds two tagged regions,
one with CPU backup. This script sends it N requests over its control socket, one connection
each, in a fixed mix: ping, status, pause/resume of a real tag (contents checked by the process
at the end), pause/resume of a tag nobody allocated under (a fresh name each time: the tag-table
case of issue 15), a malformed line and a request with a duplicate key. It samples the hooked
process's VmRSS every tenth of the run and prints a table, the growth from the first tenth to the
end, and the request rate. Exit: 0 the process answered every request right and its bytes were
intact, 1 otherwise. This is a benchmark (figures), not a pass/fail memory test: the growth is
reported, and docs/perf.md records what it was.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

HOLDER = textwrap.dedent(
    """
    import ctypes, os, sys
    rt = ctypes.CDLL("libcudart.so.13")
    tms = ctypes.CDLL(os.environ["TMS_HOOK"])
    MIB = 1 << 20
    tms.tms_set_interesting_region.argtypes = [ctypes.c_bool]
    tms.tms_set_enable_cpu_backup.argtypes = [ctypes.c_bool]
    def alloc(tag, backup, size):
        tms.tms_set_current_tag(tag.encode())
        tms.tms_set_enable_cpu_backup(backup)
        tms.tms_set_interesting_region(True)
        p = ctypes.c_void_p()
        rc = rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size))
        tms.tms_set_interesting_region(False)
        assert rc == 0, rc
        return p
    weights = alloc("weights", 1, 1 * MIB)
    kv = alloc("kv_cache", 0, 1 * MIB)
    data = bytes(range(256)) * (MIB // 256)
    assert rt.cudaMemcpy(weights, data, ctypes.c_size_t(len(data)), 1) == 0
    print("ready", os.getpid(), flush=True)
    sys.stdin.readline()
    out = ctypes.create_string_buffer(len(data))
    rc = rt.cudaMemcpy(out, weights, ctypes.c_size_t(len(data)), 2)
    print("intact" if rc == 0 and out.raw == data else "broken rc=%d" % rc, flush=True)
    """
)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def ask(path, line, timeout=30.0):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(line.encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--hook", required=True, help="libtms_hook.so")
    args = ap.parse_args()
    control_dir = os.environ.get("TMS_CONTROL_DIR") or f"/tmp/tms-soak-{os.getpid()}"
    env = dict(os.environ, LD_PRELOAD=args.hook, TMS_HOOK=args.hook, TMS_CONTROL="1",
               TMS_CONTROL_DIR=control_dir, TMS_NAME="soak")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    ready = holder.stdout.readline().split()
    if not ready or ready[0] != "ready":
        print("soak: the hooked process did not start", file=sys.stderr)
        return 1
    pid = int(ready[1])
    path = next(os.path.join(control_dir, n) for n in sorted(os.listdir(control_dir))
                if n.startswith(f"tms-{pid}-") and n.endswith(".sock"))
    mix = [
        ('{"v":1,"op":"ping"}', True),
        ('{"v":1,"op":"status"}', True),
        ('{"v":1,"op":"pause","tag":"weights"}', True),
        ('{"v":1,"op":"resume","tag":"weights"}', True),
        (None, False),  # pause/resume of a fresh, never-used tag: unknown_tag, and no growth
        ('{"v":1,"op":"ping"', False),  # malformed
        ('{"v":1,"op":"ping","op":"pause"}', False),  # duplicate key
    ]
    samples = []
    wrong = 0
    start = time.monotonic()
    step = max(1, args.requests // 10)
    for i in range(args.requests):
        line, ok = mix[i % len(mix)]
        if line is None:
            line = json.dumps({"v": 1, "op": "pause" if i % 2 else "resume", "tag": f"soak-{i}"})
        reply = ask(path, line)
        if reply.get("ok") != ok:
            wrong += 1
            if wrong <= 3:
                print(f"soak: unexpected reply to {line}: {reply}", file=sys.stderr)
        if i % step == 0 or i == args.requests - 1:
            samples.append((i + 1, time.monotonic() - start, rss_kib(pid)))
    elapsed = time.monotonic() - start
    cycles = sum(1 for i in range(args.requests) if i % len(mix) == 3)
    # A count that ends between the mix's pause and resume leaves the weights paused, and reading
    # paused memory faults (700) as it should: resume them before the check.
    if args.requests % len(mix) == 3:
        ask(path, '{"v":1,"op":"resume","tag":"weights"}')
    holder.stdin.write("\n")
    holder.stdin.flush()
    verdict = holder.stdout.readline().strip()
    holder.wait(timeout=60)
    print(f"{'requests':>10} {'seconds':>9} {'VmRSS KiB':>10}")
    for n, t, kib in samples:
        print(f"{n:>10} {t:>9.1f} {kib:>10}")
    first, last = samples[min(1, len(samples) - 1)][2], samples[-1][2]
    print(f"soak: {args.requests} requests in {elapsed:.1f} s ({args.requests / elapsed:.0f}/s); "
          f"VmRSS {first} KiB after the first tenth, {last} KiB at the end ({last - first:+d} KiB); "
          f"wrong replies {wrong}; weights after {cycles} pause/resume cycles: {verdict}")
    return 0 if wrong == 0 and verdict == "intact" else 1


if __name__ == "__main__":
    sys.exit(main())
