"""tests/forkserver.py: a forked child behaves as the `python script` it stands for, and what a fork cannot give
runs as a plain subprocess."""

import os
import signal
import subprocess
import sys
import textwrap

from tests import forkserver

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
    print(os.getpid(), os.getcwd(), os.environ.get("TF_CONFIG"), sys.argv[1:], __name__)
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
    """
)


def _script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_forked_child_runs_the_script_as_main_and_exits_as_python_would(tmp_path):
    before = forkserver.CHILD_CPU[0]
    env = {**os.environ, "TF_CONFIG": '{"task":1}'}
    result = forkserver.run(
        [_script(tmp_path), "3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert isinstance(result, subprocess.CompletedProcess) and result.returncode == 3
    first, *rest = result.stdout.splitlines()
    pid, cwd, tf_config, argv, name = first.split()
    assert int(pid) != os.getpid() and cwd == str(tmp_path) and tf_config == '{"task":1}'
    assert argv == "['3']" and name == "__main__"
    assert rest == ["thread joined", "atexit ran"]  # non-daemon threads joined, then the atexit handlers
    assert result.stderr == "to stderr\n"
    assert forkserver.CHILD_CPU[0] > before  # its CPU time reported for tests/cpu_usage.py


def test_a_killed_child_reports_the_signal(tmp_path):
    proc = forkserver.popen([_script(tmp_path), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert isinstance(proc, forkserver.Process)
    line = proc.stdout.readline()
    assert line.split()[0] == str(proc.pid) and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and err is None


def test_a_timeout_raises_as_subprocess_does_and_the_child_can_still_be_ended(tmp_path):
    proc = forkserver.popen([_script(tmp_path), "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.communicate(timeout=0.5)
        raise AssertionError("communicate returned before the child ended")
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and out.startswith(str(proc.pid).encode()) and err == b"to stderr\n"


def test_what_a_fork_cannot_give_runs_as_a_plain_subprocess(tmp_path):
    # A variable TensorFlow may read at its import differs from the server's, or a preexec_fn is asked for.
    for kwargs in ({"env": {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0"}}, {"preexec_fn": os.getpid}):
        proc = forkserver.popen([_script(tmp_path), "0"], stdout=subprocess.PIPE, **kwargs)
        assert isinstance(proc, subprocess.Popen) and proc.args[0] == sys.executable
        proc.communicate(timeout=120)
        assert proc.returncode == 0
