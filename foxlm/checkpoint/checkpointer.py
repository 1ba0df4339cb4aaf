"""Atomic, verified training checkpoints: writing them, and resuming or initializing a run from them.

A checkpoint (``run_folder.py`` shows the layout) holds::

    model/            save_pretrained folder (config.json + safetensors, and tokenizer.json but for byte data):
                      AutoModelForCausalLM / AutoTokenizer.from_pretrained work on it
    trainer.pt        optimizer, scheduler, loader, RNG, counters (torch.load(weights_only=True))
    manifest.json     sha256 of every file above, written last

A run of several processes (FSDP2 or DDP under torchrun) writes its checkpoints sharded instead: each process writes
its own part of the model and optimizer state with torch.distributed.checkpoint (DCP, ``dcp.py``) into ``dcp/``, and
nothing is gathered on one process. ``model/`` then holds the config and tokenizer without weights, and
``trainer.pt`` no optimizer. DCP reshards on load, so such a checkpoint resumes on any number of processes;
``export.py`` (``foxlm export``) writes its model as a ``save_pretrained`` folder.

A checkpoint is written into a temporary folder and renamed into place, so a killed run leaves no
``step_*`` folder half-written (the next save removes its temporary folder); ``manifest.json`` is checked before
loading, so a damaged one is never used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from transformers import PretrainedConfig

from ..data.tokenizer import same_tokenizer
from ..models import FoxConfig
from ..presets import FOX_FIELDS, has_size
from .dcp import load_sharded, save_shards, sharded_model_shapes
from .files import read_json, replace_folder, sha256_file, write_atomic
from .manifest import MANIFEST, verify_checkpoint, write_manifest
from .run_folder import SHARDS, checkpoint_name, is_sharded, list_checkpoints
from .weights import DAMAGED_MODEL, read_model_weights, reading_weights, resolve_model_dir

__all__ = ["DiskFullError", "PendingCheckpoint", "initialize_model", "load_trainer_state", "model_name",
           "restore_checkpoint", "write_checkpoint"]

# Settings that change what a run shows, not what it trains: not reported as changed on resume.
DISPLAY_KEYS = {"resume", "progress", "tensorboard", "wandb", "log_every", "peak_tflops", "sample_prompt",
                "sample_tokens", "export_dir", "async_checkpoint"}
# The weights a new run would start from: a resumed run goes on from its checkpoint's, and says init_from is unused.
UNUSED_ON_RESUME = {"init_from"}



class DiskFullError(OSError):
    """A checkpoint could not be written because its disk is full."""


def write_checkpoint(run_dir: Path, step: int, save_model: Callable[[Path], None], trainer_state: dict | None,
                     keep_last: int, shards: dict | None = None) -> Path | None:
    """Write checkpoint ``step`` atomically (``save_model(folder)`` writes the model), update ``latest``, prune.

    Without ``shards``, called on the process that writes (rank 0). With ``shards`` (this process's part of the
    model and optimizer state dicts, as ``get_model_state_dict`` / ``get_optimizer_state_dict`` give them), every
    process of the default group calls it: each writes its shards into ``dcp/`` and hashes its own files, rank 0 the
    rest (``trainer_state`` is used there only). Returns the checkpoint on the writing rank 0, None elsewhere. A full
    disk raises ``DiskFullError`` and leaves no partial save.
    """
    return PendingCheckpoint(run_dir, step, shards).finish(save_model, trainer_state, keep_last)


class PendingCheckpoint:
    """A checkpoint being written into its temporary folder; ``finish`` completes and commits it (``write_checkpoint``
    says how). With ``background`` (a gloo process group of every process, used by nothing else) the shards are
    copied to CPU memory at once and written by a thread (``torch.distributed.checkpoint.async_save``) while training
    goes on; until ``finish`` the checkpoint is not in ``step_*`` and so is never used."""

    def __init__(self, run_dir: Path, step: int, shards: dict | None = None,
                 background: dist.ProcessGroup | None = None):
        self.run_dir, self.step = Path(run_dir), step
        root = self.run_dir / "checkpoints"
        self.final = root / checkpoint_name(step)
        self.sharded = shards is not None
        self.main = not self.sharded or dist.get_rank() == 0
        self.tmp, self.future = None, None
        if self.main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step_*.tmp-*"):  # saves of a killed run: one process commits a run's checkpoints
                shutil.rmtree(stale, ignore_errors=True)
            self.tmp = root / f".{self.final.name}.tmp-{os.getpid()}"
            self.tmp.mkdir()
        if shards is None:
            return
        box = [self.tmp]
        dist.broadcast_object_list(box, src=0)
        self.tmp = box[0]
        with self._failing():
            self.future = save_shards(shards, self.tmp / SHARDS, background)

    def finish(self, save_model: Callable[[Path], None], trainer_state: dict | None, keep_last: int) -> Path | None:
        """Wait for the shards, write the rest and the manifest, rename into place, update ``latest``, prune; the
        checkpoint on rank 0, None elsewhere (collective when sharded)."""
        with self._failing():
            digests = {}
            if self.sharded:
                if self.future is not None:
                    self.future.result()
                # each process hashes the files it wrote, so no process reads the whole checkpoint
                rank, folder = dist.get_rank(), self.tmp / SHARDS
                mine = {p.relative_to(self.tmp).as_posix(): sha256_file(p) for p in folder.glob(f"__{rank}_*")}
                gathered = [None] * dist.get_world_size() if self.main else None
                dist.gather_object(mine, gathered, dst=0)
                digests = {name: digest for part in gathered or [] for name, digest in part.items()}
            if self.main:
                tmp = self.tmp
                save_model(tmp / "model")
                torch.save(trainer_state, tmp / "trainer.pt")
                write_manifest(tmp, digests, step=self.step)
        if not self.main:
            return None
        replace_folder(self.tmp, self.final)  # a step saved again (Trainer.save called twice) is swapped, never lost
        write_atomic(self.final.parent / "latest", self.final.name)
        # foxlm's own only: it renames none into place without its manifest.json, so a step_* folder without one (a
        # user's, or a link to one) is neither counted nor deleted
        ours = [p for p in list_checkpoints(self.run_dir) if not p.is_symlink() and (p / MANIFEST).is_file()]
        for old in ours[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """A full disk becomes ``DiskFullError`` on every process (the others' DCP failure holds rank 0's: its
        traceback was the report); on rank 0 a failed write removes the temporary folder."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as e:
            full = _disk_full(e, self.final.parent)  # the folder of the checkpoints: rank 0 may have removed tmp
            if self.main:
                shutil.rmtree(self.tmp, ignore_errors=True)  # what was written would only fill the disk further
            if not full:
                raise
            raise DiskFullError(f"checkpoint: cannot save {self.final}: the disk is full; free space there, or train "
                                f"into an out_dir on another disk") from None


def _disk_full(error: BaseException, folder: Path) -> bool:
    """Whether a failed write was a full disk. torch.save reports one as an ``inline_container.cc`` enforce failure
    without the errno; the partial file is still there, so the disk has next to no space left."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left on device" in str(error):
        return True
    return "inline_container.cc" in str(error) and shutil.disk_usage(folder).free < (16 << 20)


def load_trainer_state(ckpt: str | os.PathLike, arg: str = "resume") -> dict:
    """The non-model state of a verified checkpoint (safe: ``weights_only=True``); errors name the argument ``arg``."""
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(f"{arg}: checkpoint {ckpt}: {problem}; refusing to load it")
    with reading_weights(Path(ckpt) / "trainer.pt", arg):  # a crafted one: an error, not torch's advice to unpickle it
        return torch.load(Path(ckpt) / "trainer.pt", map_location="cpu", weights_only=True)


def model_name(cfg: dict) -> str:
    """"fox-pro tiny" ("hf:llama" for a Hugging Face model, which has no size), with the config's model overrides."""
    name = f"{cfg['arch']} {cfg['size']}" if has_size(cfg["arch"]) else cfg["arch"]
    return name + (f" with model={cfg['model']}" if cfg["model"] else "")


def _weights_differ(found: dict[str, tuple[int, ...]], module: torch.nn.Module) -> str | None:
    """None if weights of these names and shapes are exactly ``module``'s (unsharded), else how they differ. A weight
    tied to another (a tied LM head) may be absent where the other is there: ``save_pretrained`` writes it once."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    for names in _tied_names(module):
        if any(name in found for name in names):
            for name in names - set(found):
                expected.pop(name, None)
    if found == expected:
        return None
    differ = sorted(set(found) ^ set(expected)) or [n for n in expected if found[n] != expected[n]]
    return (f"{len(differ)} weights differ (e.g. {differ[0]}: {found.get(differ[0], 'absent')} there, "
            f"{expected.get(differ[0], 'absent')} here)")


def _tied_names(module: torch.nn.Module) -> list[set[str]]:
    """The state-dict names of each parameter that ``module`` holds under several names (tied weights)."""
    names: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(name)
    return [group for group in names.values() if len(group) > 1]


def restore_checkpoint(ckpt: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, tok_spec: dict,
                       config: dict) -> tuple[dict, list[str]]:
    """Load a verified checkpoint's weights and optimizer state into ``module`` (unwrapped) and ``optimizer``, after
    checking that it was trained on ``tok_spec`` data as the same model. Returns its trainer state (counters, loader,
    RNG) and the settings of training config ``config`` that differ from the checkpoint's ("key: old -> new")."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state = load_trainer_state(ckpt)  # verifies the manifest first
    if not same_tokenizer(state["tokenizer"], tok_spec):  # its content: the folder may have moved since
        raise ValueError(f"tokenizer: the checkpoint was trained with {state['tokenizer']}, the data is {tok_spec}")
    sharded = is_sharded(ckpt)
    weights = None if sharded else read_model_weights(resolve_model_dir(ckpt, "resume"), "resume")
    found = sharded_model_shapes(ckpt / SHARDS, "resume") if sharded else \
        {name: tuple(t.shape) for name, t in weights.items()}
    problem = _weights_differ(found, module)
    if problem is not None:
        raise ValueError(f"resume: {ckpt} was trained as {model_name(state['config'])}, this config is "
                         f"{model_name(config)}: {problem}. Train into a new out_dir to start this model")
    if sharded:  # each process reads its own part, whatever the number of processes that wrote them
        load_sharded(module, optimizer, ckpt / SHARDS, "resume", no_dist=not dist.is_initialized())
    else:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, weights, options=options)
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=options)
    changed = [f"{key}: {was!r} -> {config[key]!r}" for key, was in state["config"].items()
               if key not in DISPLAY_KEYS | UNUSED_ON_RESUME and key in config and config[key] != was]
    return state, changed


def initialize_model(path: str | os.PathLike, module: torch.nn.Module, model_config: PretrainedConfig, tok_spec: dict,
                     data: Path, name: str) -> tuple[Path, list[str]]:
    """Load the weights of a trained model (a run folder, a checkpoint or a ``save_pretrained`` folder) into
    ``module`` (unwrapped; ``name`` in errors), built as ``model_config`` for ``data`` prepared with ``tok_spec``.
    Returns its folder and the model settings ``model_config`` changes from it ("key: old -> new")."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    folder = resolve_model_dir(path, "init_from")
    saved = read_json(folder / "config.json", DAMAGED_MODEL)
    if saved.get("model_type") != model_config.model_type:
        want = "a foxlm model" if isinstance(model_config, FoxConfig) else f"a {model_config.model_type!r} model"
        raise ValueError(f"init_from: {folder} holds a {saved.get('model_type')!r} model, not {want} as this "
                         f"config's {name}")
    tokenizer = saved.get("foxlm_tokenizer")
    if tokenizer is not None and not same_tokenizer(tokenizer, tok_spec):
        raise ValueError(f"init_from: {folder} was trained with the tokenizer {tokenizer}, the data {data} was "
                         f"prepared with {tok_spec}")
    weights = read_model_weights(folder, "init_from")
    problem = _weights_differ({name: tuple(t.shape) for name, t in weights.items()}, module)
    if problem is not None:
        raise ValueError(f"init_from: {folder} holds another model than this config's {name}: {problem}. Set arch, "
                         f"size and model.* to build it")
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
    now = model_config.to_dict()
    # train_length is a record that seq_len sets, not a setting the run changes
    keys = (set(FOX_FIELDS) - {"train_length"} if isinstance(model_config, FoxConfig)
            else set(now) - {"transformers_version"})
    return folder, [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in sorted(keys)
                    if key in saved and saved[key] != now[key]]
