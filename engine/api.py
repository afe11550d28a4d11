"""The engine's public face: everything a fork's task, data source or action imports, from this one module.

Files move inside engine/ as the engine grows; these names stay here. A fork imports them as
`from engine.api import Update, ConfigError, ...`, and the bundled tasks and sources import the engine only
through this module, so they show what a fork may rely on. Models import nothing of the engine.

For a task (tasks/<name>.py, a subclass of tasks/base.py's Task, the protocol with its defaults; base.py also holds
the helpers tasks share: per-example random numbers, bits):
    Update          one update of the step: its loss, the variables it trains, its optimizer, clipping, frequency
    DEFAULT         the name of a task's one default update ("train")
    ReplicaStep     the primitives a task's `replica_step(step, batch)` is written from (gradients, apply, ...)
    Gradients       what ReplicaStep.gradients returns (.loss, .grads, .norm, .finite)
For a data source (sources/<name>.py):
    Source, Split   what `load(config, eval_split)` returns, and one split of it
    ENGINE_FEATURES the features the engine sets on an example itself, which a spec or a source's file may not name
    in_memory       a split held in memory, from {feature: tensor of examples x ...}
    sharded         a split streamed from counted TFRecord files
    tfds_source     the Source of a tensorflow-datasets dataset (prepared into --data_dir on first use)
    image_decoder   image_decoder(config.data): the per-example decode of photos of any size (random-resized crop
                    and flip, centre crop)
For code outside engine/ that handles actions (an action's own file, engine/run/actions/<name>.py, subclasses
base.py beside it): Action (the interface: every, steps, due, needs, around, __call__, close), Round (what a round
    hands it), ROLLED_BACK and Stop (what it may answer)
To hold a fork's step against a reference (a plain TensorFlow loop of its math, as the tests do):
    weights         {model: {variable path: array}} of a run's checkpoint (a workdir's newest readable, or a prefix);
                    --save_initial writes step 0's, the initial weights
    training_batches  the global batches a run trains on, in order, as one device reads them
    run_config      the Config a train run saved in its workdir (config.json), for training_batches
Errors: ConfigError (bad input: the message names the flag or file and the value), TaskError (a task's code that
cannot run: the message names the task's file, the update or primitive, and what was wrong), Undefined (what the
task protocol needs and a task does not define), first_line.
"""

from engine.data.images import decoder as image_decoder
from engine.data.records import ENGINE_FEATURES, Source, Split, in_memory, sharded
from engine.data.tfds_source import load as tfds_source
from engine.numerics.replica import Gradients, ReplicaStep
from engine.numerics.updates import DEFAULT, Update
from engine.run.actions.base import ROLLED_BACK, Action, Round, Stop
from engine.run.inputs import training_batches
from engine.settings.config import first_line
from engine.settings.config import load_run_config as run_config
from engine.settings.errors import ConfigError, TaskError, Undefined
from engine.state.warm_start import weights

__all__ = [
    "DEFAULT",
    "ENGINE_FEATURES",
    "ROLLED_BACK",
    "Action",
    "Round",
    "Stop",
    "ConfigError",
    "Gradients",
    "ReplicaStep",
    "Source",
    "Split",
    "TaskError",
    "Undefined",
    "Update",
    "first_line",
    "image_decoder",
    "in_memory",
    "run_config",
    "sharded",
    "tfds_source",
    "training_batches",
    "weights",
]
