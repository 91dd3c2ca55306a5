# relax-colocate's wandb helper (run as `python -c` by the runner for --logger wandb): reads one
# metrics row per line (JSON, a "step" and numbers) on stdin and logs it to a wandb run, then
# finishes the run at end of input. WANDB_MODE, WANDB_PROJECT and the other WANDB_* variables
# apply as usual; WANDB_MODE=offline keeps everything under <run dir>/wandb.
import json
import os
import sys

import wandb

run_dir, project, name = sys.argv[1], sys.argv[2], sys.argv[3]
run = wandb.init(
    project=os.environ.get("WANDB_PROJECT", project),
    name=name or None,
    dir=run_dir,
    config={"run_dir": os.path.abspath(run_dir)},
)
for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    row = json.loads(line)
    step = int(row.pop("step", 0))
    run.log(row, step=step)
run.finish()
