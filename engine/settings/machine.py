"""What this machine holds, read without TensorFlow: its memory (or its container's limit) and its GPUs' memory."""

import math
import shutil
import subprocess


def host_memory_bytes():
    """This machine's memory, or its container's limit where that is lower (a Kubernetes pod's, say)."""
    import psutil  # deferred: only the memory checks need it

    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():  # v2 writes "max" for none
            total = min(total, int(limit))
    return total


def gpu_memory_bytes():
    """The memory of this machine's smallest NVIDIA GPU, as its driver's nvidia-smi reports it (every replica of a
    mirrored run holds a whole model); None where nvidia-smi is missing or answers nothing."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return None
    try:
        listed = subprocess.run(
            [command, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [int(line) for line in listed.stdout.split() if line.strip().isdigit()]
    return min(sizes) * 2**20 if listed.returncode == 0 and sizes else None  # MiB


def human_bytes(count):
    """A byte count as people read it: 1.44 TB, 615 MB."""
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB")  # past 1000 EB: 1.5e+06 EB
    power = min(int(math.log10(max(count, 1)) // 3), len(units) - 1)
    value = count / 1000**power
    return f"{value:.3g} {units[power]}"
