"""Which hooked processes belong to a Ray actor, and which actor arguments tms.ray takes
(tms.ray: ``actors=``). Pure logic: no Ray needed."""

import unittest

from tms.ray import _actor_ids, _owners

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


if __name__ == "__main__":
    unittest.main()
