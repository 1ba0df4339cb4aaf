"""Test-suite set-up: Triton kernels run in Triton's interpreter on a machine without a GPU.

Triton decides at decoration time whether a kernel is built for the interpreter, so the variable is set
here, before any test module imports a kernel. Tests run on the PyTorch path unless marked
``@pytest.mark.triton``, which runs them with foxlm's default dispatch (Triton for CUDA tensors and,
under the interpreter, for CPU tensors): the real kernels are tested at small sizes, while model and
trainer tests keep the fast CPU path. A ``triton`` test that takes the ``device`` fixture and launches no Triton
kernel fails, so that on a GPU machine a test whose tensors stayed on the CPU cannot pass on the PyTorch path
unnoticed.

``@pytest.mark.gpu`` marks a test that needs a CUDA GPU (skipped without one); the tests that run on the GPU
when there is one (``triton`` tests, and those taking the ``device`` fixture) get the marker too, so
``pytest -m gpu`` selects everything a GPU changes (``.ci/gpu`` runs them first).
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
from foxlm.ops.backend import triton  # noqa: E402

if triton is not None:
    # foxlm imports its forgetting-attention kernels at their first call; imported here, they are built for the
    # interpreter whatever a test does to the variable later (the benchmark tests unset it to import the scripts)
    import foxlm.ops.forgetting_attention.triton_op  # noqa: E402, F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: run on foxlm's Triton kernels (the interpreter on CPU)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU, or runs on it when there is one (see tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu"):
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif item.get_closest_marker("triton") or "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Count the Triton kernel launches (compiled or interpreted) of a ``triton`` test on ``device``; none is a
    failure."""
    if triton is None or not item.get_closest_marker("triton") or "device" not in getattr(item, "fixturenames", ()):
        return (yield)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counting(run):
        def wrapped(self, *args, **kwargs):
            launches.append(1)
            return run(self, *args, **kwargs)
        return wrapped

    for cls, run in originals.items():
        cls.run = counting(run)
    try:
        result = yield
    finally:
        for cls, run in originals.items():
            cls.run = run
    if not launches:
        raise AssertionError("marked @pytest.mark.triton but launched no Triton kernel: its tensors never reached "
                             "the kernels (CPU tensors on a GPU machine take the PyTorch path)")
    return result


@pytest.fixture
def device() -> str:
    """Where op tests build their tensors: the GPU when there is one (the real kernels), else the CPU (the
    interpreter under ``@pytest.mark.triton``). Its tests are marked ``gpu``."""
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


@pytest.fixture
def small_tiles(monkeypatch):
    """The decode kernel's small key tiles, so that it walks several tiles per program at the tests' sizes."""
    from foxlm.ops.forgetting_attention import decode

    monkeypatch.setattr(decode, "_TILE", (32, 4, 1))
