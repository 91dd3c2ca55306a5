"""Real PyTorch (the package index's CUDA 13.2 build, and a CUDA 12.8 build when the test runs
under one) on tms-sim: the runtime surface it imports, devices, memory, copies, pinned memory,
streams, events and MemPools, with no kernel launched."""

import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch_build

SITE = Path(sysconfig.get_paths()["purelib"])
TORCH_LIBS = [
    "libtorch_cuda.so",
    "libtorch_cuda_linalg.so",
    "libtorch_global_deps.so",
    "libtorch_nvshmem.so",
    "libtorch_cpu.so",
    "libc10_cuda.so",
    "libtorch_python.so",
]


def _dynsym(path):
    out = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_every_runtime_name_torch_imports_is_exported(sim):
    major = torch_build.cuda_major()
    node = f"libcudart.so.{major}"
    imported = set()
    for lib in TORCH_LIBS:
        for line in _dynsym(SITE / "torch" / "lib" / lib):
            fields = line.split()
            if "*UND*" in line and f"({node})" in line:
                imported.add(fields[-1])
    assert len(imported) > 80, f"expected torch to import the CUDA {major} runtime, found {sorted(imported)}"
    # Hidden (12's copy of a name 13 also has) or default: either binds a versioned reference.
    exported = {
        line.split()[-1]
        for line in _dynsym(sim.lib_dir / "libcudart.so.13")
        if f" {node} " in line or f"({node})" in line
    }
    missing = sorted(imported - exported)
    assert not missing, f"torch imports runtime names the simulator does not export: {missing}"


def test_only_the_simulator_serves_cuda(sim):
    # torch's RPATH names NVIDIA's runtime; had it been loaded, any name the simulator lacks
    # would quietly bind to the real one.
    out = sim.ok(
        """
        import torch
        torch.empty(1, device="cuda")
        libs = sorted({l.split()[-1] for l in open("/proc/self/maps")
                       if "libcudart" in l or "libcuda.so" in l or "libtms_sim" in l or "libnccl" in l})
        print("libs=%s" % ",".join(libs))
        """
    )
    libs = [Path(p) for p in out["libs"].split(",")]
    names = {p.name for p in libs}
    assert "libtms_sim.so" in names, libs
    # Beside the simulator only its CUDA 12 and NCCL names may be mapped (tms-sim-lib/cuda12/ and
    # nccl/, loaded by the start-up hook), never a vendor runtime or NVIDIA's NCCL, whether found
    # through torch's RPATH or preloaded by path (torch does that when it sees "libcudart.so" in
    # its maps).
    assert names <= {"libtms_sim.so", "libtms_sim_cuda12.so", "libtms_sim_nccl.so"}, f"vendor libraries were loaded beside the simulator: {libs}"
    ours = sim.lib_dir.resolve()
    for path in libs:
        if path.name == "libtms_sim_cuda12.so":
            assert path.resolve().parent == ours / "cuda12", f"the CUDA 12 name from outside the simulator: {path}"
        if path.name == "libtms_sim_nccl.so":
            assert path.resolve().parent == ours / "nccl", f"the NCCL name from outside the simulator: {path}"


def test_devices_memory_and_copies(sim):
    out = sim.ok(
        """
        import torch
        assert torch.cuda.is_available()
        print("count=%d" % torch.cuda.device_count())
        props = torch.cuda.get_device_properties(1)
        print("major=%d sms=%d total=%d" % (props.major, props.multi_processor_count, props.total_memory))
        free0 = [torch.cuda.mem_get_info(d)[0] for d in range(2)]
        torch.cuda.set_device(1)
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        free1 = [torch.cuda.mem_get_info(d)[0] for d in range(2)]
        print("drop0=%d" % (free0[0] - free1[0]))
        print("drop1=%d" % (free0[1] - free1[1]))
        print("device=%d" % x.device.index)
        src = torch.arange(1 << 20, dtype=torch.int64) * 7 - 3
        y = src.to("cuda:0")
        back = y.cpu()
        print("roundtrip=%s" % bool(torch.equal(back, src)))
        z = torch.zeros(1000, dtype=torch.int32, device="cuda:1")
        print("zeros=%s" % bool(torch.equal(z.cpu(), torch.zeros(1000, dtype=torch.int32))))
        """,
        devices=2,
    )
    assert out["count"] == "2"
    assert out["major"].split()[0] == "9"
    assert int(out["drop0"]) == 0, "allocating on device 1 must not use device 0"
    assert int(out["drop1"]) >= 256 << 20
    assert out["device"] == "1"
    assert out["roundtrip"] == "True"
    assert out["zeros"] == "True"


def test_pinned_memory_streams_events_and_mempools(sim):
    out = sim.ok(
        """
        import torch
        p = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
        print("pinned=%s unpinned=%s" % (p.is_pinned(), torch.empty(16).is_pinned()))
        p.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
        side = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            d = p.to("cuda", non_blocking=True)
            end.record()
        end.synchronize()
        torch.cuda.current_stream().wait_stream(side)
        print("same=%s" % bool(torch.equal(d.cpu(), p)))
        print("elapsed_ok=%s" % (start.elapsed_time(end) >= 0.0))
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        print("pool_segments=%d" % len(pool.snapshot()))
        print("distinct=%s" % (abs(a.data_ptr() - b.data_ptr()) >= 8 << 20))
        reserved = torch.cuda.memory_reserved()
        free_before = torch.cuda.mem_get_info()[0]
        del a, b, pool
        torch.cuda.empty_cache()
        print("released=%d" % (reserved - torch.cuda.memory_reserved()))
        print("device_regained=%d" % (torch.cuda.mem_get_info()[0] - free_before))
        """
    )
    assert out["pinned"].split() == ["True", "unpinned=False"]
    assert out["same"] == "True"
    assert out["elapsed_ok"] == "True"
    assert int(out["pool_segments"]) >= 1
    assert out["distinct"] == "True"
    assert int(out["released"]) >= 16 << 20
    assert int(out["device_regained"]) >= 16 << 20, "empty_cache must give the memory back to the device"


def test_a_kernel_the_simulator_cannot_run_raises(sim):
    proc = sim.python(
        """
        import torch
        x = torch.ones(4, device="cuda") + 1
        torch.cuda.synchronize()
        print("value", x.cpu())
        """,
        extra={"TMS_SIM_TORCH_LAYER": "0"},
    )
    assert proc.returncode != 0, f"a kernel ran on the simulator without the CPU layer:\n{proc.stdout}"
    assert "no kernel image is available" in proc.stderr, proc.stderr


def test_nvml_reports_the_node_as_nvidia_smi_would(sim):
    # torch_memory_saver's own tests measure with torch.cuda.device_memory_used (pynvml), and
    # torch's caching allocator asks NVML for running processes when it reports an OOM.
    out = sim.ok(
        """
        import os, torch, pynvml
        used0 = torch.cuda.device_memory_used(0)
        x = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
        used1 = torch.cuda.device_memory_used(0)
        print("grew=%d" % (used1 - used0))
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        print("total=%d consistent=%s" % (mem.total, mem.total == mem.free + mem.used))
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        mine = [p for p in procs if p.pid == os.getpid()]
        print("listed=%s" % (len(mine) == 1 and mine[0].usedGpuMemory >= 300 << 20))
        print("count=%d" % pynvml.nvmlDeviceGetCount())
        """,
        memory="1GiB",
    )
    assert int(out["grew"]) >= 300 << 20, out
    assert out["total"].split()[0] == str(1 << 30)
    assert out["total"].endswith("consistent=True")
    assert out["listed"] == "True"
    assert out["count"] == "1"


def test_cuda_ipc_hands_a_tensor_to_another_process(sim):
    # How SGLang and slime hand weights over: torch.multiprocessing shares CUDA storage through
    # cudaIpcGetMemHandle / cudaIpcOpenMemHandle (and an interprocess event).
    out = sim.ok(
        """
        import torch, torch.multiprocessing as mp

        def child(q, done):
            t = q.get()
            print("child_sum=%d" % int(t.cpu().to(torch.int64).sum()), flush=True)
            t.copy_(torch.full((t.numel(),), 7, dtype=torch.uint8))
            torch.cuda.synchronize()
            done.put(True)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q, done = ctx.Queue(), ctx.Queue()
            src = (torch.arange(4 << 20) % 251).to(torch.uint8)
            t = src.to("cuda")
            p = ctx.Process(target=child, args=(q, done))
            p.start()
            q.put(t)
            assert done.get(timeout=60)
            p.join(timeout=60)
            print("expected_sum=%d" % int(src.to(torch.int64).sum()))
            print("child_exit=%d" % p.exitcode)
            print("written_back=%s" % bool(torch.equal(t.cpu(), torch.full((4 << 20,), 7, dtype=torch.uint8))))
        """,
        as_file=True,
    )
    assert out["child_exit"] == "0", out
    assert out["child_sum"] == out["expected_sum"], out
    assert out["written_back"] == "True", out


def test_cuda_graph_capture_records_copies_and_replay_runs_them(sim):
    # Without the CPU layer, only what the runtime itself does can be captured: copies and
    # memsets. Capture records them; each replay re-runs them on the captured memory. Builds
    # before 2.10 (the CUDA 12 line) launch a fill kernel for `zeros` and for the generator's
    # seed in capture_begin, so there the layer runs those and the rest is the same.
    kernels_in_capture = torch_build.version() < (2, 10)
    out = sim.ok(
        """
        import torch
        x = torch.arange(4.0).to("cuda")
        y = torch.empty(4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y.copy_(x)
            z = torch.zeros(3, device="cuda")
        x.copy_(torch.arange(4.0))
        g.replay()
        print("replay1=%s" % y.cpu().tolist())
        x.copy_(torch.arange(4.0) * 10)
        g.replay()
        print("replay2=%s" % y.cpu().tolist())
        print("zeros=%s" % z.cpu().tolist())
        try:
            torch.cuda.CUDAGraph().capture_begin()  # on the default stream: refused, as on a GPU
            print("default_stream_capture=accepted")
        except Exception:
            print("default_stream_capture=refused")
        g.reset()
        """,
        extra={} if kernels_in_capture else {"TMS_SIM_TORCH_LAYER": "0"},
    )
    assert out["replay1"] == "[0.0, 1.0, 2.0, 3.0]", out
    assert out["replay2"] == "[0.0, 10.0, 20.0, 30.0]", out
    assert out["zeros"] == "[0.0, 0.0, 0.0]", out
    assert out["default_stream_capture"] == "refused", out
