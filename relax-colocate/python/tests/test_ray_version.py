"""The Ray launcher's bridge turns Ray's refusal of another version into a message naming both."""

import unittest

from ray_bridge import version_mismatch

# As ray.init raises it (ray/_private/utils.py, check_version_info, Ray 2.58.1), here with the
# Ray version of the joining process replaced.
RAY_TEXT = (
    "Version mismatch: The cluster was started with:\n"
    "    Ray: 2.58.1\n"
    "    Python: 3.11.7\n"
    "This process on node 10.0.0.5 was started with:\n"
    "    Ray: 2.40.0\n"
    "    Python: 3.10.13\n"
)


class VersionMismatch(unittest.TestCase):
    def test_both_versions_of_ray_and_python_and_the_fix(self):
        msg = version_mismatch(RuntimeError(RAY_TEXT), "/opt/py/bin/python")
        self.assertIn("the Ray cluster runs Ray 2.58.1 on Python 3.11.7", msg)
        self.assertIn("(/opt/py/bin/python) has Ray 2.40.0 on Python 3.10.13", msg)
        self.assertIn("--set run.ray_python=", msg)
        self.assertNotIn("\n", msg)

    def test_other_errors_are_not_taken_for_a_mismatch_and_an_unknown_layout_is_kept_whole(self):
        self.assertIsNone(version_mismatch(RuntimeError("Could not find any running Ray instance"), "py"))
        msg = version_mismatch(RuntimeError("Version mismatch: cluster 3.0, driver 2.9"), "py")
        self.assertIn("Version mismatch: cluster 3.0, driver 2.9", msg)
        self.assertIn("--set run.ray_python=", msg)


if __name__ == "__main__":
    unittest.main()
