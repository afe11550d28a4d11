"""Two logical CPU devices for the whole test process, set before any TensorFlow op runs, so one_device
and mirrored runs share a process. Multi-worker runs are separate processes (tests/helpers.run_workers)."""

import atexit
import collections
import fcntl
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# A cluster job's TF_CONFIG, left set in the shell that runs the tests, is no test's: each that needs one sets its own
# (it chose a strategy for the tests' runs, and a --local_workers launcher said it ignores it, a line more).
os.environ.pop("TF_CONFIG", None)


# XLA's compiled programs, kept for the test session in one directory that its worker processes (pytest -n 3
# starts them after this file is read, with this environment) and every process they start (launch.py, worker
# processes) share. Most tests train the same few small models: the first compilation of each program is XLA's
# work, the others read it back. The cache is keyed by the program itself, so each test runs the program it would
# have compiled.
if not os.environ.get("PYTEST_XDIST_WORKER") and "ENGINE_TESTS_XLA_CACHE" not in os.environ:
    os.environ["ENGINE_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="engine-tests-xla-")
    # Removed when this process ends, after its worker processes: also when the session stops on a usage error.
    atexit.register(shutil.rmtree, os.environ["ENGINE_TESTS_XLA_CACHE"], True)
if "ENGINE_TESTS_XLA_CACHE" in os.environ:
    _flags = os.environ.get("TF_XLA_FLAGS", "")
    if "tf_xla_persistent_cache_directory" not in _flags:
        _cache = os.environ["ENGINE_TESTS_XLA_CACHE"]
        os.environ["TF_XLA_FLAGS"] = f"{_flags} --tf_xla_persistent_cache_directory={_cache}".strip()

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import forkserver, helpers  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
forkserver.one_thread_per_op()


def pytest_collection_modifyitems(config, items):
    """Modules with the most `slow` tests (multi-process jobs, long runs) first, the rest in their order: the
    workers of `pytest -n 3` take whole modules in this order, so the long ones start early and the short ones
    fill in beside them instead of the run ending on one long module."""
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A tensorflow-datasets directory with the bundled digits prepared once for the session."""
    import tensorflow_datasets as tfds

    import sources.digits  # noqa: F401
    from engine.data.tfds_source import no_leftover_folders

    path = str(tmp_path_factory.mktemp("tfds"))
    with no_leftover_folders():  # tfds leaves an empty folder in /tmp otherwise
        builder = tfds.builder("digits", data_dir=path)
    builder.download_and_prepare()
    return path


@pytest.fixture(scope="session")
def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.fixture(scope="session")
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def built_once(tmp_path_factory, name, build):
    """A directory `build(path)` fills once for the whole test session: under `pytest -n 3` the first worker
    process to ask builds it while the others wait on a lock, then all read it (a module fixture would build it
    once per worker process that runs a module needing it). A build that failed fails the other asker too, with
    its message, instead of building again over what it left."""
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker basetemp/../popen-gwN; the parent is this session's alone. Without xdist, basetemp is.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.exists():
            pytest.fail(f"building {name} failed in another test process:\n{failed.read_text()}")
        if not done.exists():
            path.mkdir(exist_ok=True)
            try:
                build(path)
            except BaseException as e:
                failed.write_text(str(e)[-3000:])
                raise
            done.touch()
    return path


@pytest.fixture(scope="session")
def multi_worker_dir(data_dir, tmp_path_factory):
    """Two localhost worker processes run every parity case and the non-finite scenario once for the session."""

    def build(out):
        results = helpers.run_workers(["tests/mw_worker.py", str(out), data_dir], count=2, timeout=600)
        for code, output in results:
            assert code == 0, output[-3000:]

    return built_once(tmp_path_factory, "multi_worker", build)
