"""scripts/soak-verify.py, shortened: a churning PyTorch pool paused and resumed with every
restore verified (TMS_VERIFY_RESTORE), every live tensor compared, and free device memory back
where the first cycle left it. The full 1,000-cycle run is in docs/perf.md."""

import json
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak-verify.py"


def test_a_churning_pool_survives_verified_cycles_without_a_mismatch_or_a_leak(sim, request):
    package = PACKAGE if PACKAGE.is_dir() else request.getfixturevalue("wheel_site")
    extra = {"PYTHONPATH": f"{sim.sim_python}:{package}", "TMS_VERIFY_RESTORE": "1", "OMP_NUM_THREADS": "1"}
    proc = sim.python(
        f"import runpy, sys; sys.argv = ['soak-verify.py', '--cycles', '30']; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')",
        preload=sim.hook,
        extra=extra,
        timeout=600,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["cycles"] == 30 and summary["mismatches"] == 0, summary
    assert abs(summary["free_drift_mib"]) <= 1.0, summary
    assert summary["backup_mib_copied"] > 0, summary
