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

import pytest  # noqa: E402

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
