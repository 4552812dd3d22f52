"""What this process can still allocate: memory control groups and RLIMIT_AS."""

import subprocess
import sys
from pathlib import Path

import pytest

from vivit.gram.memory import cgroup_headroom

MiB = 2**20


def write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_cgroup_v2_limits_of_the_group_and_its_ancestors(tmp_path):
    """A container's 8 GiB, 1 GiB of it used (256 MiB reclaimable page cache)."""
    membership = tmp_path / "cgroup"
    membership.write_text("0::/user/job\n")
    root = tmp_path / "fs"
    write(root, {"memory.max": "max\n", "memory.current": "123\n"})
    write(root / "user", {"memory.max": str(16 * 2**30), "memory.current": "0"})
    write(
        root / "user" / "job",
        {
            "memory.max": str(8 * 2**30),
            "memory.current": str(2**30),
            "memory.stat": f"anon 1\ninactive_file {256 * MiB}\n",
        },
    )
    headroom = cgroup_headroom(root, membership)
    assert sorted(headroom) == [7 * 2**30 + 256 * MiB, 16 * 2**30]


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    membership = tmp_path / "cgroup"
    membership.write_text("5:cpu,cpuacct:/\n4:memory:/job\n")
    memory = tmp_path / "fs" / "memory"
    write(
        memory / "job",
        {
            "memory.limit_in_bytes": str(2**30),
            "memory.usage_in_bytes": str(300 * MiB),
            "memory.stat": f"cache 5\ntotal_inactive_file {100 * MiB}\n",
        },
    )
    write(
        memory,
        {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"},
    )
    assert cgroup_headroom(tmp_path / "fs", membership) == [824 * MiB]
    assert cgroup_headroom(tmp_path / "fs", tmp_path / "missing") == []


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux /proc")
def test_address_space_limit_counts():
    """Under ``ulimit -v`` only the limit less the address space in use is left,
    however much memory the machine has free."""
    script = (
        "import resource, torch\n"
        "from vivit.gram.memory import available_bytes, _read_fields\n"
        "from pathlib import Path\n"
        "used = _read_fields(Path('/proc/self/status'))['VmSize']\n"
        "limit = used + 300 * 2**20\n"
        "resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))\n"
        "print(available_bytes(torch.device('cpu')))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    assert 250 * MiB < int(output) <= 300 * MiB


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux /proc")
def test_resident_bytes_follow_an_allocation():
    """Touching 64 MiB of fresh pages raises the resident set by about that much.

    Runs in a fresh interpreter: in the suite's process the allocator may hand
    back pages an earlier test freed and that are still resident.
    """
    script = (
        "import torch\n"
        "from vivit.gram.memory import available_bytes, resident_bytes\n"
        "cpu = torch.device('cpu')\n"
        "before = resident_bytes(cpu)\n"
        f"block = torch.ones({64 * MiB // 4})\n"
        "print(resident_bytes(cpu) - before, available_bytes(cpu))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    grown, available = map(int, output.split())
    assert grown > 60 * MiB
    assert available > 0
