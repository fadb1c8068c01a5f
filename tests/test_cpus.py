"""Threads that fit the CPUs a process really has (nbkv.llama.cpus): fake /proc and /sys trees."""

from __future__ import annotations

import os

import pytest

from nbkv.llama.cpus import CpuBudget, cgroup_quota, cpu_budget

V1_MOUNTINFO = (
    "25 30 0:23 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
    "31 25 0:27 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "32 25 0:28 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n")


def tree(tmp_path, files):
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_v2_quota_in_a_container_with_its_own_namespace(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n",
                           "sys/fs/cgroup/cpu.max": "150000 100000\n"})
    assert cgroup_quota(root) == (1.5, "/sys/fs/cgroup")
    b = cpu_budget(root, affinity=16, cores=16)
    assert b.quota == 1.5 and b.threads == 2  # rounded up: the quota's time runs in parallel
    assert "quota of 1.5" in b.describe() and "2 (" in b.describe()


def test_v2_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tree(tmp_path, {
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "50000 100000\n",  # the pod's limit: 0.5
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "200000 100000\n",
    })
    assert cgroup_quota(root) == (0.5, "/sys/fs/cgroup/kubepods/pod1")
    assert cpu_budget(root, affinity=64, cores=64).threads == 1


def test_v2_no_quota_and_a_host_path_the_container_does_not_have(tmp_path):
    # no cgroup namespace: /proc says the host's path, the container mounts its own cgroup
    root = tree(tmp_path, {"proc/self/cgroup": "0::/system.slice/docker-abc.scope\n",
                           "sys/fs/cgroup/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) == (None, "")
    root = tree(tmp_path, {"sys/fs/cgroup/cpu.max": "300000 100000\n"})
    assert cgroup_quota(root)[0] == 3.0


def test_v1_cfs_quota(tmp_path):
    root = tree(tmp_path, {
        "proc/self/cgroup": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        "proc/self/mountinfo": V1_MOUNTINFO.format(root="/docker/abc"),
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(root) == (2.0, "/sys/fs/cgroup/cpu,cpuacct")
    assert cpu_budget(root, affinity=8, cores=8).threads == 2


def test_v1_nested_and_unlimited(tmp_path):
    root = tree(tmp_path, {
        "proc/self/cgroup": "4:cpuacct,cpu:/user/job\n",
        "proc/self/mountinfo": V1_MOUNTINFO.format(root="/"),
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/user/cpu.cfs_quota_us": "400000\n",
        "sys/fs/cgroup/cpu,cpuacct/user/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/user/job/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/user/job/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(root) == (4.0, "/sys/fs/cgroup/cpu,cpuacct/user")


def test_the_affinity_mask_when_it_is_smaller(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n",
                           "sys/fs/cgroup/cpu.max": "400000 100000\n"})
    b = cpu_budget(root, affinity=2, cores=16)
    assert b.threads == 2 and "affinity mask allows 2" in b.describe()
    assert CpuBudget(8).describe() == "8 (every core)"


def test_no_cgroups_at_all(tmp_path):
    assert cgroup_quota(tmp_path) == (None, "")
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n",
                           "sys/fs/cgroup/cpu.max": "garbage\n"})
    assert cpu_budget(root, affinity=3, cores=4).threads == 3


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_this_process_and_the_engines_default():
    from nbkv.llama.backend import default_threads

    b = cpu_budget()
    assert 1 <= b.threads <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)
    assert default_threads() == b.threads
