"""foxlm.train.cuda_graph: micro-steps replayed from a CUDA graph (the GPU tests skip without one)."""

from __future__ import annotations

import gc

import pytest
import torch

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import use_backend
from foxlm.train import load_config, train
from foxlm.train.trainer import Trainer
from train.runs import logged_losses, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_automatic_gc():
    """Python's cyclic GC runs only when called: a test sees whether something waits for it."""
    collecting = gc.isenabled()
    gc.disable()
    yield
    if collecting:
        gc.enable()


requires_cuda = pytest.mark.gpu  # CUDA graphs need a GPU: skipped without one (tests/conftest.py)


def test_cuda_graph_needs_fixed_shapes_and_a_gpu(byte_data, tmp_path):
    with pytest.raises(ValueError, match="cuda_graph: needs packing=windows"):
        tiny_config(byte_data, tmp_path, "cuda_graph=true", "packing=documents")
    with pytest.raises(ValueError, match="cuda_graph: needs packing=windows"):
        tiny_config(byte_data, tmp_path, "cuda_graph=true", "compile=true")
    with pytest.raises(ValueError, match="cuda_graph: expected true, false or auto"):
        tiny_config(byte_data, tmp_path, "cuda_graph=sometimes")
    with pytest.raises(ValueError, match="cuda_graph: needs one CUDA device"):
        Trainer(tiny_config(byte_data, tmp_path, "cuda_graph=true", "device=cpu"))
    assert Trainer(tiny_config(byte_data, tmp_path, "cuda_graph=auto", "device=cpu")).graphed is None  # auto: eager
    assert load_config().cuda_graph == "auto"  # the embedded default job replays its steps on a GPU
    from foxlm.train.cuda_graph import GraphedMicroStep

    with pytest.raises(ValueError, match="cuda_graph: the parameters must be CUDA tensors"):
        GraphedMicroStep(lambda ids, labels: ids.sum(), [torch.nn.Parameter(torch.randn(3))])


@pytest.mark.usefixtures("no_automatic_gc")
def test_a_finished_trainer_is_freed_without_the_cyclic_gc(byte_data, tmp_path):
    """No reference cycle holds a Trainer: its CUDA graph (GraphedMicroStep) goes with its last reference, not at a
    garbage collection that might fall inside a later capture."""
    import weakref

    gpu = torch.cuda.is_available()  # there: a captured and replayed step (warm-up steps 1 and 2, capture at 3)
    extra = ["device=cuda", "cuda_graph=true"] if gpu else []
    with use_backend("auto" if gpu else "torch"):
        trainer = Trainer(tiny_config(byte_data, tmp_path, "max_steps=4", "eval_every=2", "save_every=2", *extra))
        trainer.run()
    assert (trainer.graphed is not None) == gpu
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None


@requires_cuda
def test_cuda_graph_needs_the_triton_kernels(byte_data, tmp_path):
    """On the PyTorch path (which sizes its work on the host) auto stays eager and true is a clear error."""
    # conftest's default backend is torch
    assert Trainer(tiny_config(byte_data, tmp_path, "cuda_graph=auto", "device=cuda")).graphed is None
    with pytest.raises(ValueError, match="cuda_graph: needs foxlm's Triton kernels"):
        Trainer(tiny_config(byte_data, tmp_path, "cuda_graph=true", "device=cuda"))
    with use_backend("auto"):
        assert Trainer(tiny_config(byte_data, tmp_path, "cuda_graph=auto", "device=cuda")).graphed is not None


@requires_cuda
@pytest.mark.triton
def test_cuda_graph_micro_steps_match_eager():
    """Replayed forward + backward (the Triton kernels, ACP on): the eager losses and accumulated gradients, over
    optimizer steps of two micro-batches each; a batch of another shape is refused."""
    from foxlm.train.cuda_graph import GraphedMicroStep

    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=128, acp=True)
    torch.manual_seed(0)
    models = [FoxForCausalLM(config).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def loss_fn(model):
        def f(ids, labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=labels).loss
        return f

    graphed = GraphedMicroStep(loss_fn(models[1]), list(models[1].parameters()), warmup=1)
    for step in range(4):  # step 0: warm-up; step 1: capture, then replays
        eager_losses, graph_losses = [], []
        for weight in (0.25, 0.75):
            ids = torch.randint(0, 128, (2, 96), device="cuda")
            loss = loss_fn(models[0])(ids, ids)
            (loss * weight).backward()
            eager_losses.append(loss.item())
            graph_losses.append(graphed(ids, ids, weight).item())
        assert graph_losses == pytest.approx(eager_losses, rel=1e-3)
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=1e-4 * p.grad.abs().max().item())
        for opt in opts:
            opt.step()
        opts[0].zero_grad(set_to_none=True)
        opts[1].zero_grad(set_to_none=False)
    with pytest.raises(ValueError, match="captured for batches of shape"):
        graphed(ids[:, :64], ids[:, :64])


@requires_cuda
@pytest.mark.triton
@pytest.mark.usefixtures("no_automatic_gc")  # no collection but the explicit ones
def test_capture_is_not_broken_by_a_dead_graph():
    """A finished run's graph left in a dead reference cycle (as a Trainer and its GraphedMicroStep form) is freed
    before the next capture, not by a garbage collection in the middle of it (which invalidates that capture)."""
    from foxlm.train.cuda_graph import GraphedMicroStep

    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=128)
    ids = torch.randint(0, 128, (2, 64), device="cuda")

    def graphed_step(collect_in_capture: bool = False) -> GraphedMicroStep:
        model = FoxForCausalLM(config).cuda()

        def loss_fn(input_ids, labels):
            if collect_in_capture and torch.cuda.is_current_stream_capturing():
                gc.collect()  # what the cyclic GC may do at any allocation
            return model(input_ids=input_ids, labels=labels).loss

        step = GraphedMicroStep(loss_fn, list(model.parameters()), warmup=1)
        step.cycle = step  # only the cyclic GC frees it
        return step

    live = graphed_step(collect_in_capture=True)
    live(ids, ids)  # warm-up
    dead = graphed_step()
    dead(ids, ids)  # warm-up
    dead(ids, ids)  # capture and replay
    del dead
    assert torch.isfinite(live(ids, ids))  # capture and replay


@requires_cuda
@pytest.mark.triton
@pytest.mark.parametrize("options", [[], ["activation_checkpointing=true", "model.acp=true"]],
                         ids=["plain", "ckpt-acp"])
def test_trainer_cuda_graph_keeps_the_losses(byte_data, tmp_path, options):
    """The trainer's replayed micro-steps (two a step, with validation and a checkpoint in between) give the
    eager losses, also with recomputed activations and ACP; a replayed run resumed from a checkpoint continues them."""
    extra = ["eval_every=2", "save_every=2", "micro_batch_size=2", "device=cuda", *options]
    train(tiny_config(byte_data, tmp_path / "eager", *extra, "max_steps=4"))
    train(tiny_config(byte_data, tmp_path / "graph", *extra, "max_steps=4", "cuda_graph=true"))
    train(tiny_config(byte_data, tmp_path / "resumed", *extra, "max_steps=2", "cuda_graph=true"))
    train(tiny_config(byte_data, tmp_path / "resumed", *extra, "max_steps=4", "cuda_graph=true"))
    eager, graphed, resumed = (logged_losses(tmp_path / name) for name in ("eager", "graph", "resumed"))
    assert eager.keys() == graphed.keys() == resumed.keys() == {1, 2, 3, 4}
    assert all(graphed[k] == pytest.approx(eager[k], rel=1e-3) for k in eager)
    assert all(resumed[k] == pytest.approx(graphed[k], rel=1e-3) for k in eager)

