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
    assert [line.split()[-1] for line in lines[5:]] == ["tests/test_b.py::one", "tests/test_a.py::two"]
