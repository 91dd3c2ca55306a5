"""Client of the control socket served by every process running with libtms_hook.so
(docs/protocol.md), for orchestrators such as Ray drivers. Standard library only.

    from tms import control
    for p in control.list_processes():
        print(p["pid"], p["status"]["name"])
    control.pause("trainer-rank0", tag="weights")   # target: pid, TMS_NAME or socket path

Command line: ``python -m tms.control list|status|pause|resume [--tag T] [--all | TARGET...] [--json]``
(exit codes as tms-ctl: 0 success, 1 an operation failed, 2 usage or no such target).
"""

import argparse
import concurrent.futures
import json
import os
import socket
import stat
import sys
import time

PROTOCOL_VERSION = 1
MAX_REPLY = 16 * 1024 * 1024


class ControlError(RuntimeError):
    """The hook answered with an error (``code`` is the protocol's, e.g. "out_of_memory");
    ``result`` carries the report of a partly failed pause/resume."""

    def __init__(self, code, message, result=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.result = result


class TargetNotFound(LookupError):
    pass


def socket_dir():
    d = os.environ.get("TMS_CONTROL_DIR")
    if d:
        return d
    x = os.environ.get("XDG_RUNTIME_DIR")
    # As the hook decides (tms_proto::socket_dir): only a private folder of ours.
    if x:
        try:
            st = os.stat(x)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
                return os.path.join(x, "tms")
        except OSError:
            pass
    return f"/tmp/tms-{os.getuid()}"


def _start_time(pid):
    # The main thread's stat line, as the hook and tms-ctl read it (qemu-user rewrites a
    # process's own /proc/PID/stat, not this).
    try:
        try:
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def sockets(directory=None, reap=True):
    """(pid, path) of live processes; sockets of exited processes are removed when ``reap``."""
    directory = directory or socket_dir()
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in sorted(names):
        if not (name.startswith("tms-") and name.endswith(".sock")):
            continue
        try:
            pid, start = (int(x) for x in name[4:-5].split("-", 1))
        except ValueError:
            continue
        path = os.path.join(directory, name)
        if _start_time(pid) == start:
            out.append((pid, path))
        elif reap:
            try:
                os.unlink(path)
            except OSError:
                pass
    return out


def call(path, request, timeout=30.0):
    """Sends one request (a dict); returns the result, raises ControlError on an error reply.
    ``timeout`` bounds the whole exchange, connect to reply: a stopped process costs at most that."""
    req = dict(request)
    req.setdefault("v", PROTOCOL_VERSION)
    data = (json.dumps(req) + "\n").encode()
    deadline = time.monotonic() + timeout

    def remaining():
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"{path} did not answer within {timeout:g}s")
        return left

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(remaining())
        s.connect(path)
        try:
            s.settimeout(remaining())
            s.sendall(data)
        except OSError:
            pass  # a refused peer is answered without being read; the reply is still there
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < MAX_REPLY:
            s.settimeout(remaining())
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise ControlError("no_reply", f"{path} closed the connection without a reply")
    reply = json.loads(buf)
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise ControlError(err.get("code", "unknown"), err.get("message", ""), reply.get("result"))
    return reply["result"]


def status(target, timeout=30.0):
    return call(_one(target, timeout), {"op": "status"}, timeout)


def _ask_all(paths, request, timeout):
    """``call`` on every path at once (each within ``timeout``): one stopped process delays no
    other. Returns [(path, result or exception)] in the order given."""
    if not paths:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(paths))) as pool:
        futures = [pool.submit(call, p, request, timeout) for p in paths]
        out = []
        for path, future in zip(paths, futures):
            try:
                out.append((path, future.result()))
            except (OSError, ControlError, ValueError) as e:
                out.append((path, e))
        return out


def _results(answers):
    """The results, in order; the first failure is raised once every process has been asked."""
    for _, answer in answers:
        if isinstance(answer, Exception):
            raise answer
    return [answer for _, answer in answers]


def pause(target, tag=None, timeout=30.0, force=False):
    """Pauses ``tag`` (None: all) in every process matching ``target``, all at once; returns their
    reports. Raises the first failure after every process was asked. ``force``: also in a process
    that declared a manager (TMS_MANAGED_BY), which refuses otherwise."""
    request = {"op": "pause", "tag": tag, **({"force": True} if force else {})}
    return _results(_ask_all(resolve(target, timeout), request, timeout))


def resume(target, tag=None, timeout=30.0, force=False):
    request = {"op": "resume", "tag": tag, **({"force": True} if force else {})}
    return _results(_ask_all(resolve(target, timeout), request, timeout))


def list_processes(timeout=30.0):
    """[{"pid", "socket", "status" or "error"}] for every hooked process of this user, asked all
    at once, each within ``timeout``."""
    live = sockets()
    answers = _ask_all([path for _, path in live], {"op": "status"}, timeout)
    out = []
    for (pid, path), (_, answer) in zip(live, answers):
        row = {"pid": pid, "socket": path}
        if isinstance(answer, Exception):
            row["error"] = str(answer) or type(answer).__name__
        else:
            row["status"] = answer
        out.append(row)
    return out


def resolve(target, timeout=30.0):
    """Socket paths for a pid, a TMS_NAME (all processes with it), a socket path, or "all"."""
    target = str(target)
    live = sockets()
    if target == "all":
        found = [p for _, p in live]
    elif "/" in target:
        found = [target] if os.path.exists(target) else []
    elif target.isdigit():
        found = [p for pid, p in live if pid == int(target)]
    else:
        # Names are read from the name file each process writes beside its socket; only a
        # process without one (an older hook) is asked, and all of those at once.
        found, unknown = [], []
        for _, p in live:
            name = _name_beside(p)
            if name is None:
                unknown.append(p)
            elif name == target:
                found.append(p)
        for p, answer in _ask_all(unknown, {"op": "status"}, timeout):
            if not isinstance(answer, Exception) and answer.get("name") == target:
                found.append(p)
        found.sort(key=[p for _, p in live].index)
    if not found:
        raise TargetNotFound(f"no hooked process matches {target!r} in {socket_dir()}")
    return found


def _name_beside(path):
    """The TMS_NAME written beside a socket ("" when unnamed), or None without a name file."""
    try:
        with open(os.path.splitext(path)[0] + ".name", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _one(target, timeout):
    return resolve(target, timeout)[0]


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main(argv=None):
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each reply")
    ap = argparse.ArgumentParser(prog="python -m tms.control", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", parents=[common], help="hooked processes and their memory per tag")
    st = sub.add_parser("status", parents=[common], help="one process in detail")
    st.add_argument("target")
    for name in ("pause", "resume"):
        p = sub.add_parser(name, parents=[common], help=f"{name} a tag (default: all) in processes")
        p.add_argument("--tag")
        p.add_argument("--all", action="store_true")
        p.add_argument("targets", nargs="*")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            rows = list_processes(args.timeout)
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for r in rows:
                    s = r.get("status")
                    if not s:
                        print(f"{r['pid']:<8} unreachable: {r.get('error')}")
                        continue
                    tags = ", ".join(
                        f"{t['tag']}: {_human(t['bytes_active'])} active, {_human(t['bytes_paused'])} paused"
                        for t in s["tags"]
                    )
                    print(f"{r['pid']:<8} {s.get('name') or '-':<18} {tags or '(no tracked memory)'}")
            return 1 if any("error" in r for r in rows) else 0
        if args.cmd == "status":
            print(json.dumps(status(args.target, args.timeout), indent=None if not args.json else 2))
            return 0
        if args.all == bool(args.targets):
            ap.error("give TARGETs or --all")
        targets = ["all"] if args.all else args.targets
        failed = False
        out = []
        for t in targets:
            for path in resolve(t, args.timeout):
                try:
                    rep = call(path, {"op": args.cmd, "tag": args.tag}, args.timeout)
                    out.append({"socket": path, "ok": True, "report": rep})
                except ControlError as e:
                    failed = True
                    out.append({"socket": path, "ok": False, "error": str(e), "report": e.result})
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            for r in out:
                rep = r.get("report") or {}
                print(f"{r['socket']}: {'ok' if r['ok'] else r['error']}; {rep.get('allocations_done', 0)} allocations, "
                      f"{_human(rep.get('bytes_done', 0))}")
        return 1 if failed else 0
    except TargetNotFound as e:
        print(f"tms.control: {e}", file=sys.stderr)
        return 2
    except (OSError, ControlError) as e:
        print(f"tms.control: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
