"""Pause, resume and read the tms status of hooked processes on Ray nodes, from a Ray driver.

For frameworks that already place their trainer and rollout processes with Ray (slime, verl,
Relax): one call reaches every hooked process (every process running with ``libtms_hook.so``
that uses device memory) on the chosen nodes, through a Ray task pinned to each node that asks
the processes' control sockets there (docs/protocol.md; :mod:`tms.control`). Each process answers
for itself, so a per-process report comes back with its node::

    import ray, tms.ray
    ray.init(address="auto")
    tms.ray.pause(tag="kv_cache", target="rollout")           # every node; processes by TMS_NAME
    rows = tms.ray.status(nodes=[node_id])                     # [{"node_id", "node_ip", "pid", ...}]
    tms.ray.resume(tag="kv_cache", target="rollout")
    tms.ray.pause(tag="kv_cache", actors=[engine, ...])       # the processes of these actors

``nodes``: Ray node IDs (hex) or node IP addresses; None is every alive node. ``target``: "all",
a ``TMS_NAME``, or a pid (as :func:`tms.control.resolve`). Each node's processes are found in that
node's control folder: ``$TMS_CONTROL_DIR`` of the node's Ray workers, else the protocol's default
(``$XDG_RUNTIME_DIR/tms`` or ``/tmp/tms-$UID``), the same rule the hooked processes follow.

``actors``, in place of ``nodes``: Ray actor handles (or actor IDs in hex). Each actor's node and
worker pid are read from Ray's GCS actor table (``ray._private.state.actors``: no dashboard
needed; an actor still being created is waited for, up to ``timeout``). An actor's processes are
the hooked processes on its node that are its worker process or, with ``include_children``
(default), whose parent chain reaches it: an SGLang engine runs its model in child processes of
the actor. ``target`` narrows them further. Rows then also carry ``actor_id``; an actor that is
dead, unknown, not alive within ``timeout`` or without any hooked process is one row with
``pid`` None and an ``error`` naming it. A bad ``actors`` raises TypeError or ValueError.

It stands in for reaching each process through an actor method of its own that calls
torch_memory_saver (for example the SGLang engine's ``release_memory_occupation`` /
``resume_memory_occupation``, which colocated frameworks call through their rollout actors with
``ray.get([...])``): the processes need no such method, tags are chosen per call, and a process
that does not answer is named instead of hanging the call (``timeout`` bounds each request).

The nodes need the ``tms`` package importable by their Ray workers (it is installed wherever the
hooked processes import ``torch_memory_saver``). Ray itself is imported only when called.
"""

__all__ = ["status", "pause", "resume", "nodes"]

import os
import time


def nodes():
    """Alive Ray nodes: [{"node_id", "node_ip"}]."""
    import ray

    return [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"]} for n in ray.nodes() if n.get("Alive")]


def _select(chosen):
    alive = nodes()
    if chosen is None:
        return alive
    wanted = {str(c) for c in chosen}
    picked = [n for n in alive if n["node_id"] in wanted or n["node_ip"] in wanted]
    known = {n["node_id"] for n in picked} | {n["node_ip"] for n in picked}
    missing = sorted(wanted - known)
    if missing:
        raise LookupError(f"no alive Ray node with ID or IP {', '.join(missing)} (alive: {alive})")
    return picked


def _row(path, answer):
    from tms import control

    pid = int(os.path.basename(path)[4:].split("-", 1)[0])
    row = {"pid": pid, "name": control._name_beside(path)}
    if isinstance(answer, control.ControlError):
        row["error"] = str(answer)
        if answer.result is not None:
            row["result"] = answer.result
    elif isinstance(answer, Exception):
        row["error"] = f"{type(answer).__name__}: {answer}" if str(answer) else type(answer).__name__
    else:
        row["result"] = answer
    return row


def _on_node(request, target, timeout):
    """Runs on one node: asks every matching hooked process there, all at once."""
    from tms import control

    try:
        paths = control.resolve(target, timeout)
    except control.TargetNotFound:
        return []
    return [_row(path, answer) for path, answer in control._ask_all(paths, request, timeout)]


def _each_node(request, chosen, target, timeout):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_on_node)
    picked = _select(chosen)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["node_id"], soft=False)).remote(
            request, str(target), timeout
        )
        for n in picked
    ]
    out = []
    # Each node's requests end within `timeout`; the margin covers starting the task there.
    for n, ref in zip(picked, refs):
        try:
            rows = ray.get(ref, timeout=timeout + 60)
        except Exception as e:  # noqa: BLE001 - a node that fails is reported, the others still are
            out.append({**n, "pid": None, "name": None, "error": f"the node's task failed: {type(e).__name__}: {e}"})
            continue
        out.extend({**n, **row} for row in rows)
    return out


# --- choosing processes by Ray actor ---------------------------------------------------------

_ACTOR_ID_HEX = 32  # a Ray ActorID is 16 bytes


def _actor_ids(actors):
    """Actor IDs (hex, in the order given, each once) of ``actors``: Ray actor handles or actor IDs
    in hex; one handle or ID alone is taken as a list of one. Raises TypeError or ValueError."""
    if isinstance(actors, (str, bytes)) or hasattr(actors, "_actor_id"):
        actors = [actors]
    try:
        items = list(actors)
    except TypeError:
        raise TypeError(
            f"actors: expected a list of Ray actor handles or actor IDs (hex), got {type(actors).__name__}"
        ) from None
    out = []
    for a in items:
        if isinstance(a, str):
            h = a.strip().lower()
            if len(h) != _ACTOR_ID_HEX or any(c not in "0123456789abcdef" for c in h):
                raise ValueError(f"actors: {a!r} is not a Ray actor ID ({_ACTOR_ID_HEX} hex digits)")
        elif hasattr(a, "_actor_id") and hasattr(a._actor_id, "hex"):
            h = a._actor_id.hex()
        else:
            raise TypeError(f"actors: expected Ray actor handles or actor IDs (hex), got {type(a).__name__}: {a!r}")
        if h not in out:
            out.append(h)
    return out


def _owners(hooked, actor_pids, parent_of, include_children):
    """{hooked pid: the actor pid it belongs to}. A hooked process belongs to the actor whose
    worker it is, or, with ``include_children``, to the nearest actor on its parent chain
    (``parent_of(pid)``: the parent pid, or None when unknown). Processes of no actor are left out."""
    actor_pids = set(actor_pids)
    out = {}
    for pid in hooked:
        p, seen = pid, set()
        while p is not None and p > 1 and p not in seen:
            if p in actor_pids:
                out[pid] = p
                break
            if not include_children:
                break
            seen.add(p)
            p = parent_of(p)
    return out


def _parent(pid):
    """The parent pid of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return int(st[st.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _on_node_for_actors(request, actors, target, include_children, timeout):
    """Runs on one node: asks the hooked processes of ``actors`` ([(actor ID, worker pid)]) there,
    all at once. One row per process with its "actor_id"; one error row per actor with none."""
    from tms import control

    live = control.sockets()
    if str(target) != "all":
        try:
            allowed = set(control.resolve(target, timeout))
        except control.TargetNotFound:
            allowed = set()
        live = [(pid, path) for pid, path in live if path in allowed]
    by_pid = {pid: actor_id for actor_id, pid in actors}
    owner = _owners([pid for pid, _ in live], by_pid, _parent, include_children)
    chosen = [(pid, path) for pid, path in live if pid in owner]
    answers = dict(control._ask_all([path for _, path in chosen], request, timeout))
    rows = []
    for actor_id, actor_pid in actors:
        mine = [{"actor_id": actor_id, **_row(path, answers[path])} for pid, path in chosen if owner[pid] == actor_pid]
        if not mine:
            among = "its worker process" + (" and that process's descendants" if include_children else "")
            also = "" if str(target) == "all" else f" matching {str(target)!r}"
            mine = [{
                "actor_id": actor_id,
                "pid": None,
                "name": None,
                "error": f"actor {actor_id} (pid {actor_pid}): no hooked process{also} among {among} "
                f"in {control.socket_dir()}",
            }]
        rows.extend(mine)
    return rows


def _death(info):
    cause = info.get("DeathCause")
    msg = getattr(getattr(cause, "actor_died_error_context", None), "error_message", "") or ""
    if not msg and cause is not None:
        msg = " ".join(str(cause).split())
    return msg


def _locate(actor_ids, timeout, lookup=None):
    """{actor ID: {"node_id", "node_ip", "pid"} or {"node_id", "node_ip", "error"}} from Ray's GCS
    actor table (``lookup(actor ID)``: that table's entry, {} when unknown; Ray's by default); an
    actor still being created (or restarting) is waited for, up to ``timeout``."""
    if lookup is None:
        from ray._private import state

        def lookup(a):
            return state.actors(actor_id=a)

    out = {}
    pending = list(actor_ids)
    deadline = time.monotonic() + timeout
    while True:
        waiting = []
        for a in pending:
            info = lookup(a)
            if not info:
                out[a] = {"node_id": None, "node_ip": None, "error": f"actor {a}: unknown to Ray (no such actor)"}
                continue
            where = {"node_id": info["Address"]["NodeID"] or None, "node_ip": info["Address"]["IPAddress"] or None}
            what = f"actor {a} ({info.get('ActorClassName') or 'unnamed class'})"
            st = info.get("State")
            if st == "ALIVE" and info.get("Pid"):
                out[a] = {**where, "pid": info["Pid"]}
            elif st == "DEAD":
                why = _death(info)
                out[a] = {**where, "error": f"{what} is dead" + (f": {why}" if why else "")}
            else:
                waiting.append((a, what, st))
        if not waiting:
            return out
        if time.monotonic() >= deadline:
            for a, what, st in waiting:
                out[a] = {"node_id": None, "node_ip": None, "error": f"{what} is not alive after {timeout:g}s ({st})"}
            return out
        pending = [a for a, _, _ in waiting]
        time.sleep(0.1)


def _each_actor(request, actors, target, include_children, timeout):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = _actor_ids(actors)
    if not ids:
        return []
    found = _locate(ids, timeout)
    ips = {n["node_id"]: n["node_ip"] for n in nodes()}
    per_node = {}
    for a in ids:
        f = found[a]
        if "error" not in f and f["node_id"] not in ips:
            f = {**f, "error": f"actor {a}: its node {f['node_id']} is not alive"}
            found[a] = f
        if "error" not in f:
            per_node.setdefault(f["node_id"], []).append((a, f["pid"]))
    task = ray.remote(num_cpus=0, max_retries=0)(_on_node_for_actors)
    refs = {
        node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            request, chosen, str(target), include_children, timeout
        )
        for node, chosen in per_node.items()
    }
    rows_of = {}
    for node, ref in refs.items():
        where = {"node_id": node, "node_ip": ips[node]}
        try:
            rows = ray.get(ref, timeout=timeout + 60)
        except Exception as e:  # noqa: BLE001 - a node that fails is reported, the others still are
            for a, _ in per_node[node]:
                rows_of[a] = [{**where, "actor_id": a, "pid": None, "name": None,
                               "error": f"the node's task failed: {type(e).__name__}: {e}"}]
            continue
        for row in rows:
            rows_of.setdefault(row["actor_id"], []).append({**where, **row})
    out = []
    for a in ids:
        f = found[a]
        if "error" in f:
            out.append({"node_id": f["node_id"], "node_ip": f["node_ip"], "actor_id": a, "pid": None, "name": None,
                        "error": f["error"]})
        else:
            out.extend(rows_of.get(a, []))
    return out


def _choose(request, nodes, actors, target, include_children, timeout):
    if actors is None:
        return _each_node(request, nodes, target, timeout)
    if nodes is not None:
        raise ValueError("give nodes or actors, not both (an actor's node is known)")
    return _each_actor(request, actors, target, include_children, timeout)


def status(nodes=None, target="all", timeout=30.0, actors=None, include_children=True):
    """[{"node_id", "node_ip", "pid", "name", "result" (the process's status) or "error"}]
    (and "actor_id" when chosen by ``actors``)."""
    return _choose({"op": "status"}, nodes, actors, target, include_children, timeout)


def pause(tag=None, nodes=None, target="all", timeout=30.0, actors=None, include_children=True):
    """Pauses ``tag`` (None: every tag) in every matching process; one report per process
    ({"node_id", "node_ip", "pid", "name", "result" or "error"}, and "actor_id" when chosen by
    ``actors``). Never raises for a process or an actor: read "error"."""
    return _choose({"op": "pause", "tag": tag}, nodes, actors, target, include_children, timeout)


def resume(tag=None, nodes=None, target="all", timeout=30.0, actors=None, include_children=True):
    """Resumes ``tag`` (None: every tag), as :func:`pause`."""
    return _choose({"op": "resume", "tag": tag}, nodes, actors, target, include_children, timeout)
