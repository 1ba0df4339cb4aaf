"""The trainer's side of ``foxlm.checkpoint``: taking and locking its run folder, and saving its checkpoints (one
process writes the whole state; several write their shards, maybe in the background)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from ..checkpoint.checkpointer import PendingCheckpoint, write_checkpoint
from ..checkpoint.dcp import full_state_dicts, sharded_state_dicts
from ..checkpoint.run_folder import check_run_folder, lock_holder, lock_run
from . import parallel


def take_run_folder(run_dir: Path, d: parallel.Dist, device: torch.device) -> IO[str] | None:
    """Lock ``run_dir`` for this run (collective; rank 0 holds the lock it returns): a folder holding files no run
    wrote, or one another run holds (a requeued job while the first still runs), is refused on every process with
    rank 0's reason."""
    refused, lock = None, None
    if d.main:
        try:
            check_run_folder(run_dir)  # before anything is written there
        except (ValueError, NotADirectoryError) as e:
            refused = e
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = lock_run(run_dir)
    try:
        if d.any(refused is not None, device):
            raise refused or ValueError(f"out_dir: {run_dir} is refused (the main process says why)")
        if d.any(d.main and lock is None, device):
            holder = lock_holder(run_dir) if d.main else "?"
            raise ValueError(f"out_dir: {run_dir} is in use by another foxlm train (pid {holder}); wait for it to end, "
                             f"or train into a new out_dir")
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    return lock


class Checkpointer:
    """Saves a run's checkpoints into ``run_dir``, keeping the last ``keep_last``; the model folder gets ``tokenizer``
    in Hugging Face's format where it has one (all but byte), so that ``AutoTokenizer`` loads it from there."""

    def __init__(self, run_dir: Path, keep_last: int, d: parallel.Dist, tokenizer):
        self.run_dir, self.keep_last, self.d, self.tokenizer = run_dir, keep_last, d, tokenizer
        self._pending: tuple[PendingCheckpoint, Callable[[Path], None], dict | None] | None = None
        self._save_group: dist.ProcessGroup | None = None  # background saves' own gloo group

    def save(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: Callable[[dict | None], dict], background: bool = False) -> list[Path]:
        """Checkpoint ``step`` of ``module`` (unwrapped) and ``optimizer`` (collective: every process calls it), with
        rank 0's ``trainer_state(optimizer_state_dict)`` (None when sharded: the shards hold it). One process writes
        the whole state; several write their shards with torch.distributed.checkpoint, nothing gathered on one, and
        with ``background`` in a thread while training goes on, committed by the next ``save`` or ``finish_saving``.
        Returns the checkpoints committed (on rank 0): a background save's from before, and this one unless in the
        background."""
        done = self.finish_saving()
        sharded = self.d.world > 1
        if sharded:
            shards, model_sd, optim_sd = sharded_state_dicts(module, optimizer), None, None
        else:
            shards = None
            model_sd, optim_sd = full_state_dicts(module, optimizer)
        state = trainer_state(optim_sd) if self.d.main else None
        save_model = functools.partial(self._save_model, module, model_sd)
        if sharded and background:
            if self._save_group is None:  # DCP's thread must not interleave its collectives with the training's
                self._save_group = dist.new_group(backend="gloo")
            self._pending = PendingCheckpoint(self.run_dir, step, shards, self._save_group), save_model, state
            return done
        path = write_checkpoint(self.run_dir, step, save_model, state, self.keep_last, shards=shards)
        self.d.barrier()
        return done + ([path] if path is not None else [])

    def finish_saving(self) -> list[Path]:
        """Commit the checkpoint being written in the background, if any (collective); returns it on rank 0."""
        if self._pending is None:
            return []
        (pending, save_model, state), self._pending = self._pending, None
        path = pending.finish(save_model, state, self.keep_last)
        return [path] if path is not None else []

    def _save_model(self, module: torch.nn.Module, state_dict: dict | None, folder: Path) -> None:
        """The model's ``save_pretrained`` folder (without ``state_dict``: its config alone, the weights being in the
        shards), with the tokenizer."""
        if state_dict is None:
            module.config.save_pretrained(folder)
        else:
            module.save_pretrained(folder, state_dict=state_dict)
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(folder)
