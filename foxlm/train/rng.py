"""Each process's random draws (dropout, a model's own sampling): seeded per process, saved in every checkpoint and
restored on resume, so that a resumed run draws what an uninterrupted one would.

The model is initialized from ``seed`` alone, the same weights on every process; then each process seeds its torch
generators from ``(seed, rank)``: data-parallel processes drop out different units, as they train on different
data. A checkpoint's ``trainer.pt`` holds one state per process (``"rng"``: a list by rank, of the CPU generator and
the generator of the process's own GPU), each restored by its own rank. foxlm draws nothing from Python's ``random``
or numpy's global generator (the loader's generators are its own, a function of ``(seed, step)``), so neither is
saved.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["restore_rng_states", "rng_state", "seed_process", "set_rng_state"]


def seed_process(seed: int, rank: int) -> None:
    """Seed this process's torch generators (CPU and every GPU) from ``(seed, rank)``: independent streams for the
    processes of a run, and for runs of different seeds (``seed + rank`` would give process 1 of seed 0 process 0's
    draws of seed 1)."""
    torch.manual_seed(int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0]))


def rng_state(device: torch.device) -> dict:
    """This process's generator states: ``{"cpu": ByteTensor, "cuda": ByteTensor of its own GPU, or None}``."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    """Set this process's generators to ``state`` (``rng_state``'s; a GPU's, where it holds one, on ``device``)."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def restore_rng_states(saved: list[dict] | dict, saved_world: int, rank: int, world: int,
                       device: torch.device, seed: int) -> str | None:
    """Restore the state of this process's ``rank`` from a checkpoint's ``saved`` states (one per process of the
    ``saved_world`` that wrote it; a dict: a checkpoint from before foxlm kept each process's, holding the main
    process's CPU state and the states of all the GPUs it saw). A process the checkpoint holds no state for keeps
    the stream ``seed_process`` gave it. Returns a one-line warning for the log when not every process of this run
    of ``world`` restores its own (the processes then draw other numbers than an uninterrupted run), else None."""
    if isinstance(saved, dict):  # the main process's, with every GPU it saw: this device's (a one-process run's own)
        gpus = saved["cuda"]
        index = device.index if device.type == "cuda" else None
        saved = [{"cpu": saved["cpu"], "cuda": gpus[index] if index is not None and index < len(gpus) else None}]
    if rank < len(saved):
        set_rng_state(saved[rank], device)
    if len(saved) == saved_world == world:
        return None
    restored = min(len(saved), world)
    why = (f"was saved by {saved_world} process{'es' * (saved_world > 1)}, this run has {world}" if saved_world != world
           else "holds the main process's RNG state only (saved before foxlm kept each process's)")
    fresh = f"; {_processes(restored, world)} from seed={seed} and rank" if restored < world else ""
    return (f"warning: RNG: the checkpoint {why}: {_processes(0, restored)} restored{fresh}; random draws (dropout) "
            f"are not an uninterrupted run's")


def _processes(first: int, end: int) -> str:
    """"process 3" or "processes 3-5": the ranks ``first`` to ``end - 1``."""
    return f"process {first}" if end - first == 1 else f"processes {first}-{end - 1}"
