"""scripts/torch_worker.py charges modelled compute and cuts the weights stream into buckets as
relax-colocate does: it reads the stage figures from relax_compute_model.json beside
relax_worker.py (the runner's, the file relax-colocate embeds), and its formulas give the golden
figures of compute_model_cases.json, which src/run/compute.rs holds relax-colocate's to.

torch_worker.py imports torch, which this Python need not have; the functions under test do not
use it, so they alone are taken from its source and run."""

import ast
import json
import math
import os
import unittest
from pathlib import Path

import relax_worker

HERE = Path(__file__).resolve().parent
TORCH_WORKER = HERE.parents[2] / "scripts" / "torch_worker.py"
CASES = json.loads((HERE / "compute_model_cases.json").read_text())
# What the modelled compute and the bucket layout are made of in torch_worker.py, torch-free.
PURE = {"load_figures", "FIGURES", "token_scale", "serve_scale", "modelled_s", "stage_s", "decode_s",
        "Admission", "paced_decode", "bucket_count", "layout_pieces"}


def defined_names(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def load_pure():
    """PURE's definitions from torch_worker.py, run in source order in a module of their own that
    has what they use: its `state`, math, os, json and the runner's relax_worker."""
    tree = ast.parse(TORCH_WORKER.read_text(), str(TORCH_WORKER))
    nodes = [n for n in tree.body if defined_names(n) & PURE]
    missing = PURE - set().union(*(defined_names(n) for n in nodes))
    if missing:
        raise AssertionError(f"torch_worker.py no longer defines {sorted(missing)}")
    module = {"__name__": "torch_worker_pure", "state": {}, "math": math, "os": os, "json": json,
              "rw": relax_worker}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(TORCH_WORKER), "exec"), module)
    return module


TW = load_pure()


def close(got, want):
    """Equal but for the last bits that the two languages' operation orders may leave."""
    return abs(got - want) <= 1e-12 * max(abs(got), abs(want)) + 1e-18


def serving(case):
    """torch_worker's state for a case: init's compute block, and the request's own token_scale."""
    TW["state"]["compute"] = dict(CASES["models"][case["model"]])
    TW["serve_scale"]({"token_scale": case["token_scale"]} if "token_scale" in case else {})


class ComputeModel(unittest.TestCase):
    def test_the_figures_are_the_runners_file_beside_relax_worker(self):
        runner = Path(relax_worker.__file__).resolve().parent / "relax_compute_model.json"
        self.assertEqual(TW["FIGURES"], json.loads(runner.read_text()))
        self.assertEqual(set(TW["FIGURES"]["stages"]), {"log_probs", "values", "train", "prefill", "decode"})

    def test_each_stage_charges_the_golden_seconds(self):
        for i, case in enumerate(CASES["stages"]):
            serving(case)
            got = TW["stage_s"](case["stage"], case["tokens"], case["devices"])
            self.assertTrue(close(got, case["seconds"]), f"stages[{i}]: {got} s, golden {case['seconds']} s")

    def test_a_decode_step_charges_the_golden_seconds(self):
        for i, case in enumerate(CASES["decode_steps"]):
            serving(case)
            # Sequences whose contexts hold `context` tokens in all (the Rust side's arguments).
            active, context = case["active"], case["context"]
            contexts = [context // active] * active
            contexts[0] += context % active
            got = TW["decode_s"]([(c, 1) for c in contexts])
            self.assertTrue(close(got, case["seconds"]), f"decode_steps[{i}]: {got} s, golden {case['seconds']} s")

    def test_a_paced_decode_charges_completes_and_carries_the_golden_figures(self):
        for i, case in enumerate(CASES["decodes"]):
            serving(case)
            seqs = [tuple(s) for s in case["sequences"]]
            seconds, tokens, carried, recomputed, stats = TW["paced_decode"](
                seqs, case["progress"], case["budget"], case["slots"])
            figures = dict(seconds=seconds, tokens=tokens, carried=carried, recomputed=recomputed, stats=stats)
            self.assertTrue(close(seconds, case["seconds"]), f"decodes[{i}]: golden {case['seconds']} s; {figures}")
            self.assertEqual(tokens, case["tokens"], f"decodes[{i}]: tokens; {figures}")
            self.assertEqual(len(carried), len(case["carried"]), f"decodes[{i}]: carried; {figures}")
            for got, want in zip(carried, case["carried"]):
                self.assertTrue(close(got, want), f"decodes[{i}]: carried, golden {case['carried']}; {figures}")
            self.assertEqual(recomputed, case["recomputed"], f"decodes[{i}]: recomputed; {figures}")
            # The reply's `decode` as the built-in rollout's serializes it: its fields, the peak
            # share only with a capacity, the counts as integers.
            want = dict(case["stats"])
            self.assertEqual(set(stats), set(want), f"decodes[{i}]: stats' fields; {figures}")
            for k, w in want.items():
                if k in ("slots", "preemptions"):
                    self.assertTrue(stats[k] == w and isinstance(stats[k], int), f"decodes[{i}]: {k}; {figures}")
                else:
                    self.assertTrue(close(stats[k], w), f"decodes[{i}]: {k}, golden {w}; {figures}")


class WeightBuckets(unittest.TestCase):
    def test_the_weights_stream_is_cut_into_the_golden_buckets(self):
        for i, case in enumerate(CASES["buckets"]):
            sizes, bucket = case["sizes"], case["bucket_bytes"]
            total = sum(sizes)
            self.assertEqual(TW["bucket_count"](total, bucket), case["count"], f"buckets[{i}]: count")
            # As broadcast_weights asks for them: each bucket's stretch of the stream.
            pieces = [[[k, part.start, off, part.stop - part.start]
                       for k, part, off in TW["layout_pieces"](sizes, b * bucket, min(total, (b + 1) * bucket))]
                      for b in range(case["count"])]
            self.assertEqual(pieces, case["pieces"], f"buckets[{i}]: pieces")
            past = list(TW["layout_pieces"](sizes, case["count"] * bucket, (case["count"] + 1) * bucket))
            self.assertEqual(past, [], f"buckets[{i}]: past the end")


if __name__ == "__main__":
    unittest.main()
