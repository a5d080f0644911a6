"""Whether images decoded into memory fit there, said before they are decoded: a job that
cannot hold them is refused in one line that names the figure and the fix, instead of being
ended by the kernel's OOM killer after minutes of decoding.

What the job may take is the memory available now (the kernel's ``MemAvailable``), or less
where a cgroup memory limit (a container's, a SLURM or Kubernetes job's) leaves less, or what
``data.memory_gb`` says (it replaces both: set it to leave room for other jobs, or to use swap)."""

from pathlib import Path

import psutil

GB = 1e9
CGROUPS = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest multiple of a page

# What loading N images into memory takes besides their pixels, measured on folders of 550 to
# 40,050 JPEGs of 28x28 and 128x128 (docs/performance.md): per image its path, label and survey
# row (about 1 KB); per job the decoding threads' buffers (a few decoded files per core) and one
# chunk of rows moved in place by the validation carve (30-45 MB here), with a margin.
PER_IMAGE_BYTES = 1200
PER_JOB_BYTES = 64 << 20


def memory_stat(folder: Path) -> dict[str, int]:
    lines = (folder / "memory.stat").read_text().splitlines()
    return {key: int(value) for key, value in (line.split() for line in lines)}


def room_v2(mount: Path, path: str) -> list[int]:
    """Bytes left under each limit of a cgroup v2 and its parents (``memory.max`` less what
    the group uses, its inactive file cache counted as free: the kernel drops that first)."""
    folder = mount / path.lstrip("/")
    if not folder.is_dir():  # a container's own cgroup, mounted as the root
        folder = mount
    rooms = []
    while True:
        limit = folder / "memory.max"
        if limit.is_file() and (text := limit.read_text().strip()) != "max":
            used = int((folder / "memory.current").read_text())
            rooms.append(int(text) - used + memory_stat(folder).get("inactive_file", 0))
        if folder == mount:
            return rooms
        folder = folder.parent


def room_v1(mount: Path, path: str) -> list[int]:
    """Bytes left under a cgroup v1 memory limit (its parents' included: the hierarchical
    limit), its inactive file cache counted as free."""
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount
    stat = memory_stat(folder)
    limit = stat.get("hierarchical_memory_limit", NO_LIMIT)
    if limit >= NO_LIMIT:
        return []
    used = int((folder / "memory.usage_in_bytes").read_text())
    return [limit - used + stat.get("total_inactive_file", 0)]


def cgroup_room(cgroups: Path = CGROUPS) -> int | None:
    """Bytes left under this process's cgroup memory limits; None where none is set (or the
    cgroup files cannot be read: not Linux)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        rooms = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if not controllers:  # v2: /sys/fs/cgroup itself, or unified/ beside v1's
                unified = cgroups if (cgroups / "cgroup.controllers").is_file() else None
                unified = unified or cgroups / "unified"
                rooms += room_v2(unified, path) if unified.is_dir() else []
            elif "memory" in controllers.split(","):
                rooms += room_v1(cgroups / "memory", path)
    except (OSError, ValueError):
        return None
    return max(0, min(rooms)) if rooms else None


def memory_for_data(memory_gb: float | None) -> tuple[int, str]:
    """Bytes the data may take on this machine, and where that figure comes from."""
    if memory_gb is not None:
        return int(memory_gb * GB), f"data.memory_gb={memory_gb} allows"
    available = psutil.virtual_memory().available
    room = cgroup_room()
    if room is not None and room < available:
        return room, "left under this job's cgroup memory limit"
    return available, "available on this machine"
