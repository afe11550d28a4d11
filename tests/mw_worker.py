"""A multi-worker task for the tests: runs the parity cases and the non-finite scenario, saves results.

TF_CONFIG=... python tests/mw_worker.py OUT_DIR DATA_DIR
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cluster import distribute  # noqa: E402
from tests import helpers  # noqa: E402


def main(out_dir, data_dir):
    strategy = distribute.create_strategy(helpers.make_config(data_dir, strategy="multi_worker").cluster)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    save = lambda name, arrays: np.savez(os.path.join(out_dir, f"{name}_worker{task}.npz"), **arrays)  # noqa: E731
    for name, case in helpers.PARITY_CASES.items():
        snap, out = helpers.train_and_snapshot(helpers.make_config(data_dir, **case), strategy)
        save(name, {k: v[0] for k, v in snap.items()})
        save(f"{name}_out", {"loss": out["loss"], "grad_norm": out["grad_norm"]})
    config = helpers.make_config(data_dir, **helpers.NONFINITE_CASE)
    before, after_bad, after_good, bad_out, good_outs = helpers.nonfinite_scenario(config, strategy, bad_replica=1)
    for name, snap in (("before", before), ("after_bad", after_bad), ("after_good", after_good)):
        save(f"nonfinite_{name}", {k: v[0] for k, v in snap.items()})
    save(
        "nonfinite_outs",
        {
            "bad_finite": bad_out["finite"],
            "bad_scale": bad_out["loss_scale"],
            "good_finite": [o["finite"] for o in good_outs],
        },
    )
    print("worker done", task, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
