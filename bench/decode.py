"""The decode-heavy input pipeline: does it keep up with the step, and what the tf.data service costs.

    python -m bench.decode              # about 3 min on 2 shared CPU cores
    python -m bench.decode --quick      # small images, short windows: checks that it all runs (~30 s)
    python -m bench.decode --json X     # also write the measurements to X

JPEGs of varied sizes (200-500 px a side, generated into a temporary folder) are read and decoded as
`--dataset=folder:` reads them: engine/data/images.py's training decoder (random-resized crop to 224, flip, seeded per
example) in a parallel map, then batched. Measured side by side in one process, in alternating phases with one
pipeline alive at a time (the best window of each kept; see `alternating`):
- examples/s delivered, and per core (the cores this process may run on);
- the same pipeline through a local tf.data service (a dispatcher and a worker started here, the worker in this
  process on the same cores), so the ratio is what the service's RPCs and copies cost, not extra machines;
- uint8 batches normalised in the step vs float32 or bfloat16 batches normalised on the host (in the pipeline), all
  through to a small training step, so the step reads every pixel without hiding the input's cost;
- what the step consumes: the engine's ResNet-20 step (bench/run.py's table's model) at 224 x 224, alone.
On a CPU-only machine the step and the pipeline share the cores; the two rates say how far each would go alone.
"""

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from bench import common  # noqa: E402  (imports no TensorFlow)

SEED = 0


def progress(message):
    print(f"progress: {message}", file=sys.stderr, flush=True)


def settings(quick):
    if quick:
        return dict(
            images=24, sides=(48, 96), image_size=32, batch=8, window_s=0.2, windows=2, phases=1, warm=2, step_batch=4
        )
    return dict(
        images=300,
        sides=(200, 500),
        image_size=224,
        batch=64,
        window_s=1.5,
        windows=3,
        phases=3,
        warm=16,
        step_batch=32,
    )


def write_jpegs(directory, count, sides):
    """`count` JPEGs of random sizes in [sides[0], sides[1]] a side: smooth colour fields with noise, which compress
    like photos (about 2 bits a pixel at quality 90) rather than like noise or flat colour."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(SEED)
    paths = []
    for i in range(count):
        height, width = rng.integers(sides[0], sides[1] + 1, size=2)
        field = tf.image.resize(rng.uniform(0, 255, (6, 6, 3)).astype(np.float32), [height, width], "bicubic")
        pixels = np.clip(field.numpy() + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
        path = os.path.join(directory, f"{i:05d}.jpg")
        tf.io.write_file(path, tf.io.encode_jpeg(pixels, quality=90))
        paths.append(path)
    return paths


def decoded(paths, image_size, batch):
    """Endless batches of {image: uint8 [batch, S, S, 3], label}, example i cropped with seed (SEED, i)."""
    import tensorflow as tf

    from engine.data import images
    from engine.settings.fields import Config

    decode = images.decoder(Config(image_size=image_size, dataset="folder:bench").data)
    files = tf.constant(paths)

    def example(i):
        raw = {"image": tf.io.read_file(files[i % len(paths)]), "label": i % 10}
        return decode(raw, tf.stack([tf.constant(SEED, tf.int64), i]), True)

    ds = tf.data.Dataset.range(2**62).map(example, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def start_service():
    """A local tf.data service, a dispatcher and one worker in this process: (its address, the servers)."""
    import tensorflow as tf

    service = tf.data.experimental.service
    # A job no iterator reads any more is released within a second, so its worker stops producing for it.
    dispatcher = service.DispatchServer(
        service.DispatcherConfig(port=0, job_gc_check_interval_ms=1000, job_gc_timeout_ms=1000)
    )
    address = dispatcher.target.split("://")[1]
    worker = service.WorkerServer(service.WorkerConfig(dispatcher_address=address, port=0))
    return dispatcher.target, (dispatcher, worker)  # the servers stop when nothing refers to them


def through_service(ds, target):
    import tensorflow as tf

    # One worker, so each element is produced once whichever mode; parallel_epochs needs no splittable source.
    return ds.apply(tf.data.experimental.service.distribute(processing_mode="parallel_epochs", service=target))


class Pull:
    """A window pulls `batches` batches from the iterator and returns the seconds it took."""

    def __init__(self, ds):
        self.iterator = iter(ds)

    def window(self, batches):
        tic = time.perf_counter()
        for _ in range(batches):
            batch = next(self.iterator)
        batch["image"].numpy()  # the last batch is really here
        return time.perf_counter() - tic


class Step:
    """A small training step on the batches of `ds`: a strided convolution over every pixel, global pooling and a
    linear classifier, SGD. uint8 batches are normalised in it, float32 ones arrive normalised."""

    def __init__(self, ds):
        import tensorflow as tf

        self.iterator = iter(ds)
        self.kernel = tf.Variable(tf.random.stateless_normal([3, 3, 3, 16], seed=[SEED, 1], stddev=0.1))
        self.dense = tf.Variable(tf.zeros([16, 10]))

        @tf.function
        def steps(n):
            loss = tf.constant(0.0)
            for _ in tf.range(n):
                batch = next(self.iterator)
                with tf.GradientTape() as tape:
                    x = batch["image"]
                    x = tf.cast(x, tf.float32) / 255.0 if x.dtype == tf.uint8 else tf.cast(x, tf.float32)
                    features = tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(x, self.kernel, 2, "SAME")), [1, 2])
                    labels = tf.cast(batch["label"], tf.int64)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, features @ self.dense))
                for variable, gradient in zip(
                    (self.kernel, self.dense), tape.gradient(loss, (self.kernel, self.dense))
                ):
                    variable.assign_sub(0.01 * gradient)
            return loss

        self.steps = steps

    def window(self, batches):
        import tensorflow as tf

        tic = time.perf_counter()
        self.steps(tf.constant(batches)).numpy()
        return time.perf_counter() - tic


def normalised_on_host(dtype):
    import tensorflow as tf

    return lambda batch: {**batch, "image": tf.cast(tf.cast(batch["image"], tf.float32) / 255.0, dtype)}


def alternating(makers, window_s, windows, phases, warm):
    """{name: best seconds per batch} of the runners `makers` make. One runner exists at a time: an idle pipeline
    would go on filling its buffers (the service's are deep) on the cores the timed one needs, then hand them out
    as speed. Each phase makes each runner afresh, pulls `warm` batches twice untimed (tracing, the service's job,
    the buffers reaching their steady state), then times `windows` windows back to back; the phases alternate the
    runners, so a neighbour's load falls on all of them alike."""
    best = {name: float("inf") for name in makers}
    for _ in range(phases):
        for name, make in makers.items():
            runner = make()
            runner.window(warm)
            batches = max(2, round(window_s * warm / runner.window(warm)))
            for _ in range(windows):
                best[name] = min(best[name], runner.window(batches) / batches)
            del runner
            gc.collect()
    return best


def step_speed(image_size, batch, window_s, quick):
    """examples/s of the engine's ResNet step (bench/run.py's model: ResNet-20, width 16; smaller with --quick) on
    synthetic image_size x image_size x 3 examples, fed by the engine's own in-memory pipeline."""
    from bench.runners import EngineRunner, create_strategy, make_config, warm_up

    model = dict(model="resnet", resnet_depth=8 if quick else 20, resnet_width=4 if quick else 16)
    spec = dict(**model, global_batch_size=batch, synthetic_shape=(image_size, image_size, 3), synthetic_examples=64)
    config = make_config(spec, strategy="one_device")
    runner = EngineRunner(config, create_strategy(config))
    steps = warm_up(runner, window_s, 100)
    seconds = min(runner.window(steps) / steps for _ in range(2))
    return {"examples_per_sec": batch / seconds, "model": f"ResNet-{model['resnet_depth']}", "batch": batch}


def measure(quick=False):
    """The measurements, as a dict of plain numbers and names."""
    import tensorflow as tf

    s = settings(quick)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as directory:
        paths = write_jpegs(directory, s["images"], s["sides"])
        megapixels = sum(int(tf.reduce_prod(tf.io.extract_jpeg_shape(tf.io.read_file(p))[:2])) for p in paths) / 1e6
        local = decoded(paths, s["image_size"], s["batch"])
        target, servers = start_service()
        timing = (s["window_s"], s["windows"], s["phases"], s["warm"])
        makers = {"local": lambda: Pull(local), "service": lambda: Pull(through_service(local, target))}
        pipelines = alternating(makers, *timing)
        del servers
        progress(f"delivered (batches/s): {', '.join(f'{k} {1 / v:.2f}' for k, v in pipelines.items())}")
        # Decoded batches, cached: the normalisation comparison times the hand-over, not the decoding.
        cached = local.take(4).cache().repeat()
        makers = {"uint8": lambda: Step(cached)}
        for dtype in (tf.float32, tf.bfloat16):
            host = cached.map(normalised_on_host(dtype), num_parallel_calls=tf.data.AUTOTUNE)
            makers[dtype.name] = lambda host=host: Step(host)
        steps = alternating(makers, *timing)
        progress(f"through the small step (batches/s): {', '.join(f'{k} {1 / v:.2f}' for k, v in steps.items())}")
    consumed = step_speed(s["image_size"], s["step_batch"], s["window_s"], quick)
    delivered = {name: s["batch"] / seconds for name, seconds in pipelines.items()}
    return {
        "cores": cores,
        "images": s["images"],
        "sides": list(s["sides"]),
        "mean_megapixels": megapixels / s["images"],
        "image_size": s["image_size"],
        "batch": s["batch"],
        "examples_per_sec": delivered,
        "examples_per_sec_per_core": {name: v / cores for name, v in delivered.items()},
        "service_vs_local": delivered["service"] / delivered["local"],
        "normalise_examples_per_sec": {name: s["batch"] / seconds for name, seconds in steps.items()},
        "uint8_vs_float32": steps["float32"] / steps["uint8"],
        "bfloat16_vs_float32": steps["float32"] / steps["bfloat16"],
        "step": consumed,
        "delivered_vs_consumed": delivered["local"] / consumed["examples_per_sec"],
    }


def rows(r):
    """bench/run.py table rows (same keys as its `rows`) for the measurements `r` of `measure`."""
    what = f"JPEG {r['sides'][0]}-{r['sides'][1]} px, random-resized crop {r['image_size']}, batch {r['batch']}"
    step = f"{r['step']['model']} step at {r['image_size']}x{r['image_size']}, batch {r['step']['batch']}"
    local, service = r["examples_per_sec"]["local"], r["examples_per_sec"]["service"]
    norm = r["normalise_examples_per_sec"]
    return [
        common.row(
            "decode/per_core",
            f"decode pipeline examples/s per core: {what}",
            r["examples_per_sec_per_core"]["local"],
            f"{r['examples_per_sec_per_core']['local']:.0f}/s",
            detail=f"{local:.0f} examples/s / {r['cores']} (cores), {r['mean_megapixels']:.2f} MP a JPEG on average",
        ),
        common.row(
            "decode/keeps_up",
            f"decode pipeline / what the step consumes: {step}",
            r["delivered_vs_consumed"],
            f"{r['delivered_vs_consumed']:.2f}x",
            ">= 1.00x",
            lambda v: v >= 1.0,
            f"{local:.0f} vs {r['step']['examples_per_sec']:.1f} examples/s, each alone on these cores",
        ),
        common.row(
            "decode/service",
            "the same pipeline through a local tf.data service / without",
            r["service_vs_local"],
            f"{r['service_vs_local']:.2f}x",
            detail=f"{service:.0f} vs {local:.0f} examples/s (dispatcher and worker in the process, same cores)",
        ),
        common.row(
            "decode/uint8",
            "uint8 batches normalised in the step / float32 normalised on the host",
            r["uint8_vs_float32"],
            f"{r['uint8_vs_float32']:.2f}x",
            detail=f"{norm['uint8']:.0f} vs {norm['float32']:.0f} examples/s through a small step",
        ),
        common.row(
            "decode/bfloat16",
            "bfloat16 batches normalised on the host / float32 normalised on the host",
            r["bfloat16_vs_float32"],
            f"{r['bfloat16_vs_float32']:.2f}x",
            detail=f"{norm['bfloat16']:.0f} vs {norm['float32']:.0f} examples/s through the same step",
        ),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small images, short windows: a smoke test")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args(argv)
    started, load_before = datetime.datetime.now(), os.getloadavg()[0]
    results = measure(args.quick)
    table = rows(results)
    if args.quick:  # a ResNet-8 on 32-pixel crops consumes next to nothing: "keeps up" would always pass
        table = common.not_judged(table)
        print(
            "--quick: a smoke test on small images, short windows and a tiny step: it shows that every row still "
            "measures; no row is judged against its target (run without --quick for verdicts)"
        )
    print(common.format_table(table))
    minutes = (datetime.datetime.now() - started).total_seconds() / 60
    print(
        f"{started:%Y-%m-%d}, {common.machine()}, engine {common.revision()}, "
        f"{minutes:.1f} min, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
