"""Claiming the shared-memory plane's pages, in one process (the jobs are in
tests/integration/test_hostile_shm.py)."""

from __future__ import annotations

import mmap
import os
import subprocess

import numpy as np
import pytest

from syncdp.base import mpi
from syncdp.transport import shm


def _mapped(path, size):
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    os.unlink(path)  # as Open MPI does once every rank mapped the window
    view = mmap.mmap(fd, size)
    os.close(fd)
    return view


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_fallocate_reserves_an_unlinked_mapping(tiny_tmpfs):
    # The path taken before Linux 5.14 (no MADV_POPULATE_WRITE).
    view = _mapped(tiny_tmpfs / "window", 512 << 10)
    address = np.frombuffer(view, np.uint8).ctypes.data
    assert shm._fallocate_mapping(address + 4096, 256 << 10) is None
    assert os.statvfs(tiny_tmpfs).f_bfree * os.statvfs(tiny_tmpfs).f_frsize <= (768 << 10)


def test_fallocate_says_when_the_filesystem_is_full(tiny_tmpfs):
    view = _mapped(tiny_tmpfs / "window", 4 << 20)  # four times the filesystem
    address = np.frombuffer(view, np.uint8).ctypes.data
    assert shm._fallocate_mapping(address, 4 << 20) == os.strerror(28)  # ENOSPC


def test_a_plane_claims_its_pages_through_either_path(monkeypatch):
    plane = shm.SharedPlane(mpi.load().COMM_SELF, segment_bytes=64 << 10)
    try:
        assert plane.claim() is None  # madvise(MADV_POPULATE_WRITE)
        monkeypatch.setattr(shm, "_MADV_POPULATE_WRITE", 999)  # EINVAL, as before Linux 5.14
        assert plane.claim() is None  # the fallback: one process's window is private memory
    finally:
        plane.close()


def test_the_check_looks_where_open_mpi_puts_the_window(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_osc_sm_backing_directory", raising=False)
    assert shm.backing_dir() == "/dev/shm"
    monkeypatch.setenv("OMPI_MCA_osc_sm_backing_directory", "/scratch/shm")
    assert shm.backing_dir() == "/scratch/shm"
