"""The Ray side of `relax-colocate run --launcher ray` (docs/ray.md).

The runner carries this file in its binary (it is the runner's, not the tms package's), writes it
into the run's temp folder and starts it as one child process: ``python ray_bridge.py SPEC.json``. It places the
run on Ray (a placement group of one bundle per device) and starts one agent actor per node; each
agent starts that node's workers with the environment the runner computed and carries their
worker-protocol lines and tms control requests over Ray's own channels. Towards the runner the
bridge looks like the local launcher's workers: it connects to the runner's per-worker Unix
listener as the worker would, and serves a per-worker control socket, so the runner's one phase
loop drives both launchers. No network port is opened here beyond Ray's own.

Ends (every worker on every node stopped, a local cluster shut down) when the runner closes its
standard input, on SIGTERM, or when Ray fails. A worker that exits is reported to the runner by
a file ``<exit_dir>/<name>.exit`` naming node, pid and how it ended, written before that worker's
connection is closed.

Run as ``__main__`` on purpose: Ray ships the agent class by value, so nodes need Ray, not this
file.
"""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

MAX_LINE = 256 << 20
CONTROL_MAX = 64 << 10


def log(msg):
    print(f"ray-bridge: {msg}", file=sys.stderr, flush=True)


class ConfigError(Exception):
    """This configuration cannot run (the runner exits 2 with the message)."""


def version_mismatch(error, python):
    """Our message for Ray's refusal of a driver whose versions differ from the cluster's, or None
    for any other error. Ray checks at connect (ray.init: Node.check_version_info): it reads the
    Ray and Python versions the head stored in the GCS (key CLUSTER_METADATA) and raises a
    RuntimeError "Version mismatch: The cluster was started with: Ray: X Python: Y ... This
    process on ... was started with: Ray: A Python: B" (ray/_private/utils.py,
    check_version_info; the Python check is to the patch level unless
    RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor)."""
    text = str(error)
    if "Version mismatch" not in text:
        return None
    found = re.findall(r"Ray:\s*(\S+)\s+Python:\s*(\S+)", text)
    fix = ("use a Python that has the cluster's Ray (and Python) version: --set run.ray_python=/path/to/python, "
           "or activate that environment (docs/ray.md, \"Which Ray\")")
    if len(found) < 2:
        one_line = " ".join(text.split())
        return f"Ray refused to join the cluster from {python}: {one_line}; {fix}"
    (cluster_ray, cluster_py), (own_ray, own_py) = found[0], found[1]
    return (f"the Ray cluster runs Ray {cluster_ray} on Python {cluster_py}, and this run's Python for Ray "
            f"({python}) has Ray {own_ray} on Python {own_py}: Ray joins a cluster only from its own Ray and "
            f"Python versions; {fix}")


def describe_exit(code):
    if code is None:
        return "is still running"
    if code < 0:
        names = {signal.SIGKILL: "SIGKILL: out of host memory or killed", signal.SIGABRT: "SIGABRT: it aborted",
                 signal.SIGSEGV: "SIGSEGV: it crashed", signal.SIGTERM: "SIGTERM"}
        return f"was killed by signal {-code} ({names.get(-code, 'signal')})"
    return f"exited with status {code}"


class Agent:
    """One per node: starts that node's workers and relays their lines and control requests."""

    def __init__(self, node, workers, bucket):
        self.node = node
        self.bucket = bucket
        self.made = []
        self.workers = {w["name"]: w for w in workers}
        self.procs = {}
        self.conns = {}
        self.queues = {}
        self.pids = {}
        self.listeners = {}

    def start(self):
        # The weights cross from trainer to rollout through a host file at one path; each device's
        # pair is on one node, so a node without the runner's file gets its own at that path.
        path = self.bucket["path"]
        if not os.path.exists(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.bucket["bytes"])
            finally:
                os.close(fd)
            self.made.append(path)
        for name, w in self.workers.items():
            for d in (os.path.dirname(w["node_socket"]), w["ctl_dir"]):
                if not os.path.isdir(d):
                    os.makedirs(d, mode=0o700)
                    self.made.append(d)
            os.makedirs(os.path.dirname(w["log"]), exist_ok=True)
            try:
                os.unlink(w["node_socket"])
            except FileNotFoundError:
                pass
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lst.bind(w["node_socket"])
            lst.listen(1)
            self.listeners[name] = lst
            env = dict(os.environ)
            # Ray may set device visibility for its actors (empty for one that asks for no GPU, as
            # the agent does); that is not the workers' view of the node.
            for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
                if env.get(k) == "":
                    env.pop(k)
            env.update(w["env"])
            out = open(w["log"], "ab")
            self.procs[name] = subprocess.Popen(w["argv"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=out, start_new_session=True)
            out.close()
        return {"node": self.node, "host": socket.gethostname(),
                "pids": {n: p.pid for n, p in self.procs.items()}}

    def _where(self, name):
        p = self.procs.get(name)
        return f"on {self.node} (pid {self.pids.get(name) or (p.pid if p else '?')})"

    def _exit_cause(self, name, wait_s):
        p = self.procs[name]
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return f"closed its connection {self._where(name)}"
        return f"{describe_exit(p.returncode)} {self._where(name)}"

    def accept(self, name, timeout_s):
        """Waits for worker `name` to connect; None when it did, else why not."""
        lst = self.listeners[name]
        lst.settimeout(0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                c, _ = lst.accept()
                break
            except socket.timeout:
                if self.procs[name].poll() is not None:
                    return f"{describe_exit(self.procs[name].returncode)} before connecting {self._where(name)}"
                if time.monotonic() > deadline:
                    return f"did not connect within {timeout_s}s {self._where(name)}"
        lst.close()
        c.settimeout(None)
        self.conns[name] = c
        q = self.queues[name] = queue.Queue()
        threading.Thread(target=self._read, args=(name, c, q), daemon=True).start()
        return None

    def _read(self, name, c, q):
        # One reader per worker, so waiting for a line never changes the socket's blocking mode
        # under a concurrent send.
        f = c.makefile("rb")
        while True:
            try:
                line = f.readline(MAX_LINE + 1)
            except OSError as e:
                q.put(("closed", f"connection failed ({e}) {self._where(name)}"))
                return
            if not line:
                q.put(("closed", self._exit_cause(name, 2.0)))
                return
            if name not in self.pids:
                try:
                    self.pids[name] = int(json.loads(line)["hello"]["pid"])
                except (ValueError, KeyError, TypeError):
                    pass
            q.put(("line", line))

    def recv(self, name, wait_s):
        """The worker's next line: ("line", bytes), ("idle",) after `wait_s` without one, or
        ("closed", cause) once it closed its connection."""
        try:
            return self.queues[name].get(timeout=wait_s)
        except queue.Empty:
            return ("idle",)

    def send(self, name, line):
        try:
            self.conns[name].sendall(line)
            return None
        except OSError as e:
            return f"cannot write to the worker ({e}) {self._where(name)}"

    def control(self, name, request, timeout_s):
        """Carries one tms control request to the worker's own control socket on this node."""
        pid = self.pids.get(name) or self.procs[name].pid
        folder = self.workers[name]["ctl_dir"]
        try:
            found = [f for f in os.listdir(folder) if f.startswith(f"tms-{pid}-") and f.endswith(".sock")]
        except OSError:
            found = []
        if not found:
            msg = f"no tms control socket for pid {pid} in {folder} {self._where(name)}"
            return json.dumps({"v": 1, "ok": False, "error": {"code": "internal", "message": msg}}).encode() + b"\n"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect(os.path.join(folder, found[0]))
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
            return b"".join(chunks)
        except (socket.timeout, TimeoutError):
            return b""
        except OSError as e:
            # A worker that died under the request resets it: say that, not the socket error.
            p = self.procs[name]
            try:
                p.wait(timeout=2.0)
                msg = f"{name} {describe_exit(p.returncode)} {self._where(name)}"
            except subprocess.TimeoutExpired:
                msg = f"its control socket failed ({e}) {self._where(name)}"
            return json.dumps({"v": 1, "ok": False, "error": {"code": "internal", "message": msg}}).encode() + b"\n"
        finally:
            s.close()

    def kill(self, name, sig=signal.SIGKILL):
        """Signals worker `name`'s process group (for failure tests)."""
        os.killpg(self.procs[name].pid, sig)

    def stop_all(self, grace_s):
        for p in self.procs.values():
            if p.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    try:
                        os.killpg(p.pid, sig)
                    except OSError:
                        pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass  # in the kernel (D state): reported as still running
        for w in self.workers.values():
            for f in os.listdir(w["ctl_dir"]) if os.path.isdir(w["ctl_dir"]) else []:
                try:
                    os.unlink(os.path.join(w["ctl_dir"], f))
                except OSError:
                    pass
        # What this agent made on its node (on a local cluster, inside the runner's own folder).
        for path in reversed(self.made):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.made = []
        return {n: describe_exit(p.returncode) for n, p in self.procs.items()}


def end_leftovers(mark, run_id, grace_s=3.0, settle_s=2.0):
    """Ends the processes of this run's local cluster still alive after Ray's shutdown."""
    me = os.getpid()
    needle = f"{mark}={run_id}".encode() + b"\0"

    def ours():
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read() + b"\0":
                        found.append(int(entry))
            except OSError:
                pass
        return found

    def end(pids):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + grace_s
            while pids and time.monotonic() < deadline:
                time.sleep(0.1)
                pids = ours()
            if not pids:
                break
        return pids

    left = end(ours())
    # A dying node's raylet can still be starting one of its agents (a CI run found a
    # DashboardAgent appear after the first scan): watch a little longer and end latecomers.
    quiet_until = time.monotonic() + settle_s
    while not left and time.monotonic() < quiet_until:
        time.sleep(0.2)
        late = ours()
        if late:
            left = end(late)
            quiet_until = time.monotonic() + settle_s
    return left


def connect(spec):
    """Connects to Ray; returns the local cluster to shut down at the end, or None."""
    import ray

    address = spec["ray_address"]
    if address != "local":
        try:
            ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False)
        except RuntimeError as e:
            msg = version_mismatch(e, spec.get("python") or sys.executable)
            if msg:
                raise ConfigError(msg) from e
            raise
        return None
    from ray.cluster_utils import Cluster

    def node_args(k):
        args = {"num_cpus": 1, "include_dashboard": False} if k == 0 else {"num_cpus": 1}
        if spec["resource"] == "GPU":
            args["num_gpus"] = spec["devices"]
        else:
            args["resources"] = {spec["resource"]: spec["devices"]}
        return args

    # Every process of the throwaway cluster inherits this, so the ones Ray's shutdown misses (a
    # node's dashboard and runtime-env agents, slow to notice their raylet's end on a loaded
    # machine) can be found and ended: the cluster is ours alone.
    os.environ[spec["cluster_mark"]] = spec["run_id"]
    cluster = Cluster(initialize_head=True, head_node_args=node_args(0))
    for k in range(1, spec["nodes"]):
        cluster.add_node(**node_args(k))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
    return cluster


def device_view(resource, accelerator_id, simulated, environ):
    """The device a worker opens, and the variables it needs, from the id Ray gave its device's
    bundle. Ray makes only that device visible (CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES)
    to what runs in the bundle, unless the cluster asks it not to (RAY_EXPERIMENTAL_NOSET_...,
    as Ascend users often set); the workers are started by the node's agent, so they are told
    here as Ray would tell an actor: device 0 of one visible device, or the id itself when
    visibility is left alone. The simulator numbers each node's devices from 0 and has no
    visibility variables: its device is the id."""
    accelerator_id = int(accelerator_id)
    if simulated:
        return accelerator_id, {}
    var = "CUDA_VISIBLE_DEVICES" if resource == "GPU" else "ASCEND_RT_VISIBLE_DEVICES"
    if environ.get("RAY_EXPERIMENTAL_NOSET_" + var, "") not in ("", "0"):
        return accelerator_id, {}
    return 0, {var: str(accelerator_id)}


class Slot:
    """Holds one device bundle for the run and says which device Ray gave it."""

    def ids(self):
        import ray

        return ray.get_runtime_context().get_accelerator_ids()


def place(spec):
    """A placement group of one bundle per device; returns the node id for each run node."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    nodes, devices = spec["nodes"], spec["devices"]
    pg = placement_group([{spec["resource"]: 1} for _ in range(nodes * devices)], strategy="PACK")
    if not pg.wait(spec["start_timeout_s"]):
        have = ray.cluster_resources().get(spec["resource"], 0)
        raise RuntimeError(f"Ray could not place {nodes * devices} bundles of {{{spec['resource']!r}: 1}} "
                           f"within {spec['start_timeout_s']}s (the cluster has {have:g})")
    by_node = {}
    for b, node_id in sorted(placement_group_table(pg)["bundles_to_node_id"].items()):
        by_node.setdefault(node_id, []).append(b)
    shape = sorted(len(v) for v in by_node.values())
    if shape != [devices] * nodes:
        raise RuntimeError(f"Ray placed the {nodes * devices} device bundles as {shape} per node, not "
                           f"{devices} on each of {nodes} nodes: give every node exactly {devices} {spec['resource']}")
    return pg, by_node


def accelerator_ids(spec, pg, by_node):
    """The id Ray assigned to every bundle, in node order: {node_id: [id of its 1st device, ...]}.
    The slot actors that ask stay up for the run, holding the devices."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = spec["resource"]
    need = {"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}}
    slot = ray.remote(num_cpus=0, **need)(Slot)
    slots = {b: slot.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=b)).remote() for bs in by_node.values() for b in bs}
    got = dict(zip(slots, ray.get([s.ids.remote() for s in slots.values()], timeout=spec["start_timeout_s"])))
    ids = {}
    for node_id, bundles in by_node.items():
        ids[node_id] = []
        for b in sorted(bundles):
            mine = got[b].get(resource) or []
            if len(mine) != 1:
                raise RuntimeError(f"Ray gave bundle {b} the {resource} ids {mine}, not one")
            ids[node_id].append(mine[0])
    return slots, ids


class Bridge:
    def __init__(self, spec):
        self.spec = spec
        self.stopping = threading.Event()
        self.agents = {}

    def run(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = self.spec
        t0 = time.monotonic()
        self.cluster = connect(spec)
        log(f"connected to Ray in {time.monotonic() - t0:.1f}s")
        self.pg, by_node = place(spec)
        node_ids = list(by_node)
        self.slots, ids = accelerator_ids(spec, self.pg, by_node)
        placement = {}
        for w in spec["workers"]:
            k = int(w["node"][len("node"):])
            accelerator_id = ids[node_ids[k]][w["device"]]
            device, env = device_view(spec["resource"], accelerator_id, spec["simulated"], os.environ)
            w["env"].update(env)
            w["env"]["RELAX_DEVICE"] = str(device)
            placement[w["name"]] = {"node": w["node"], "device": device, "accelerator_id": str(accelerator_id),
                                    "visible": env}
        with open(spec["placement_file"] + ".tmp", "w") as f:
            json.dump(placement, f)
        os.replace(spec["placement_file"] + ".tmp", spec["placement_file"])
        log(f"devices from Ray: {json.dumps(placement)}")
        actor = ray.remote(num_cpus=0, max_concurrency=1000)(Agent)
        for k, node_id in enumerate(node_ids):
            node = f"node{k}"
            ws = [w for w in spec["workers"] if w["node"] == node]
            self.agents[node] = actor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
                name=f"tms-agent-{spec['run_id']}-{node}").remote(node, ws, spec["bucket"])
        started = ray.get([a.start.remote() for a in self.agents.values()], timeout=spec["start_timeout_s"])
        for s in started:
            log(f"{s['node']} on host {s['host']}: workers {s['pids']}")
        for w in spec["workers"]:
            threading.Thread(target=self.worker, args=(w,), daemon=True).start()

    def agent_of(self, w):
        return self.agents[w["node"]]

    def report_exit(self, w, cause):
        path = os.path.join(self.spec["exit_dir"], w["name"] + ".exit")
        with open(path + ".tmp", "w") as f:
            f.write(cause)
        os.replace(path + ".tmp", path)

    def worker(self, w):
        import ray

        agent = self.agent_of(w)
        try:
            why = ray.get(agent.accept.remote(w["name"], self.spec["start_timeout_s"]))
        except ray.exceptions.RayError as e:
            why = f"the agent of {w['node']} failed: {e}"
        if why:
            self.report_exit(w, why)
            return
        runner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        runner.connect(w["runner_socket"])
        threading.Thread(target=self.serve_control, args=(w,), daemon=True).start()
        threading.Thread(target=self.up, args=(w, runner), daemon=True).start()
        self.down(w, runner)

    def down(self, w, runner):
        """Worker -> runner: its lines; its end, as an exit file and a closed connection."""
        import ray

        agent = self.agent_of(w)
        cause = None
        while not self.stopping.is_set():
            try:
                got = ray.get(agent.recv.remote(w["name"], 1.0), timeout=60)
            except ray.exceptions.GetTimeoutError:
                cause = f"the agent of {w['node']} did not answer within 60s (is the node alive?)"
                break
            except ray.exceptions.RayError as e:
                cause = f"the agent of {w['node']} died ({type(e).__name__}): the node or its Ray worker is gone"
                break
            if got[0] == "line":
                try:
                    runner.sendall(got[1])
                except OSError:
                    return
            elif got[0] == "closed":
                cause = got[1]
                break
        if cause:
            self.report_exit(w, cause)
        try:
            runner.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        runner.close()

    def up(self, w, runner):
        """Runner -> worker: its requests, in order."""
        import ray

        agent = self.agent_of(w)
        f = runner.makefile("rb")
        while True:
            try:
                line = f.readline(MAX_LINE + 1)
            except OSError:
                return
            if not line:
                return
            try:
                if ray.get(agent.send.remote(w["name"], line)):
                    return
            except ray.exceptions.RayError:
                return

    def serve_control(self, w):
        path = w["control_socket"]
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        os.chmod(path, 0o600)
        srv.listen(64)
        while not self.stopping.is_set():
            c, _ = srv.accept()
            threading.Thread(target=self.control_one, args=(w, c), daemon=True).start()

    def control_one(self, w, c):
        import ray

        try:
            c.settimeout(5)
            buf = b""
            while not buf.endswith(b"\n") and len(buf) <= CONTROL_MAX:
                b = c.recv(65536)
                if not b:
                    break
                buf += b
            timeout = self.spec["phase_timeout_s"]
            reply = ray.get(self.agent_of(w).control.remote(w["name"], buf, timeout), timeout=timeout + 5)
            # An empty reply is the worker not answering in time: close without one, as a stopped
            # process would, and the runner names it hung.
            if reply:
                c.sendall(reply)
        except Exception as e:  # noqa: BLE001 - any failure is a failed request, never the bridge's end
            # Ray's errors carry the remote traceback; its last line says what went wrong.
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            msg = f"the Ray relay failed for {w['name']} on {w['node']}: {last}"
            try:
                c.sendall(json.dumps({"v": 1, "ok": False, "error": {"code": "internal", "message": msg}}).encode()
                          + b"\n")
            except OSError:
                pass
        finally:
            c.close()

    def shutdown(self, failed):
        import ray

        self.stopping.set()
        if self.agents:
            try:
                done = ray.get([a.stop_all.remote(3.0) for a in self.agents.values()], timeout=30)
                log(f"workers stopped: {done}")
            except Exception as e:  # noqa: BLE001 - go on to shut Ray down whatever happened
                log(f"stopping the workers failed: {e}")
        try:
            ray.shutdown()
        except Exception as e:  # noqa: BLE001
            log(f"ray.shutdown failed: {e}")
        if getattr(self, "cluster", None) is not None:
            session = None
            try:
                session = self.cluster.head_node.get_session_dir_path()
                self.cluster.shutdown()
            except Exception as e:  # noqa: BLE001
                log(f"shutting the local cluster down failed: {e}")
            left = end_leftovers(self.spec["cluster_mark"], self.spec["run_id"])
            if left:
                log(f"processes of the local cluster that would not end: {left}")
            # Ray keeps every session's logs in its temp folder; a throwaway cluster's are kept
            # only when something failed, to be read.
            if session and not failed:
                shutil.rmtree(session, ignore_errors=True)
            elif session:
                log(f"Ray's logs of this cluster: {session}")
        log("done")


def main():
    if len(sys.argv) != 2:
        print("usage: ray_bridge.py SPEC.json", file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        import ray  # noqa: F401
    except ImportError as e:
        log(f"cannot import ray ({e}): create the Ray environment with scripts/ray-env.sh")
        return 3
    bridge = Bridge(spec)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch_stdin():
        # The runner holds our stdin open for as long as it wants the workers: EOF (its close, or
        # its death) is the end.
        # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader holds its lock,
        # and the interpreter aborts (SIGABRT) when it finalizes on the way out of a failed run.
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    code = 0
    try:
        bridge.run()
        log("ready")
        while not done.wait(0.5):
            pass
    except ConfigError as e:
        log(f"failed: {e}")
        with open(spec["config_error_file"] + ".tmp", "w") as f:
            f.write(str(e))
        os.replace(spec["config_error_file"] + ".tmp", spec["config_error_file"])
        code = 2
    except Exception as e:  # noqa: BLE001 - reported to the runner through the log, then cleaned up
        log(f"failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        bridge.shutdown(failed=code != 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
