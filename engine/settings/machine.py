"""What this machine holds, read without TensorFlow: its memory (or its container's limit) and its GPUs' memory."""

import math
import shutil
import subprocess

CGROUP_ROOT, OWN_CGROUPS = "/sys/fs/cgroup", "/proc/self/cgroup"  # where cgroups are mounted; this process's


def host_memory_bytes():
    """This machine's memory, or the lowest memory limit of this process's cgroups where that is lower: its
    container's (a Kubernetes pod's), or the cgroup a scheduler or systemd put it in (a Slurm job's --mem, a
    MemoryMax scope), each of its ancestors too."""
    import psutil  # deferred: only the memory checks need it

    total = psutil.virtual_memory().total
    for path in _memory_limit_files():
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():  # v2 writes "max" for none
            total = min(total, int(limit))
    return total


def _memory_limit_files():
    """The files that may hold a memory limit of this process: the mount's own (a container's, whose cgroup is the
    mount's root), then those of the cgroup /proc/self/cgroup names and its ancestors, cgroup v2 and v1."""
    files = [f"{CGROUP_ROOT}/memory.max", f"{CGROUP_ROOT}/memory/memory.limit_in_bytes"]  # cgroup v2, v1
    try:
        with open(OWN_CGROUPS) as f:
            lines = f.read().splitlines()
    except OSError:
        return files
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        parts = [p for p in path.split("/") if p and p != ".."]
        if hierarchy == "0" and not controllers:  # v2's unified hierarchy
            folder, name = CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            folder, name = f"{CGROUP_ROOT}/memory", "memory.limit_in_bytes"
        else:
            continue
        files += ["/".join([folder, *parts[:depth], name]) for depth in range(1, len(parts) + 1)]
    return files


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
