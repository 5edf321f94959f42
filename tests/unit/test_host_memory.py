"""Issue 32, item 4: the offload's host-memory check is bounded by the job's memory cgroup, not
only the node's MemAvailable (mcore/offload.py available_host_bytes): past the job's limit the
OOM killer ends the job however much the node has free. Fake cgroup trees (v2 and v1) and a fake
/proc/meminfo stand in for this machine's."""

from __future__ import annotations

from pathlib import Path

from vapo_megatron.mcore.offload import available_host_bytes, cgroup_available_bytes, host_memory_problem

GIB = 1 << 30


def _meminfo(tmp: Path, gib: int) -> Path:
    path = tmp / "meminfo"
    path.write_text(f"MemTotal:       {4 * gib * 1024 * 1024} kB\nMemAvailable:   {gib * 1024 * 1024} kB\n")
    return path


def _write(d: Path, **files) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name.replace("__", ".")).write_text(f"{value}\n")


def test_cgroup_v2_limit_of_the_job_above_the_step(tmp_path):
    root = tmp_path / "cg"
    job = root / "system.slice" / "slurmstepd.scope" / "job_7"
    _write(job, memory__max=64 * GIB, memory__current=24 * GIB, memory__stat=f"anon 1\ninactive_file {4 * GIB}")
    _write(job / "step_0", memory__max="max", memory__current=20 * GIB)
    (tmp_path / "self").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0\n")
    assert cgroup_available_bytes(root, tmp_path / "self") == 44 * GIB  # 64 - 24 + 4 reclaimable
    got = available_host_bytes(meminfo=_meminfo(tmp_path, 500), cgroup_root=root, self_cgroup=tmp_path / "self")
    assert got == (44 * GIB, "the job's cgroup memory limit")
    # A node with less available than the job's limit allows: the node bounds it.
    got = available_host_bytes(meminfo=_meminfo(tmp_path, 30), cgroup_root=root, self_cgroup=tmp_path / "self")
    assert got == (30 * GIB, "MemAvailable")


def test_cgroup_v1_memory_controller(tmp_path):
    root = tmp_path / "cg"
    job = root / "memory" / "slurm" / "uid_1" / "job_7"
    _write(job, memory__limit_in_bytes=32 * GIB, memory__usage_in_bytes=8 * GIB,
           memory__stat=f"cache 5\ntotal_inactive_file {2 * GIB}")
    _write(job / "step_0", memory__limit_in_bytes=9223372036854771712, memory__usage_in_bytes=8 * GIB)
    (tmp_path / "self").write_text("5:cpuacct,cpu:/slurm/uid_1/job_7/step_0\n4:memory:/slurm/uid_1/job_7/step_0\n")
    assert cgroup_available_bytes(root, tmp_path / "self") == 26 * GIB


def test_no_limit_or_no_cgroup_files_leaves_memavailable(tmp_path):
    root = tmp_path / "cg"
    _write(root / "user.slice", memory__max="max", memory__current=GIB)
    (tmp_path / "self").write_text("0::/user.slice\n")
    assert cgroup_available_bytes(root, tmp_path / "self") is None
    assert cgroup_available_bytes(root, tmp_path / "absent") is None
    assert available_host_bytes(meminfo=_meminfo(tmp_path, 100), cgroup_root=root,
                                self_cgroup=tmp_path / "self") == (100 * GIB, "MemAvailable")


def test_the_message_names_what_bounds_the_memory():
    msg = host_memory_problem([("n0", 48 * GIB, 50 * GIB, "the job's cgroup memory limit")])
    assert msg is not None and "50.0 GiB available (the job's cgroup memory limit" in msg
    assert host_memory_problem([("n0", 10 * GIB, 50 * GIB, "the job's cgroup memory limit")]) is None


def test_this_machine_answers():
    n, source = available_host_bytes()
    assert n > 0 and source in ("MemAvailable", "the job's cgroup memory limit")
