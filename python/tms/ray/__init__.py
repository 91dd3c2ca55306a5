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

``nodes``: Ray node IDs (hex) or node IP addresses; None is every alive node. ``target``: "all",
a ``TMS_NAME``, or a pid (as :func:`tms.control.resolve`). Each node's processes are found in that
node's control folder: ``$TMS_CONTROL_DIR`` of the node's Ray workers, else the protocol's default
(``$XDG_RUNTIME_DIR/tms`` or ``/tmp/tms-$UID``), the same rule the hooked processes follow.

It stands in for reaching each process through an actor method of its own that calls
torch_memory_saver (for example the SGLang engine's ``release_memory_occupation`` /
``resume_memory_occupation``, which colocated frameworks call through their rollout actors with
``ray.get([...])``): the processes need no such method, tags are chosen per call, and a process
that does not answer is named instead of hanging the call (``timeout`` bounds each request).

The nodes need the ``tms`` package importable by their Ray workers (it is installed wherever the
hooked processes import ``torch_memory_saver``). Ray itself is imported only when called.

``relax-colocate run --launcher ray`` (docs/ray.md) uses ``tms/ray/bridge.py`` beside this file.
"""

__all__ = ["status", "pause", "resume", "nodes"]


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


def _on_node(request, target, timeout):
    """Runs on one node: asks every matching hooked process there, all at once."""
    import os

    from tms import control

    try:
        paths = control.resolve(target, timeout)
    except control.TargetNotFound:
        return []
    rows = []
    for path, answer in control._ask_all(paths, request, timeout):
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
        rows.append(row)
    return rows


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


def status(nodes=None, target="all", timeout=30.0):
    """[{"node_id", "node_ip", "pid", "name", "result" (the process's status) or "error"}]."""
    return _each_node({"op": "status"}, nodes, target, timeout)


def pause(tag=None, nodes=None, target="all", timeout=30.0):
    """Pauses ``tag`` (None: every tag) in every matching process; one report per process
    ({"node_id", "node_ip", "pid", "name", "result" or "error"}). Never raises for a process:
    read "error"."""
    return _each_node({"op": "pause", "tag": tag}, nodes, target, timeout)


def resume(tag=None, nodes=None, target="all", timeout=30.0):
    """Resumes ``tag`` (None: every tag), as :func:`pause`."""
    return _each_node({"op": "resume", "tag": tag}, nodes, target, timeout)
