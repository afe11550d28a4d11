"""tasks/sam.py, sharpness-aware minimization written from the engine's primitives: against a plain TensorFlow loop
of its math, across strategies, through a SIGKILL; and the guards of those primitives (engine/numerics/replica.py
ReplicaStep).

Also the worker of its multi-worker test: TF_CONFIG=... python tests/test_sam.py OUT_DIR DATA_DIR
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import helpers  # noqa: E402

TOLERANCE = 1e-5
RHO = 0.05  # tasks/sam.py's default

# Unclipped SGD shows a gradient of the wrong scale; clipped AdamW checks that e is taken from the clipped
# gradients (its norm after clipping), with decoupled weight decay on the kernels.
CASES = {
    "sgd": dict(optimizer="sgd", learning_rate=0.1, momentum=0.9),
    "adamw_clipped": dict(optimizer="adamw", learning_rate=3e-3, weight_decay=1e-2, clip_norm=0.2),
}
KERAS_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adamw_clipped": lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-2),
}


def sam_config(data_dir, **overrides):
    return helpers.make_config(data_dir, task="sam", **overrides)


# ---- The reference: SAM's math as a plain TensorFlow loop ---------------------------------------------------


def mlp(weights, image):
    """models/mlp.py's forward from its weights [kernel, bias, ...]: ReLU hidden layers, a linear head."""
    x = tf.reshape(image, [tf.shape(image)[0], -1])
    layers = list(zip(weights[::2], weights[1::2]))
    for kernel, bias in layers[:-1]:
        x = tf.nn.relu(x @ kernel + bias)
    kernel, bias = layers[-1]
    return x @ kernel + bias


def clipped_gradient(weights, batch, clip_norm):
    with tf.GradientTape() as tape:
        tape.watch(weights)
        logits = mlp(weights, batch["image"])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["label"], logits))
    grads = tape.gradient(loss, weights)
    return tf.clip_by_global_norm(grads, clip_norm)[0] if clip_norm else grads


def reference_sam(initial, batches, rho, optimizer, clip_norm):
    """The weights after SAM over `batches` from `initial`: e = rho g / ||g|| of the (clipped) gradient g at w, then
    the (clipped) gradient at w + e applied at w by a Keras optimizer (weight decay on kernels only, as the engine)."""
    weights = [keras.Variable(x) for x in initial]
    optimizer.build(weights)
    optimizer.exclude_from_weight_decay(var_list=[w for w in weights if len(w.shape) < 2])
    for batch in batches:
        at = [tf.convert_to_tensor(w) for w in weights]
        g = clipped_gradient(at, batch, clip_norm)
        norm = tf.linalg.global_norm(g)
        ascent = clipped_gradient([w + rho * x / (norm + 1e-12) for w, x in zip(at, g)], batch, clip_norm)
        optimizer.apply_gradients(zip(ascent, weights))
    return [w.numpy() for w in weights]


def max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


def weights_of(snap):
    """The trained weights of a helpers.snapshot, in the model's order, first replica."""
    return [snap[k][0] for k in sorted((k for k in snap if k.startswith("weight/")), key=lambda k: int(k[7:]))]


@pytest.fixture(scope="module")
def one_device_runs(data_dir, one_device):
    """{case: (snapshot, round outputs, initial weights, the 20 batches trained on)} of SAM on one device."""
    from engine.run import build

    runs = {}
    for name, case in CASES.items():
        config = sam_config(data_dir, **case)
        trainer = build.run(config, one_device)
        assert (
            trainer.program.in_step
        )  # each step gathers batch k with data.gather(k, 0, 1): the reference reads the same
        assert [n.rsplit("/", 1)[1] for n in trainer.weights.names] == ["kernel", "bias"] * 3
        initial = [v.numpy() for v in trainer.weights.variables]
        batches = [trainer.data.gather(tf.constant(k, tf.int64), 0, 1) for k in range(config.train_steps)]
        out = trainer.program.run_steps(trainer.program.train_iterator(), config.train_steps)
        runs[name] = (helpers.snapshot(trainer), out, initial, batches)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sam_matches_a_plain_tensorflow_loop_of_its_math(one_device_runs, case):
    snap, out, initial, batches = one_device_runs[case]
    clip_norm = CASES[case].get("clip_norm", 0.0)
    expected = reference_sam(initial, batches, RHO, KERAS_OPTIMIZERS[case](), clip_norm)
    assert max_difference(weights_of(snap), expected) < TOLERANCE
    assert snap["iterations"][0] == 20
    assert max_difference(weights_of(snap), initial) > 1e-2  # trained: not two untouched copies
    if clip_norm:
        assert out["grad_norm"] > clip_norm  # clipping was active, so e came from clipped gradients
    # The test can fail: the plain step (rho = 0) ends far from SAM's weights.
    plain = reference_sam(initial, batches, 0.0, KERAS_OPTIMIZERS[case](), clip_norm)
    assert max_difference(weights_of(snap), plain) > 100 * TOLERANCE


def test_a_sam_step_is_two_evaluations_of_one_all_reduce_each(data_dir, one_device, monkeypatch):
    from engine.numerics import replica as step_lib
    from engine.run import build

    calls = []

    def counted(cls, name):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *args, **kwargs: calls.append(name) or original(*args, **kwargs))

    counted(step_lib.ReplicaStep, "gradients")
    counted(tf.distribute.ReplicaContext, "all_reduce")
    counted(step_lib.ReplicaStep, "apply")
    trainer = build.run(sam_config(data_dir), one_device)
    out = helpers.one_step(trainer, trainer.data.gather(tf.constant(0, tf.int64), 0, 1))
    assert calls == ["gradients", "all_reduce", "gradients", "all_reduce", "apply"]
    assert int(trainer.plans[0].optimizer.iterations.numpy()) == 1 and bool(out["finite"])


def assert_matches_one_device(snap, out, reference):
    reference_snap, reference_out = reference
    assert snap.keys() == reference_snap.keys()
    assert max(max_difference([snap[k][0]], [reference_snap[k][0]]) for k in snap) < TOLERANCE
    assert out["loss"] == pytest.approx(reference_out["loss"], rel=TOLERANCE)
    assert out["grad_norm"] == pytest.approx(reference_out["grad_norm"], rel=TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_mirrored_matches_one_device(data_dir, mirrored, one_device_runs, case):
    snap, out = helpers.train_and_snapshot(sam_config(data_dir, **CASES[case]), mirrored)
    for copies in snap.values():  # e comes from the all-reduced gradient: both replicas perturb alike
        np.testing.assert_array_equal(copies[0], copies[1])
    assert snap["iterations"][0] == 20
    assert_matches_one_device(snap, out, one_device_runs[case][:2])


@pytest.mark.slow
def test_multi_worker_matches_one_device(data_dir, tmp_path, one_device_runs):
    results = helpers.run_workers([os.path.abspath(__file__), str(tmp_path), data_dir], count=2, timeout=300)
    for code, output in results:
        assert code == 0, output[-3000:]
    for case in CASES:
        saved = [np.load(tmp_path / f"{case}_worker{i}.npz") for i in range(2)]
        snaps = [{k[5:]: [w[k]] for k in w.files if k.startswith("snap:")} for w in saved]
        outs = [{k: float(w[k]) for k in ("loss", "grad_norm")} for w in saved]
        assert max(max_difference(snaps[0][k], snaps[1][k]) for k in snaps[0]) == 0.0
        assert outs[0] == outs[1]
        assert_matches_one_device(snaps[0], outs[0], one_device_runs[case][:2])


def multi_worker_main(out_dir, data_dir):
    from engine.cluster import distribute

    strategy = distribute.create_strategy(helpers.make_config(data_dir, strategy="multi_worker").cluster)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    for case, settings in CASES.items():
        snap, out = helpers.train_and_snapshot(sam_config(data_dir, **settings), strategy)
        arrays = {f"snap:{k}": v[0] for k, v in snap.items()}
        path = os.path.join(out_dir, f"{case}_worker{index}.npz")
        np.savez(path, loss=out["loss"], grad_norm=out["grad_norm"], **arrays)


# ---- Exact resume ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_and_a_restart_on_the_same_settings_end_bit_identical(data_dir, tmp_path, capsys):

    settings = dict(
        data_dir=data_dir,
        task="sam",
        deterministic=True,
        seed=3,
        train_steps=200,  # long enough after the kill at 50 for a fast machine's overshoot
        steps_per_loop=10,
        checkpoint_every=40,
        hidden_sizes=(128, 128),
        warmup_steps=20,
        lr_schedule="cosine",
        clip_norm=0.5,
    )
    _, kill_point, resumed_from, straight_dir, killed = helpers.straight_and_killed(tmp_path, settings, 50, capsys)
    assert 0 < resumed_from <= kill_point and resumed_from % 40 == 0, (resumed_from, kill_point)

    straight, resumed = (json.load(open(d / "summary.json")) for d in (straight_dir, killed))
    assert resumed["step"] == straight["step"] == 200
    assert resumed["train_loss"] == straight["train_loss"] and resumed["eval"] == straight["eval"]
    records = [[json.loads(line) for line in open(d / "metrics.jsonl")] for d in (straight_dir, killed)]
    assert [r["loss"] for r in records[1]] == [r["loss"] for r in records[0]]
    (path_a, a), (path_b, b) = helpers.checkpoint_tensors(straight_dir), helpers.checkpoint_tensors(killed)
    assert path_a.endswith("ckpt-200") and path_b.endswith("ckpt-200") and a.keys() == b.keys()
    slots = [k for k in a if k.startswith("optimizer/") and "slots" in k]
    iterations = [k for k in a if k.startswith("optimizer/iterations")]
    assert len(slots) == 12 and len(iterations) == 1  # AdamW's two moments of the 6 weights: all compared
    assert a[iterations[0]] == 200
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---- The primitives' guards -----------------------------------------------------------------------------------


def trace_error(data_dir, one_device, monkeypatch, replica_step, updates=None):
    """The message of the error the first round raises with `replica_step` (and `updates`) in tasks/sam.py."""
    from engine.run import build
    from tasks import sam

    monkeypatch.setattr(sam.Task, "replica_step", replica_step)
    if updates is not None:
        monkeypatch.setattr(sam.Task, "updates", lambda self: updates)
    trainer = build.run(sam_config(data_dir, train_steps=1), one_device)
    with pytest.raises(ValueError) as raised:
        trainer.program.run_steps(trainer.program.train_iterator(), 1)
    assert int(trainer.plans[0].optimizer.iterations.numpy()) == 0
    # Raised while the round is traced: TensorFlow puts the traceback of the user's code above the message.
    return re.sub(r"^ValueError: ", "", str(raised.value).strip().splitlines()[-1].strip())


def test_apply_refuses_a_raw_list_of_gradients(data_dir, one_device, monkeypatch):
    def replica_step(self, step, batch):
        step.apply("train", step.gradients("train", batch).grads)

    message = trace_error(data_dir, one_device, monkeypatch, replica_step)
    assert message == (
        "tasks/sam.py: replica_step: step.apply('train', ...) takes the Gradients of step.gradients('train', ...) of "
        "this step, not a list"
    )


def test_apply_refuses_the_gradients_of_another_update(data_dir, one_device, monkeypatch):
    from engine.numerics.updates import Update

    def replica_step(self, step, batch):
        step.apply("biases", step.gradients("kernels", batch))
        step.apply("kernels", step.gradients("kernels", batch))

    updates = (Update("kernels", trains="kernel$"), Update("biases", trains="bias$"))
    message = trace_error(data_dir, one_device, monkeypatch, replica_step, updates)
    assert message == (
        "tasks/sam.py: replica_step: step.apply('biases', ...) takes the Gradients of step.gradients('biases', ...) "
        "of this step, not the gradients of update 'kernels'"
    )


def test_a_step_that_never_applies_its_update_is_refused(data_dir, one_device, monkeypatch):
    def replica_step(self, step, batch):
        step.gradients("train", batch)

    message = trace_error(data_dir, one_device, monkeypatch, replica_step)
    assert message == (
        "tasks/sam.py: replica_step: never applies update 'train'; every update is applied once a step at least "
        "(step.apply(name, gradients, when=False) skips it)"
    )


def test_float16_a_non_finite_evaluation_masks_the_whole_update(data_dir, one_device, monkeypatch):
    """SAM's step with its first or its second evaluation made non-finite on demand: nothing of the update changes
    (weights, slots, update count) and the scale halves; a finite step applies."""
    from engine.run import build
    from tasks import sam

    poisoned = tf.Variable(0)  # 0: neither evaluation, 1: the first, 2: the second

    def replica_step(self, step, batch):
        def loss(models, b, seed):  # the task's loss, infinite while the first evaluation is poisoned
            return self.loss(self.forward(models, b, True), b) * tf.where(poisoned == 1, np.inf, 1.0)

        first = step.gradients("train", batch, loss=loss)
        shift = [RHO * g / (tf.linalg.global_norm(first.grads) + 1e-12) for g in first.grads]
        # First poisoned: the second evaluation at w, finite. Second poisoned: at w + inf, it alone non-finite.
        shift = [tf.where(poisoned == 1, tf.zeros_like(s), tf.where(poisoned == 2, s * np.inf, s)) for s in shift]
        step.apply("train", step.gradients("train", batch, shift=shift))

    monkeypatch.setattr(sam.Task, "replica_step", replica_step)
    trainer = build.run(sam_config(data_dir, **helpers.NONFINITE_CASE), one_device)
    batch = trainer.data.gather(tf.constant(0, tf.int64), 0, 1)
    run = helpers.step_function(trainer)

    def step(poison):
        poisoned.assign(poison)
        before = helpers.snapshot(trainer)
        finite = bool(run(batch)["finite"])
        return before, helpers.snapshot(trainer), finite

    _, applied, finite = step(0)
    assert finite and applied["iterations"][0] == 1 and applied["good_steps"][0] == 1
    for poison, scale in ((1, 512.0), (2, 256.0)):  # halved from 1024, then again
        before, after, finite = step(poison)
        assert not finite
        for name in before:
            if name not in ("scale", "good_steps"):
                np.testing.assert_array_equal(after[name][0], before[name][0], err_msg=f"{name}, poison {poison}")
        assert after["scale"][0] == scale and after["good_steps"][0] == 0, poison
    before, after, finite = step(0)
    assert finite and after["iterations"][0] == 2 and after["good_steps"][0] == 1 and after["scale"][0] == 256.0
    assert max_difference(weights_of(after), weights_of(before)) > 0


if __name__ == "__main__":
    multi_worker_main(*sys.argv[1:])
