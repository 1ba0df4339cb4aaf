"""The trainer's side of ``foxlm.checkpoint``: taking and locking its run folder; saving its checkpoints (one process
writes the whole state; several write their shards, maybe in the background), resuming from one, and initializing
the model from a trained one."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ..checkpoint.checkpointer import (
    PendingCheckpoint,
    initialize_model,
    model_name,
    restore_checkpoint,
    write_checkpoint,
)
from ..checkpoint.dcp import full_state_dicts, sharded_state_dicts
from ..checkpoint.files import check_parents
from ..checkpoint.run_folder import (
    LOCK_FILE,
    RUN_MARKER,
    check_out_dir,
    check_run_folder,
    checkpoint_step,
    list_checkpoints,
    lock_holder,
    lock_run,
    resume_point,
)
from ..models.loading import transformers_bars
from . import parallel
from .config import TrainConfig
from .data import TrainData
from .loader import TokenLoader
from .optim import lr_at
from .rng import restore_rng_states, rng_state


def take_run_folder(run_dir: Path, d: parallel.Dist, device: torch.device) -> tuple[IO[str] | None, list[Path]]:
    """Lock ``run_dir`` for this run (collective; rank 0 holds the lock it returns, with the paths taking the folder
    created: ``give_back_run_folder`` removes them if the run is refused after all): a folder holding files no run
    wrote, or one another run holds (a requeued job while the first still runs), is refused on every process with
    rank 0's reason."""
    refused, lock, created = None, None, []
    if d.main:
        try:
            check_run_folder(run_dir)  # before anything is written there
            created = [p for p in (run_dir, run_dir / RUN_MARKER, run_dir / LOCK_FILE) if not p.exists()]
            run_dir.mkdir(parents=True, exist_ok=True)
            lock = lock_run(run_dir)
        except (ValueError, NotADirectoryError) as e:
            refused = e
        except OSError as e:  # a name too long, a read-only disk: said as the other refusals, on every process
            refused = ValueError(f"out_dir: {run_dir} cannot be made a run folder: {e.strerror or e}")
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
        give_back_run_folder(created)
        raise
    return lock, created


def give_back_run_folder(created: list[Path]) -> None:
    """Remove what ``take_run_folder`` created (the lock released first), for a run refused after taking its folder:
    its run marker would have had a later run take a folder of a user's files as a run's, and overwrite them."""
    for path in reversed(created):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # only empty: a folder that holds something now stays
            else:
                path.unlink()


class Checkpointer:
    """A run's checkpoints in ``out_dir``, keeping the last ``keep_last``: each holds the step's model (with the data's
    tokenizer in Hugging Face's format where it has one, all but byte, so that ``AutoTokenizer`` loads it from there),
    optimizer, loader, each process's RNG (``rng.py``) and counters. It resumes a run from one, or initializes a new
    run's model from a trained one."""

    def __init__(self, cfg: TrainConfig, d: parallel.Dist, device: torch.device, model: torch.nn.Module,
                 model_config: PretrainedConfig, optimizer: torch.optim.Optimizer, loader: TokenLoader,
                 data: TrainData):
        self.cfg, self.d, self.device, self.run_dir = cfg, d, device, Path(cfg.out_dir).expanduser()
        self.module, self.model_config, self.optimizer = parallel.unwrap(model), model_config, optimizer
        self.loader, self.data = loader, data
        self._pending: tuple[PendingCheckpoint, Callable[[Path], None], dict | None] | None = None
        self._save_group: dist.ProcessGroup | None = None  # background saves' own gloo group

    def save(self, step: int, bad_steps: int, tokens_seen: int, background: bool = False,
             interval: tuple[float, int] = (0.0, 0), val_due: bool = False) -> list[Path]:
        """Checkpoint ``step`` with the run's counters and ``interval``, the (loss sum, steps) not logged yet, which a
        resumed run's next log record averages in, and ``val_due``: the step's validation, due but not logged, which a
        resumed run runs first (collective: every process calls it). One process writes the
        whole state; several write their shards with torch.distributed.checkpoint, nothing gathered on one, and with
        ``background`` in a thread while training goes on, committed by the next ``save`` or ``finish_saving``.
        Returns the checkpoints committed (on rank 0): a background save's from before, and this one unless in the
        background."""
        done = self.finish_saving()
        sharded = self.d.world > 1
        if sharded:
            shards, model_sd, optim_sd = sharded_state_dicts(self.module, self.optimizer), None, None
        else:
            shards = None
            model_sd, optim_sd = full_state_dicts(self.module, self.optimizer)
        rng = [rng_state(self.device)]
        if sharded:  # each process's own: its draws (dropout) are its own
            gathered = [None] * self.d.world if self.d.main else None
            dist.gather_object(rng[0], gathered, dst=0)
            rng = gathered
        state = self._trainer_state(step, bad_steps, tokens_seen, optim_sd, interval, val_due, rng) \
            if self.d.main else None
        save_model = functools.partial(self._save_model, model_sd)
        if sharded and background:
            if self._save_group is None:  # DCP's thread must not interleave its collectives with the training's
                self._save_group = dist.new_group(backend="gloo")
            self._pending = PendingCheckpoint(self.run_dir, step, shards, self._save_group), save_model, state
            return done
        path = write_checkpoint(self.run_dir, step, save_model, state, self.cfg.keep_last, shards=shards)
        self.d.barrier()
        return done + ([path] if path is not None else [])

    def finish_saving(self) -> list[Path]:
        """Commit the checkpoint being written in the background, if any (collective); returns it on rank 0."""
        if self._pending is None:
            return []
        (pending, save_model, state), self._pending = self._pending, None
        path = pending.finish(save_model, state, self.cfg.keep_last)
        return [path] if path is not None else []

    def keep_last_step(self, step: int, bad_steps: int, tokens_seen: int, together: bool,
                       interval: tuple[float, int] = (0.0, 0), val_due: bool = False) -> str:
        """After SIGTERM cut step ``step + 1`` (or, ``val_due``, the validation of ``step``) short (collective): keep
        the last whole step, ``step``, saved unless out_dir's newest checkpoint is of it. Several processes save only
        when they gave the step up ``together``: else the others may be inside the step's collectives, which a save
        needs. Returns what was kept, and how the run goes on, for the log."""
        saved = list_checkpoints(self.run_dir) if self.d.main else []
        resumes = "the same command resumes the run"
        if self.d.world > 1 and not together:
            return f"no save (it needs every process); {resumes}"
        # from here every process takes the same branch: a save is collective
        if step == 0:
            return "no step finished, nothing saved; the same command starts the run again"
        if self.d.any(bool(saved) and checkpoint_step(saved[-1]) == step, self.device):
            return f"step {step} is saved; {resumes}"
        written = self.save(step, bad_steps, tokens_seen, interval=interval, val_due=val_due)
        return f"saved {written[0] if written else f'step {step}'}; {resumes}"

    def _trainer_state(self, step: int, bad_steps: int, tokens_seen: int, optimizer: dict | None,
                       interval: tuple[float, int], val_due: bool, rng: list[dict]) -> dict:
        """What a checkpoint holds besides the model: counters, schedule, loader, ``rng`` (each process's generator
        states, by rank), and ``optimizer`` (the whole optimizer state of one process; None: it is in the shards)."""
        return {
            "step": step,
            **({} if optimizer is None else {"optimizer": optimizer}),
            "scheduler": {"step": step, "lr": lr_at(max(step - 1, 0), self.cfg)},
            "loader": self.loader.state_dict(),
            "rng": rng,
            "bad_steps": bad_steps,
            "tokens_seen": tokens_seen,
            "log_interval": [float(interval[0]), int(interval[1])],
            "val_due": val_due,
            "tokenizer": self.data.tok_spec,
            "world_size": self.d.world,
            "config": self.cfg.to_dict(),
        }

    def _save_model(self, state_dict: dict | None, folder: Path) -> None:
        """The model's ``save_pretrained`` folder (without ``state_dict``: its config alone, the weights being in the
        shards), with the tokenizer."""
        if state_dict is None:
            self.module.config.save_pretrained(folder)
        else:
            with transformers_bars(self.cfg.progress):  # its "Writing model shards" bar
                self.module.save_pretrained(folder, state_dict=state_dict)
        if hasattr(self.data.tokenizer, "save_pretrained"):
            self.data.tokenizer.save_pretrained(folder)

    def resume(self) -> tuple[dict | None, list[str]]:
        """Resume the run as ``resume`` says, else initialize its model from ``init_from`` (if set), after refusing
        an out_dir with checkpoints the run does not continue, or an ``export_dir`` that exists or cannot be made (a
        parent is a file). Returns the resumed trainer state (its counters; None: a new run) and what was done, for
        the log."""
        export = self.cfg.export_dir
        if export is not None and Path(export).expanduser().exists():
            raise ValueError(f"export_dir: {export} exists; the run exports its model into a new folder")
        if export is not None:  # else found once the run has trained
            check_parents(Path(export).expanduser(), "export_dir")
        ckpt = resume_point(self.run_dir, self.cfg.resume)
        check_out_dir(self.run_dir, ckpt, self.cfg.resume)
        if ckpt is not None:
            state, changed, rng_warning = self.load(ckpt)
            notes = [f"resumed from {ckpt} at step {state['step']}"
                     + (f", with changed settings: {'; '.join(changed)}" if changed else "")]
            if rng_warning is not None:
                notes.append(rng_warning)
            if self.cfg.init_from is not None and self.cfg.init_from != state["config"].get("init_from"):
                notes.append(f"init_from={self.cfg.init_from} is not used: a resumed run goes on from its checkpoint's "
                             f"weights (init_from starts a new run, in a new out_dir)")
            return state, notes
        if self.cfg.init_from is not None:
            folder, differ = self.initialize(self.cfg.init_from)
            return None, [f"initialized from {folder}"
                          + (f", with changed model settings: {'; '.join(differ)}" if differ else "")]
        return None, []

    def load(self, ckpt: Path) -> tuple[dict, list[str], str | None]:
        """Restore model, optimizer, loader and this process's RNG from a verified checkpoint; return its trainer state
        (counters), the settings this run changes from the checkpoint's run ("key: old -> new") and a warning when not
        every process restored its own RNG state (a run of another number of processes resumes it). The optimizer's
        hyperparameters are this run's (a changed weight_decay, beta1, beta2 or eps applies, as reported): loading a
        state dict would bring back the checkpoint's."""
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        state, changed = restore_checkpoint(ckpt, self.module, self.optimizer, self.data.tok_spec, self.cfg.to_dict())
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.loader.load_state_dict(state["loader"])
        warning = restore_rng_states(state["rng"], state.get("world_size", 1), self.d.rank, self.d.world, self.device,
                                     self.cfg.seed)
        return state, changed, warning

    def initialize(self, path: str | os.PathLike) -> tuple[Path, list[str]]:
        """Load the weights of a trained model (a run folder, a checkpoint or a ``save_pretrained`` folder) into this
        run's model; return its folder and the model settings this config changes from it ("key: old -> new")."""
        return initialize_model(path, self.module, self.model_config, self.data.tok_spec, self.data.path,
                                model_name(self.cfg.to_dict()))
