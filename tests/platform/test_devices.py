"""The one device helper module: GPU memory phase text."""

from __future__ import annotations

import re

import pytest
import torch

from dflash_ipc.platform.devices import gpu_memory_text


def test_gpu_memory_text_is_empty_on_cpu():
    assert gpu_memory_text("cpu") == ""


@pytest.mark.gpu
def test_gpu_memory_text_reports_this_process_peak_and_the_device_free_memory():
    device = torch.device("cuda:0")
    torch.zeros(1, device=device)  # the caching allocator exists only once this process touched the device
    torch.cuda.reset_peak_memory_stats(device)
    block = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB
    text = gpu_memory_text(device)
    del block
    match = re.fullmatch(r"GPU peak ([\d.]+) GiB allocated, ([\d.]+) GiB reserved; cuda:0 free now ([\d.]+) of ([\d.]+) GiB", text)
    assert match, text
    allocated, reserved, free, total = map(float, match.groups())
    assert 1.0 <= allocated <= reserved
    assert 0 < free < total
