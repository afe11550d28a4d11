"""tests/cpu_usage.py, the suite's CPU report: its sums and its order."""

from tests import cpu_usage


def test_the_report_sums_each_module_and_orders_by_cost():
    records = [
        {"test": "tests/test_a.py::one", "own": 1.0, "children": 0.5, "wall": 2.0},
        {"test": "tests/test_a.py::two", "own": 2.0, "children": 0.0, "wall": 2.0},
        {"test": "tests/test_b.py::one", "own": 0.5, "children": 9.0, "wall": 5.0},
    ]
    lines = cpu_usage.summary(records, shown=2)
    assert lines[0] == (
        "CPU-seconds of 3 tests: 13 (4 in pytest's processes, 10 in processes the tests started; "
        "start-up and collection not included)"
    )
    assert lines[2].split() == ["9.5", "0.5", "9.0", "1", "tests/test_b.py"]
    assert lines[3].split() == ["3.5", "3.0", "0.5", "2", "tests/test_a.py"]
    assert lines[4] == "the 2 costliest tests:"
    assert [line.split()[-1] for line in lines[5:7]] == ["tests/test_b.py::one", "tests/test_a.py::two"]
    # Wall time beyond CPU time: test_b.py::one ran 9.5 CPU-s in 5 s (none beyond), test_a.py::one 1.5 in 2.
    assert lines[7] == "the 2 tests with the most wall time beyond their CPU time:"
    assert [line.split() for line in lines[9:]] == [
        ["0.5", "2.0", "1.5", "tests/test_a.py::one"],
        ["0.0", "2.0", "2.0", "tests/test_a.py::two"],
    ]


def test_the_report_says_how_long_each_test_process_held_no_test():
    records = [
        {"test": "tests/test_a.py::one", "own": 1.0, "children": 0.0, "wall": 4.0, "worker": "gw0", "start": 100.0},
        {"test": "tests/test_a.py::two", "own": 1.0, "children": 0.0, "wall": 3.0, "worker": "gw0", "start": 105.0},
        {"test": "tests/test_b.py::one", "own": 1.0, "children": 0.0, "wall": 12.0, "worker": "gw1", "start": 101.0},
    ]
    lines = cpu_usage.summary(records, shown=1)
    at = lines.index("test processes over the 13 s from the first test's start to the last one's end:")
    # gw0: 7 s of tests in the 13 s, a gap of 1 s between its two, and 5 s after its last (108 to 113).
    assert lines[at + 1] == "  gw0: 2 tests, 7 s running them, idle 6 s (5 s of it after its last test)"
    assert lines[at + 2] == "  gw1: 1 tests, 12 s running them, idle 1 s (0 s of it after its last test)"
