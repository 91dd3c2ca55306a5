"""Worker side of the relax-colocate worker protocol (docs/worker-protocol.md).

Dependency-free (standard library only; it loads no library). It belongs to the runner, not to
the tms package: the runner puts the copy it was built with on the PYTHONPATH of every worker it
starts, and scripts/install.sh installs it as PREFIX/lib/python/relax_worker.py
(docs/worker-protocol.md). A worker started by `relax-colocate run --trainer-cmd ...` or
`--rollout-cmd ...` imports it, allocates its state through `Device` (so the preloaded
libtms_hook.so tracks it under tags) and calls `serve(handlers)`:

    import relax_worker as rw
    dev = rw.Device()
    def init(params): ...
    rw.serve({"init": init, "generate": generate, ...})

Each handler takes the request's params (a dict) and returns a JSON-serializable result; raise
`WorkerError(kind, message)` for a clean error reply (kind "oom" tells the runner it was out of
memory). Any other exception is answered as kind "internal" with its traceback, and the worker
keeps serving.
"""

import ctypes
import json
import os
import socket
import traceback

PROTOCOL = 1


class WorkerError(Exception):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Connection:
    """The JSON-lines connection to the runner (RELAX_WORKER_SOCKET)."""

    def __init__(self, role=None, implementation="python relax_worker", transports=None):
        path = os.environ.get("RELAX_WORKER_SOCKET")
        if not path:
            raise RuntimeError("RELAX_WORKER_SOCKET is not set: workers are started by relax-colocate run")
        self.role = role or os.environ.get("RELAX_ROLE", "")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.file = self.sock.makefile("rwb")
        hello = {"protocol": PROTOCOL, "role": self.role, "pid": os.getpid(), "implementation": implementation}
        if transports:
            hello["transports"] = list(transports)
        self.send({"hello": hello})

    def send(self, obj):
        self.file.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        self.file.flush()

    def __iter__(self):
        for line in self.file:
            yield json.loads(line)


# The methods a weight transport beyond host needs on both roles (docs/worker-protocol.md): the
# hello names those whose methods the handlers all have, so that `run.weight_transport = "auto"`
# picks one only for workers that speak it.
TRANSPORT_METHODS = {
    "broadcast": ("group_id", "group_init", "broadcast_weights", "group_destroy"),
    "ipc": ("ipc_pid", "ipc_export", "ipc_import", "ipc_pack", "ipc_copy", "ipc_close"),
}


def serve(handlers, role=None, implementation="python relax_worker", transports=None):
    """Answers requests until `shutdown` or until the runner closes the connection. `transports`:
    the weight transports beyond host to name in the hello (default: those `handlers` implement)."""
    if transports is None:
        transports = [t for t, methods in TRANSPORT_METHODS.items() if all(m in handlers for m in methods)]
    conn = Connection(role, implementation, transports)
    for msg in conn:
        rid, method, params = msg.get("id"), msg.get("method", ""), msg.get("params") or {}
        if method == "shutdown":
            if "shutdown" in handlers:
                handlers["shutdown"](params)
            conn.send({"id": rid, "result": {}})
            return
        handler = handlers.get(method)
        try:
            if handler is None:
                raise WorkerError("unknown_method", "%s has no method %r" % (conn.role, method))
            conn.send({"id": rid, "result": handler(params)})
        except WorkerError as e:
            conn.send({"id": rid, "error": {"kind": e.kind, "message": e.message}})
        except Exception:  # the runner shows the message; the worker keeps serving
            conn.send({"id": rid, "error": {"kind": "internal", "message": traceback.format_exc()}})


class Device:
    """Device memory through the vendor runtime, resolved in the global scope so the preloaded
    hook's cudaMalloc/aclrtMalloc is the one called (as it is for PyTorch)."""

    H2D, D2H, D2D = 1, 2, 3

    def __init__(self, api=None, index=None):
        self.api = api or os.environ.get("RELAX_DEVICE_API", "cuda")
        index = int(os.environ.get("RELAX_DEVICE", "0")) if index is None else index
        if self.api == "cuda":
            for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
                try:
                    ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    continue
            else:
                raise RuntimeError("libcudart.so.12 not found")
        else:
            ctypes.CDLL("libascendcl.so", mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(None)  # dlsym(RTLD_DEFAULT): the preloaded hook comes first
        for name in ("tms_set_interesting_region", "tms_set_enable_cpu_backup"):
            getattr(self.lib, name).argtypes = [ctypes.c_bool]
        self.lib.tms_set_current_tag.argtypes = [ctypes.c_char_p]
        if self.api == "cuda":
            self._check("cudaSetDevice", self.lib.cudaSetDevice(index))
        else:
            self.lib.aclInit(None)
            self._check("aclrtSetDevice", self.lib.aclrtSetDevice(index))

    def _check(self, what, rc, oom_code=None):
        if rc != 0:
            kind = "oom" if rc == (2 if self.api == "cuda" else 207001) else "device"
            raise WorkerError(kind, "%s returned %d" % (what, rc))

    def malloc(self, nbytes, tag=None, backup=False):
        """Allocates `nbytes`; inside a tms region with `tag` unless tag is None."""
        ptr = ctypes.c_void_p()
        self.lib.tms_set_current_tag((tag or "default").encode())
        self.lib.tms_set_enable_cpu_backup(bool(backup))
        self.lib.tms_set_interesting_region(tag is not None)
        try:
            if self.api == "cuda":
                rc = self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
            else:
                rc = self.lib.aclrtMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0)
        finally:
            self.lib.tms_set_interesting_region(False)
        self._check("malloc(%d)" % nbytes, rc)
        return ptr.value

    def free(self, ptr):
        fn = self.lib.cudaFree if self.api == "cuda" else self.lib.aclrtFree
        self._check("free", fn(ctypes.c_void_p(ptr)))

    def _copy(self, dst, src, n, kind):
        if n == 0:
            return
        if self.api == "cuda":
            rc = self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), kind)
        else:
            rc = self.lib.aclrtMemcpy(ctypes.c_void_p(dst), ctypes.c_size_t(n), ctypes.c_void_p(src),
                                      ctypes.c_size_t(n), kind)
        self._check("memcpy", rc)

    def write(self, dst, data):
        buf = (ctypes.c_char * len(data)).from_buffer_copy(bytes(data))
        self._copy(dst, ctypes.addressof(buf), len(data), self.H2D)

    def read(self, src, n):
        buf = (ctypes.c_char * n)()
        self._copy(ctypes.addressof(buf), src, n, self.D2H)
        return bytes(buf)

    def copy(self, dst, src, n):
        self._copy(dst, src, n, self.D2D)
