"""Which hooked processes belong to a Ray actor, and which actor arguments tms.ray takes
(tms.ray: ``actors=``). Pure logic: no Ray needed."""

import unittest

from tms.ray import _actor_ids, _locate, _owners

# A node's process tree: 100 is the raylet, 200 and 300 two actors' Ray workers; 201 is 200's
# SGLang-like engine child, 202 that child's own child; 301 a child of 300; 400 no actor's.
PARENTS = {200: 100, 201: 200, 202: 201, 300: 100, 301: 300, 400: 100, 100: 1}


class ProcessesOfAnActor(unittest.TestCase):
    def test_children_and_grandchildren_belong_to_the_actor_whose_pid_their_chain_reaches(self):
        got = _owners([200, 201, 202, 301, 400], [200, 300], PARENTS.get, True)
        self.assertEqual(got, {200: 200, 201: 200, 202: 200, 301: 300})

    def test_without_children_only_the_actors_own_process_is_its(self):
        self.assertEqual(_owners([200, 201, 202, 301], [200, 300], PARENTS.get, False), {200: 200})

    def test_only_the_chosen_actors_processes_are_matched(self):
        self.assertEqual(_owners([201, 301, 400], [300], PARENTS.get, True), {301: 300})

    def test_the_nearest_chosen_actor_on_the_chain_owns_a_process(self):
        self.assertEqual(_owners([202], [200, 201], PARENTS.get, True), {202: 201})

    def test_an_unknown_parent_or_a_loop_ends_the_walk(self):
        self.assertEqual(_owners([7], [200], {7: None}.get, True), {})
        self.assertEqual(_owners([7], [200], {7: 8, 8: 7}.get, True), {})


class FakeActorID:
    def __init__(self, h):
        self._h = h

    def hex(self):
        return self._h


class FakeHandle:
    """What tms.ray reads of a ray.actor.ActorHandle: ``_actor_id.hex()``."""

    def __init__(self, h):
        self._actor_id = FakeActorID(h)


A = "95ef7785d9320a4a3d84d99501000000"
B = "0123456789abcdef0123456789abcdef"


class ActorArguments(unittest.TestCase):
    def test_handles_and_hex_ids_in_order_each_once(self):
        self.assertEqual(_actor_ids([FakeHandle(A), B.upper(), A]), [A, B])

    def test_one_handle_or_id_alone_is_a_list_of_one(self):
        self.assertEqual(_actor_ids(FakeHandle(A)), [A])
        self.assertEqual(_actor_ids(B), [B])
        self.assertEqual(_actor_ids(()), [])

    def test_anything_else_is_refused_clearly(self):
        with self.assertRaisesRegex(TypeError, "actor handles"):
            _actor_ids([5])
        with self.assertRaisesRegex(TypeError, "list of Ray actor handles"):
            _actor_ids(5)
        with self.assertRaisesRegex(ValueError, "not a Ray actor ID"):
            _actor_ids(["engine-0"])
        with self.assertRaisesRegex(ValueError, "not a Ray actor ID"):
            _actor_ids([A[:-2]])



class Cause:
    """What tms.ray reads of Ray's death cause: ``actor_died_error_context.error_message``."""

    class actor_died_error_context:  # noqa: N801 - the protobuf field's name
        error_message = "The actor is dead because it was killed by `ray.kill`."


def entry(state, pid=0, node="n1", cause=None):
    """An entry of Ray's GCS actor table as ``ray._private.state.actors`` gives it."""
    return {"ActorClassName": "Engine", "State": state, "Pid": pid, "DeathCause": cause,
            "Address": {"NodeID": node, "IPAddress": "10.0.0.1" if node else ""}}


class WhereAnActorIs(unittest.TestCase):
    def test_alive_actors_dead_ones_and_unknown_ones(self):
        table = {A: entry("ALIVE", 42), B: entry("DEAD", 43, cause=Cause())}
        got = _locate([A, B, "ee" * 16], 1.0, lambda a: table.get(a, {}))
        self.assertEqual(got[A], {"node_id": "n1", "node_ip": "10.0.0.1", "pid": 42})
        self.assertEqual(got[B]["node_id"], "n1")
        self.assertEqual(got[B]["error"], f"actor {B} (Engine) is dead: The actor is dead because it was killed by "
                                          "`ray.kill`.")
        self.assertIn("unknown to Ray", got["ee" * 16]["error"])

    def test_an_actor_being_created_is_waited_for(self):
        states = iter([entry("DEPENDENCIES_UNREADY", node=""), entry("PENDING_CREATION", node="")])
        got = _locate([A], 5.0, lambda a: next(states, entry("ALIVE", 7)))
        self.assertEqual(got[A]["pid"], 7)

    def test_one_never_alive_is_named_once_the_timeout_has_passed(self):
        got = _locate([A], 0.3, lambda a: entry("PENDING_CREATION", node=""))
        self.assertEqual(got[A]["error"], f"actor {A} (Engine) is not alive after 0.3s (PENDING_CREATION)")
        self.assertIsNone(got[A]["node_id"])


if __name__ == "__main__":
    unittest.main()
