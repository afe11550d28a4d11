"""What the parity and non-finite tests cannot see: float16 with clipping, the round's loss over skipped steps,
and each parameter-server worker reading its own stream."""

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

if __name__ == "__main__":  # run as a script: the parameter-server probe below
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.run import build, inputs
from tests import forkserver, helpers  # noqa: E402


def _one_step(config, strategy):
    """(the first step's weight update, the round's outputs)."""
    trainer = build.run(config, strategy)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    out = trainer.program.run_steps(trainer.program.train_iterator(), 1)
    return [v.numpy() - b for v, b in zip(trainer.model.trainable_variables, before)], out


def _relative_difference(a, b):
    return np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b)) / sum(np.sum(y**2) for y in b))


@pytest.mark.slow
@pytest.mark.parametrize("clip", [dict(clip_norm=0.2), dict(clip_value=0.002)], ids=["clip_norm", "clip_value"])
def test_float16_with_clipping_takes_the_float32_step(data_dir, one_device, clip):
    # Clipping the still-scaled gradients and unscaling afterwards shrinks the update by the loss scale (1024x).
    case = dict(optimizer="sgd", learning_rate=0.1, momentum=0.0, initial_loss_scale=1024.0, **clip)
    reference, reference_out = _one_step(helpers.make_config(data_dir, **case), one_device)
    update, out = _one_step(helpers.make_config(data_dir, precision="mixed_float16", **case), one_device)
    if "clip_norm" in clip:
        assert reference_out["grad_norm"] > 2 * clip["clip_norm"]  # clipping is active
    else:
        largest = max(float(np.max(np.abs(u))) for u in reference)
        assert largest == pytest.approx(case["learning_rate"] * clip["clip_value"], rel=1e-3)  # elements clipped
    assert out["skipped"] == 0 and out["loss_scale"] == 1024.0
    # Measured: the norms agree to 6e-5 and the updates to 6e-4 (float16 rounding), relative.
    assert out["grad_norm"] == pytest.approx(reference_out["grad_norm"], rel=1e-3)
    assert _relative_difference(update, reference) < 1e-2


@pytest.mark.slow
def test_round_loss_is_the_mean_of_its_finite_steps(data_dir, one_device):
    """A float16 round with one non-finite step (a NaN input) reports the mean loss of the other steps."""
    config = helpers.make_config(data_dir, **helpers.NONFINITE_CASE)
    whole = build.run(config, one_device)
    taken = list(whole.data.train_fn(tf.distribute.InputContext()).take(4))
    taken[1] = {**taken[1], "image": tf.tensor_scatter_nd_update(taken[1]["image"], [[0, 0, 0, 0]], [float("nan")])}
    batches = tf.data.Dataset.from_tensor_slices({k: tf.stack([b[k] for b in taken]) for k in taken[0]})
    out = whole.program.run_steps(iter(batches), 4)
    # The same steps one round each: their losses and which of them were skipped.
    stepwise, iterator = build.run(config, one_device), iter(batches)
    steps = [stepwise.program.run_steps(iterator, 1) for _ in range(4)]
    assert [s["skipped"] for s in steps] == [0, 1, 0, 0]
    assert (out["steps"], out["skipped"]) == (4, 1)
    assert out["loss"] == pytest.approx(np.mean([s["loss"] for s in steps if not s["skipped"]]), rel=1e-6)


def _epochs(loaded, stream, count):
    """The first `count` epochs of a training stream on one input pipeline, as lists of example keys."""
    n, keys = loaded.train_examples, []
    for batch in loaded.train_fn(tf.distribute.InputContext(), 0, stream):
        keys.extend(x.tobytes() for x in batch["image"].numpy())
        if len(keys) >= count * n:
            break
    return [keys[e * n : (e + 1) * n] for e in range(count)]


def test_each_stream_is_its_own_order_of_the_training_set(data_dir):
    config = helpers.make_config(data_dir, dataset="synthetic", synthetic_shape=(3,), synthetic_examples=256)
    loaded = inputs.run_data(config)
    streams = {stream: _epochs(loaded, stream, 2) for stream in (0, 1, 2)}
    examples = sorted(streams[0][0])
    assert len(set(examples)) == 256
    for epochs in streams.values():
        assert all(sorted(epoch) == examples for epoch in epochs)  # every epoch: each example once
        assert epochs[0] != epochs[1], "the second epoch repeats the first one's order"
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert streams[a][0] != streams[b][0], f"streams {a} and {b} read the same order"


def _parameter_server_first_batches(data_dir):
    """In this process: a chief, a parameter server and two workers; each worker's first training batch."""
    ports = helpers.free_ports(4)
    jobs = {"chief": ports[:1], "ps": ports[1:2], "worker": ports[2:]}
    spec = tf.train.ClusterSpec({job: [f"localhost:{p}" for p in ps] for job, ps in jobs.items()})
    # In-process workers hang without an inter-op thread per worker and one more (TensorFlow's own test setup).
    server_config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
    servers = [  # noqa: F841  (they serve until the process ends)
        tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc", config=server_config, start=True)
        for job, i in (("ps", 0), ("worker", 0), ("worker", 1))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    trainer = build.run(helpers.make_config(data_dir, strategy="parameter_server"), strategy)
    iterator = trainer.program.train_iterator()
    with strategy.scope():
        arrived = tf.Variable(0)

    @tf.function
    def first_batch(iterator):
        # A worker runs one function at a time: waiting here until both started puts one on each worker.
        arrived.assign_add(1)
        tf.while_loop(lambda: arrived < 2, lambda: [], [])
        return next(iterator)

    remote = [trainer.program.coordinator.schedule(first_batch, args=(iterator,)) for _ in range(2)]
    trainer.program.coordinator.join()
    return [r.fetch()["image"].tolist() for r in remote]


def test_parameter_server_workers_read_different_streams(data_dir):
    # A separate process: connecting to a cluster changes this process's devices for good.
    result = forkserver.run(
        [os.path.abspath(__file__), data_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if result.returncode:
        pytest.fail(f"the parameter-server probe failed: {result.stderr[-3000:]}")
    first, second = (np.array(images) for images in json.loads(result.stdout.splitlines()[-1]))
    assert first.shape == second.shape == (64, 8, 8, 1)
    assert not np.array_equal(first, second), "both workers read the same first batch: the same stream"


if __name__ == "__main__":
    print(json.dumps(_parameter_server_first_batches(sys.argv[1])))
