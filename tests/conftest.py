"""Test-suite set-up: Triton kernels run in Triton's interpreter on a machine without a GPU.

Triton decides at decoration time whether a kernel is built for the interpreter, so the variable is set
here, before any test module imports a kernel. Tests run on the PyTorch path unless marked
``@pytest.mark.triton``, which runs them with foxlm's default dispatch (Triton for CUDA tensors and,
under the interpreter, for CPU tensors): the real kernels are tested at small sizes, while model and
trainer tests keep the fast CPU path.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

from foxlm.data import prepare  # noqa: E402
from foxlm.data.assets import shakespeare_plays  # noqa: E402
from foxlm.ops import use_backend  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: run on foxlm's Triton kernels (the interpreter on CPU)")


@pytest.fixture
def device() -> str:
    """Where op tests build their tensors: the GPU when there is one (the real kernels), else the CPU (the
    interpreter under ``@pytest.mark.triton``)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _backend(request: pytest.FixtureRequest):
    with use_backend("auto" if request.node.get_closest_marker("triton") else "torch"):
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP threads crawl on a busy CPU; a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    """Three Shakespeare plays, prepared with the byte tokenizer (one held out)."""
    out = tmp_path_factory.mktemp("data") / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 3), out, tokenizer="byte", val_fraction=0.34, workers=0,
            progress=False)
    return out
