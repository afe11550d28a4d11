"""The memory check's estimate against what a run holds at its peak, on this CPU, recipe by recipe.

    python -m bench.memory                    # every recipe, each in a fresh process
    python -m bench.memory --recipes=gpt_6x256

Each recipe trains a few steps in a process of its own. Measured: the growth of the process's peak resident memory
(VmHWM) from just before its models are built (TensorFlow started, the data loaded) to the end of those steps: the
weights, gradients, optimizer slots and activations, and whatever TensorFlow keeps beside them. Estimated:
engine/run/memory.py's parts for the same settings (the model with its gradients and slots, a training and an
evaluation batch; the source's own data left out, as it is loaded before the measure starts). A ratio near 1 is the
estimate's aim; on a CPU the runtime's own buffers (a few hundred MB of XLA's compile and oneDNN's scratch) dominate a
small model, so the recipes that matter are those whose activations are large.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench import common

RECIPES = {
    "digits_mlp": ["--train_steps=20", "--jit_compile=false"],
    "digits_resnet": ["--flagfile=experiments/digits_resnet.flags", "--train_steps=10"],
    "shakespeare_char": ["--flagfile=experiments/shakespeare_char.flags", "--train_steps=10"],
    "gpt_6x256": [
        "--flagfile=experiments/shakespeare_char.flags",
        "--gpt_layers=6",
        "--gpt_dim=256",
        "--gpt_heads=8",
        "--sequence_length=256",
        "--global_batch_size=16",
        "--train_steps=5",
    ],
    "gpt_12x768_ctx512": [
        "--flagfile=experiments/shakespeare_char.flags",
        "--gpt_layers=12",
        "--gpt_dim=768",
        "--gpt_heads=12",
        "--sequence_length=512",
        "--global_batch_size=4",
        "--eval_batch_size=4",
        "--train_steps=3",
        "--steps_per_loop=1",
    ],
}

WORKER = r"""
import json, sys, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import launch
from engine.cluster import distribute
from engine.run import build, inputs, memory

def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

launch._parse_flags(["launch.py", *sys.argv[2:]])
config = launch._config_from_flags()
strategy = distribute.create_strategy(config.cluster)
source, task = inputs.source_and_task(config)
from engine.data import datasets
datasets.prepare(config.data, source, task, service=config.tf_data_service)
before = hwm()
run = build.run(config, strategy)
run.program.run_steps(run.program.train_iterator(), config.train_steps)
trained = hwm() - before
run.evaluator.evaluate()
shape, outputs = build.shape_and_outputs(run.task)
parts = memory.estimate(config, shape, outputs or 2, data=False)
found = {"measured": hwm() - before, "trained": trained, "estimated": memory.need(parts), "parts": parts}
json.dump(found, open(sys.argv[1], "w"))
"""


def measure(name, args):
    """The worker's numbers for recipe `name`, its files in a folder of its own: two runs at once, or what another
    user's run left behind, share none."""
    with tempfile.TemporaryDirectory(prefix=f"bench_memory_{name}_") as tmp:
        out = os.path.join(tmp, "found.json")
        args = [*args, "--warmup_steps=0", f"--workdir={os.path.join(tmp, 'run')}"]  # a few steps: no warmup
        subprocess.run([sys.executable, "-c", WORKER, out, *args], check=True, cwd=common.ROOT)
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args(argv)
    unknown = [name for name in args.recipes.split(",") if name not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {','.join(unknown)}; choose from {','.join(RECIPES)}")
    print(f"{'recipe':<20} {'estimated':>12} {'measured peak growth':>22} {'measured / estimated':>22}")
    for name in args.recipes.split(","):
        found = measure(name, RECIPES[name])
        ratio = found["measured"] / found["estimated"]
        print(f"{name:<20} {found['estimated'] / 1e6:>10.1f} MB {found['measured'] / 1e6:>20.1f} MB {ratio:>21.2f}x")
    print(common.machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
