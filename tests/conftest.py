"""Two logical CPU devices for the whole test process, set before any TensorFlow op runs, so one_device
and mirrored runs share a process. Multi-worker runs are separate processes (tests/helpers.run_workers)."""

import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import helpers  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


def pytest_collection_modifyitems(config, items):
    """Modules with the most `slow` tests (multi-process jobs, long runs) first, the rest in their order: the
    workers of `pytest -n 2` take whole modules in this order, so the long ones start early and the short ones
    fill in beside them instead of the run ending on one long module."""
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A tensorflow-datasets directory with the bundled digits prepared once for the session."""
    import tensorflow_datasets as tfds

    import engine.digits  # noqa: F401

    path = str(tmp_path_factory.mktemp("tfds"))
    tfds.builder("digits", data_dir=path).download_and_prepare()
    return path


@pytest.fixture(scope="session")
def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.fixture(scope="session")
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(scope="session")
def multi_worker_dir(data_dir, tmp_path_factory):
    """Two localhost worker processes run every parity case and the non-finite scenario once."""
    out = tmp_path_factory.mktemp("multi_worker")
    results = helpers.run_workers(["tests/mw_worker.py", str(out), data_dir], count=2, timeout=600)
    for code, output in results:
        assert code == 0, output[-3000:]
    return out
