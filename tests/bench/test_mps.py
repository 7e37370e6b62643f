"""bench/mps.py: whether the CUDA MPS control daemon serves this machine (its pipe, its servers)."""

from __future__ import annotations

import os

from dflash_ipc.bench.mps import DEFAULT_PIPE_DIR, mps_status, parse_server_list


def test_server_list_lines_become_pids():
    assert parse_server_list("1234\n  5678 \n\n") == [1234, 5678]
    assert parse_server_list("Cannot find MPS control daemon process\n") == []


def test_a_control_pipe_in_the_pipe_directory_means_active(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), "PATH": ""}  # no control command: no server list
    assert mps_status(env) == {"active": False, "pipe_dir": str(tmp_path), "servers": []}
    (tmp_path / "control").write_text("")  # a plain file is not the daemon's pipe
    assert mps_status(env)["active"] is False
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert mps_status(env) == {"active": True, "pipe_dir": str(tmp_path), "servers": []}


def test_the_default_pipe_directory_is_nvidias():
    assert mps_status({"PATH": ""})["pipe_dir"] == DEFAULT_PIPE_DIR == "/tmp/nvidia-mps"
