"""Every test starts from the process state the suite started with.

A Trainer fit in the pytest process itself (a one-process reference run) leaves Lightning's launch variables in
``os.environ`` (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and its default process group
initialized. A later test that starts a training script as a subprocess would inherit them: its launcher then takes
itself for an already-launched rank 0 and never starts the other processes. So each test's environment variables
are put back, and a process group it left is destroyed, when it ends.

This process computes on one thread, as every rank does (``tests/launch.py``): its one-process reference runs and
in-process tests work on tensors far too small to gain from intra-op threads, which only add OpenMP's fork and join
and, while the ranks a test launched keep the cores busy, a wait for a thread that is not running (measured on 2
cores: a 10-step reference of the tiny mixture of experts took 2.6-4.7 s on 2 threads, 0.25 s on 1).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_process_state():
    environment = dict(os.environ)
    yield
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
