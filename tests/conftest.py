"""Every test starts from the process state the suite started with.

A Trainer fit in the pytest process itself (a one-process reference run) leaves Lightning's launch variables in
``os.environ`` (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and its default process group
initialized. A later test that starts a training script as a subprocess would inherit them: its launcher then takes
itself for an already-launched rank 0 and never starts the other processes. So each test's environment variables
are put back, and a process group it left is destroyed, when it ends.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _fresh_process_state():
    environment = dict(os.environ)
    yield
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
