"""Suite-wide settings.

torch runs single-threaded: the suite's stacks are tiny (a step is far below a millisecond of
work), and on a small machine (2 cores) torch's OpenMP threads fight XLA's thread pool and
each other for the cores: up to ~5x slower, and timings that say nothing.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
