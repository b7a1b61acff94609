import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (real model weights)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="module")
def fops():
    """fsd_ext.ops for the CUDA tests (test_cuda.py, test_cuda_launch.py)."""
    from fsd_ext import ops

    ops._ops()  # raises ImportError with a clear message when the extension is not built
    return ops


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one thread (no OpenMP hand-offs), above all on a busy machine.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
