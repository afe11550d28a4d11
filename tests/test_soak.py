"""The soak run's short version: a 2-worker job through a SIGTERM to the chief and one to worker 1, each
followed by a restart, then the same steps uninterrupted. The 30-minute run is in bench/RESULTS.md."""

import re

import pytest

from tests import forkserver

PROCESSES = ("mlp worker 0 (soak)", "mlp worker 1 (soak)", "mlp worker 0 (reference)", "mlp worker 1 (reference)")


def cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_row(output, first_cell):
    rows = [line for line in output.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, output[-4000:])
    return cells(rows[0])


@pytest.mark.slow
def test_short_soak_stops_resumes_exactly_and_nothing_grows(data_dir, tmp_path):
    soak = forkserver.run(
        [
            "-m",
            "bench.soak",
            "--jobs=mlp",
            "--minutes=0.1",  # two legs of 3 s of training each
            "--sample_seconds=1",
            "--warmup_seconds=1",
            f"--workdir={tmp_path / 'soak'}",
            f"--data_dir={data_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = soak.stdout
    assert soak.returncode == 0, out[-4000:] + soak.stderr[-2000:]
    assert out.splitlines()[-1].startswith("soak PASSED")
    for process in (*PROCESSES, "driver"):
        row = table_row(out, process)
        assert row[-1] == "flat" and int(row[1]) >= 2, row  # judged from its samples: nothing grew
    cycles = [cells(line) for line in out.splitlines() if re.match(r"\| mlp \| \d+ \| mlp worker", line)]
    assert [c[1:3] for c in cycles] == [["1", "mlp worker 0"], ["2", "mlp worker 1"]], cycles
    for cycle in cycles:  # every process stopped at one step, which is the newest checkpoint, and exited 75
        assert len(set(cycle[4].split(", "))) == 1 and cycle[4].split(", ")[0] == cycle[5] and cycle[6] == "75, 75"
    weights = [cells(line) for line in out.splitlines() if re.match(r"\| mlp \| \d+ \| \d+ \|", line)]
    assert len(weights) == 1, out[-4000:]
    steps, tensors, differing, worst, result = weights[0][1:]
    # 26 of the models, optimizer and counters, and the actions' own state (engine/state/held.py State.actions).
    assert (tensors, differing, worst, result) == ("27", "0", "0", "bit-equal"), weights
    assert int(steps) == int(cycles[1][5]) + 300  # the final leg: three rounds of 100 steps after the last stop
