"""The soak run: long jobs through periodic checkpoints and SIGTERM-restart cycles, watching every process.

    nice python -m bench.soak --minutes=30     # the table in bench/RESULTS.md (about 70 min in all)
    python -m bench.soak --jobs=mlp --minutes=0.1 --sample_seconds=1 --warmup_seconds=1   # tests/test_soak.py

Two jobs run side by side: a 2-worker multi_worker job (MLP 32,32 on the bundled digits; its workers are
started here with TF_CONFIG on localhost ports, as engine/cluster/launcher.py does, so each has a pid to sample and to
signal) and a mirrored one (2 logical CPUs, a tiny ResNet with synchronized batch norm on synthetic data).
Each trains for --minutes in --cycles legs. A leg ends with SIGTERM to one process, as a scheduler preempting
tasks one by one sends it: the multi-worker job's chief in odd cycles, worker 1 in even ones. Every process of
the job must then stop at the same step, save it and exit 75, and the same command must resume from exactly
that step. After the last cycle each job resumes once more and finishes a few rounds; an uninterrupted run of
the same steps (--deterministic, as the soaked run) must end with a bit-equal checkpoint: weights, optimizer
slots, counters. Start-ups, stops and that check come on top of --minutes (the check about as long again).

Every --sample_seconds, each live process's threads, RSS and open files (/proc/<pid>) are recorded. Growth
per hour is the slope fitted over each process's samples once it has trained for --warmup_seconds, pooled
over its restarts (each pid keeps its own intercept: a restart resets what a leak piled up, not its rate).

Exit code 0 when every cycle stopped and resumed exactly, nothing grew without bound and the weights matched;
1 otherwise, with the reasons last. Everything (each process's log of each leg, checkpoints) stays in --workdir.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np

from bench.common import ROOT
from bench.soak_job import JOBS, Job, cycle_table, latest_checkpoint
from bench.soak_samples import Sampler, growth_table, time_table


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="training time of each job, over all its legs")
    parser.add_argument("--cycles", type=int, default=0, help="SIGTERM-restart cycles per job; 0: one per 5 min, 2+")
    parser.add_argument("--sample_seconds", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup_seconds", type=float, default=60.0, help="training left out of the growth fits")
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs to run: " + ", ".join(JOBS))
    parser.add_argument("--workdir", default="", help="where runs and logs go; empty: a new temporary directory")
    parser.add_argument("--data_dir", default="", help="tensorflow-datasets directory; empty: <workdir>/data")
    parser.error = lambda message: parser.exit(2, f"error: {message}\n")  # one line, as launch.py's errors
    args = parser.parse_args(argv)

    def bad(flag, why):
        parser.exit(2, f"error: --{flag}={getattr(args, flag)}: {why}\n")

    if not args.minutes > 0:
        bad("minutes", "must be a positive number")
    if args.cycles < 0:
        bad("cycles", "must be zero or positive")
    if not args.sample_seconds > 0:
        bad("sample_seconds", "must be a positive number")
    if not args.warmup_seconds >= 0:
        bad("warmup_seconds", "must be zero or positive")
    if not args.jobs or any(j not in JOBS for j in args.jobs.split(",")):
        bad("jobs", f"must name some of {', '.join(JOBS)}")
    args.jobs = args.jobs.split(",")
    args.cycles = args.cycles or max(2, round(args.minutes / 5))
    if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
        bad("workdir", "exists and is not empty (a soak starts from nothing)")
    return args


def compare_weights(soaked, reference):
    """(tensors, differing, max abs difference) between the newest checkpoints of two workdirs. Run in a
    child process: TensorFlow in this one would add its few hundred MiB to the driver's sampled RSS."""
    code = f"from bench.soak import _compare; print(_compare({soaked!r}, {reference!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def _compare(*workdirs):
    import tensorflow as tf

    tensors = []
    for workdir in workdirs:
        directory = os.path.join(workdir, "checkpoints")
        reader = tf.train.load_checkpoint(os.path.join(directory, f"ckpt-{latest_checkpoint(directory)}"))
        names = [n for n in reader.get_variable_to_shape_map() if "save_counter" not in n]
        tensors.append({n: reader.get_tensor(n) for n in names})
    soaked, reference = tensors
    if soaked.keys() != reference.keys():
        return json.dumps([len(reference), len(soaked.keys() ^ reference.keys()), None])
    differing = [n for n in soaked if not np.array_equal(soaked[n], reference[n])]
    worst = max((float(np.max(np.abs(soaked[n].astype(float) - reference[n]))) for n in differing), default=0.0)
    return json.dumps([len(soaked), len(differing), worst])


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def prepare_data(data_dir):
    """The bundled digits, prepared once: workers that prepare them at the same time would race."""
    code = (
        "import sources.digits, tensorflow_datasets as tfds\nfrom engine.data.tfds_source import no_leftover_folders\n"
        "with no_leftover_folders():\n    builder = tfds.builder('digits', data_dir=%r)\nbuilder.download_and_prepare()"
    )
    subprocess.run([sys.executable, "-c", code % data_dir], cwd=ROOT, check=True, capture_output=True)


def main(argv=None):
    args = parse_args(argv)
    root = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    try:
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    except OSError as e:
        print(f"error: --workdir={args.workdir}: cannot write there ({e.strerror})", file=sys.stderr)
        return 2
    data_dir = args.data_dir or os.path.join(root, "data")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    sampler = Sampler(args.sample_seconds)

    def say(text):
        print(f"[{sampler.now() / 60:5.1f} min] {text}", flush=True)

    say(
        f"soak of {', '.join(args.jobs)} for {args.minutes:g} min: {args.cycles} SIGTERM-restart cycles each, "
        f"a sample every {args.sample_seconds:g} s, fits after {args.warmup_seconds:g} s of each process; {root}"
    )
    if "mlp" in args.jobs and not args.data_dir:
        prepare_data(data_dir)
    jobs = [Job(name, root, data_dir, sampler, say) for name in args.jobs]
    threading.Thread(target=sampler.run, daemon=True).start()
    if not soak_all(jobs, args, root, sampler):
        print(f"error: the soak was interrupted; its runs and logs are in {root}", file=sys.stderr)
        return 130
    sampler.done.set()
    sampler.sample()  # the driver's state at the end
    return report(jobs, sampler, args, root)


def soak_all(jobs, args, root, sampler):
    """Soaks the jobs side by side, each compared with its uninterrupted run at the end; False when SIGTERM or
    Ctrl-C interrupted the soak (its runs killed)."""
    seconds = args.minutes * 60

    def soak(job):
        try:
            job.final_step = job.soak(args.cycles, seconds / args.cycles)
        except Exception as e:  # a bug here: still report what was measured, and fail
            job.fail(f"the soak itself failed: {e!r}")
        if job.final_step is not None:
            try:
                job.compared = compare_weights(*(os.path.join(root, f"{job.name}-{p}") for p in ("soak", "reference")))
            except subprocess.CalledProcessError as e:
                job.fail(f"could not compare the checkpoints: {(e.stderr.strip().splitlines() or ['?'])[-1]}")

    # A soak stopped by SIGTERM or Ctrl-C must not leave its open-ended jobs training.
    signal.signal(signal.SIGTERM, _interrupt)
    threads = [threading.Thread(target=soak, args=(job,), daemon=True) for job in jobs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        for pid in sampler.children():
            os.kill(pid, signal.SIGKILL)
        return False
    return True


def report(jobs, sampler, args, root):
    """Prints the samples, the growth, the cycles and the final weights' comparison; returns the exit code: 1 with
    the reasons last when anything failed."""
    print("\nSamples: leg (L1.. soaked legs, F the final one), state, threads / RSS MiB / open files\n")
    print("\n".join(time_table(sampler)))
    print(
        f"\nGrowth per hour: slope after {args.warmup_seconds:g} s of each process's training, pooled over restarts\n"
    )
    lines, grew, unjudged = growth_table(sampler, args.warmup_seconds)
    print("\n".join(lines))
    print("\nSIGTERM-restart cycles\n")
    print("\n".join(cycle_table(jobs)))
    print("\nFinal weights: soaked run vs an uninterrupted run of the same steps (--deterministic)\n")
    print("| job | steps | tensors | differing | max abs difference | result |\n|---|---|---|---|---|---|")
    failures = [f for job in jobs for f in job.failures] + [f"grows without bound: {g}" for g in grew]
    failures += [f"too few samples after warm-up to judge growth: {name}" for name in unjudged]
    for job in jobs:
        compared = job.compared
        if compared is None:
            print(f"| {job.name} | {job.final_step or '-'} | - | - | - | not compared: the runs failed |")
            continue
        count, differing, worst = compared  # worst is None when the checkpoints hold different tensors
        print(
            f"| {job.name} | {job.final_step} | {count} | {differing} | {'-' if worst is None else f'{worst:.3g}'} "
            f"| {'bit-equal' if not differing else 'DIFFERENT'} |"
        )
        if differing:
            failures.append(f"{job.name}: {differing} of {count} tensors differ from the uninterrupted run")
    print()
    if failures:
        print("soak FAILED:\n" + "\n".join(f"- {f}" for f in failures))
        return 1
    print(f"soak PASSED in {sampler.now() / 60:.1f} min; runs and logs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
