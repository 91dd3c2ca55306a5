"""Which device a worker started by the Ray launcher's node agent opens (relax-colocate/python/ray_bridge.py)."""

import unittest

from ray_bridge import device_view


class DeviceFromRay(unittest.TestCase):
    def test_ray_sets_visibility_so_the_worker_opens_device_0_of_one(self):
        self.assertEqual(device_view("GPU", "5", False, {}), (0, {"CUDA_VISIBLE_DEVICES": "5"}))
        self.assertEqual(device_view("NPU", "3", False, {}), (0, {"ASCEND_RT_VISIBLE_DEVICES": "3"}))

    def test_visibility_left_alone_the_worker_opens_the_id_itself(self):
        noset = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
        self.assertEqual(device_view("NPU", "3", False, noset), (3, {}))
        self.assertEqual(device_view("GPU", "6", False, {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}),
                         (6, {}))
        # The NPU switch does not change a GPU run, and "0" means unset.
        self.assertEqual(device_view("GPU", "2", False, noset), (0, {"CUDA_VISIBLE_DEVICES": "2"}))
        self.assertEqual(device_view("NPU", "1", False, {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "0"}),
                         (0, {"ASCEND_RT_VISIBLE_DEVICES": "1"}))

    def test_the_simulator_numbers_each_nodes_devices_itself(self):
        self.assertEqual(device_view("GPU", "1", True, {}), (1, {}))


if __name__ == "__main__":
    unittest.main()
