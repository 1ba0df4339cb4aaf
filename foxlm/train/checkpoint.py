"""Atomic, verified training checkpoints: writing them, and resuming or initializing a run from them.

Layout::

    <run>/checkpoints/step_0000100/
        model/            save_pretrained folder (config.json + safetensors, and tokenizer.json but for byte data):
                          AutoModelForCausalLM / AutoTokenizer.from_pretrained work on it
        trainer.pt        optimizer, scheduler, loader, RNG, counters (torch.load(weights_only=True))
        manifest.json     sha256 of every file above, written last
    <run>/checkpoints/latest      name of the newest complete checkpoint

A run of several processes (FSDP2 or DDP under torchrun) writes its checkpoints sharded instead: each process writes
its own part of the model and optimizer state with torch.distributed.checkpoint (DCP) into ``dcp/``, and nothing is
gathered on one process. ``model/`` then holds the config and tokenizer without weights, and ``trainer.pt`` no
optimizer. DCP reshards on load, so such a checkpoint resumes on any number of processes; ``export_model`` (``foxlm
export``) writes its model as a ``save_pretrained`` folder.

A checkpoint is written into a temporary folder and renamed into place, so a killed run leaves no
``step_*`` folder half-written (the next save removes its temporary folder); ``manifest.json`` is checked before
loading, so a damaged one is never used. Reading models back lives in ``foxlm.models.loading``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from ..data.assets import read_json, replace_folder, sha256_file, temporary_path
from ..data.tokenizer import same_tokenizer
from ..models import FoxConfig
from ..models.card import write_model_card
from ..models.loading import (DAMAGED_MODEL, SHARDS, checkpoint_step, is_sharded, latest_valid_checkpoint,
                              list_checkpoints, load_checkpoint_model, read_model_weights, resolve_model_dir,
                              verify_checkpoint, write_manifest)
from ..presets import has_size
from .config import model_fields
from .safe_dcp import load_shards, read_shard_metadata

__all__ = ["DiskFullError", "check_out_dir", "check_run_folder", "checkpoint_name", "checkpoint_step",
           "conflicting_checkpoints",
           "PendingCheckpoint", "export_model",
           "full_state_dicts", "initialize_model", "is_run_checkpoint", "latest_valid_checkpoint", "list_checkpoints",
           "load_checkpoint_model", "load_trainer_state", "lock_run", "read_model_weights", "resolve_model_dir",
           "restore_checkpoint",
           "resume_point", "verify_checkpoint", "write_checkpoint"]

# Settings that change what a run shows, not what it trains: not reported as changed on resume.
DISPLAY_KEYS = {"resume", "progress", "tensorboard", "wandb", "log_every", "peak_tflops", "sample_prompt", "sample_tokens",
                "export_dir", "async_checkpoint"}


# in every out_dir a run has taken: the run's files there are its own to overwrite
RUN_MARKER = ".foxlm-run"


class DiskFullError(OSError):
    """A checkpoint could not be written because its disk is full."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


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
        import torch.distributed.checkpoint as dcp

        with self._failing():
            if background is None:
                dcp.save(shards, checkpoint_id=self.tmp / SHARDS)  # fsyncs its files
            else:
                self.future = dcp.async_save(shards, checkpoint_id=self.tmp / SHARDS, process_group=background)

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
                _fsync_tree(tmp)
        if not self.main:
            return None
        replace_folder(self.tmp, self.final)  # a step saved again (Trainer.save called twice) is swapped, never lost
        _write_atomic(self.final.parent / "latest", self.final.name)
        for old in list_checkpoints(self.run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """On rank 0, a failed write removes the temporary folder; a full disk becomes ``DiskFullError``."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as e:
            if not self.main:
                raise
            full = _disk_full(e, self.tmp)
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


def check_run_folder(run_dir: Path) -> None:
    """Refuse an ``out_dir`` holding files no run wrote, which a run would overwrite (``log.jsonl``,
    ``train_config.yaml``, ``tb/``) or mix its own with. Taken: a new or empty folder, a run's (marked by
    ``lock_run``), and one holding checkpoints (a run's from before the mark; ``check_out_dir`` says whether this run
    may continue them)."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise NotADirectoryError(f"out_dir: {run_dir} is a file; expected a folder for the run")
    if (run_dir / RUN_MARKER).is_file() or list_checkpoints(run_dir):
        return
    entries = sorted(e.name for e in run_dir.iterdir())
    if entries:
        raise ValueError(f"out_dir: {run_dir} holds files no foxlm run wrote ({', '.join(entries[:5])}"
                         f"{', ...' if len(entries) > 5 else ''}), which a run would overwrite or mix with its own; "
                         "train into a new or empty out_dir")


def lock_run(run_dir: str | os.PathLike) -> IO[str] | None:
    """An exclusive lock on a run folder (its ``.lock`` file, which records the holder's pid), held while the
    returned file stays open, or None if another process holds it; the folder is marked as a run's
    (``check_run_folder``). The OS releases the lock with its process, killed or not. Where ``fcntl`` is missing (not
    POSIX) or the filesystem has no ``flock``, the file is returned unlocked."""
    marker = Path(run_dir) / RUN_MARKER
    if not marker.is_file():
        marker.write_text("a foxlm train run's out_dir: its log.jsonl, train_config.yaml, tb/ and checkpoints/\n")
    f = open(Path(run_dir) / ".lock", "a+")
    if fcntl is not None:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        except OSError as e:  # a filesystem without flock (some FUSE or network mounts): run unlocked
            warnings.warn(f"out_dir: cannot lock {run_dir} ({e}); a second run there would not be detected",
                          stacklevel=2)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_run_checkpoint(run_dir: str | os.PathLike, ckpt: str | os.PathLike) -> bool:
    """Whether checkpoint folder ``ckpt`` is one of ``run_dir``'s."""
    return Path(ckpt).resolve().parent == (Path(run_dir) / "checkpoints").resolve()


def conflicting_checkpoints(run_dir: str | os.PathLike, start: str | os.PathLike | None) -> list[Path]:
    """The checkpoints of ``run_dir`` that a run starting from checkpoint ``start`` (None: from scratch) would mix
    its own with, and prune by step: all of them, unless ``start`` is one of them; then those after it."""
    found = list_checkpoints(run_dir)
    if start is None or not is_run_checkpoint(run_dir, start):
        return found
    return [p for p in found if checkpoint_step(p) > checkpoint_step(start)]

def resume_point(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint a run resumes from, as ``resume`` (auto | never | a checkpoint path) says; None: none."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_valid_checkpoint(run_dir)
    return Path(resume).expanduser()


def check_out_dir(run_dir: Path, ckpt: Path | None, resume: str) -> None:
    """Refuse to train into checkpoints a run starting from ``ckpt`` (found as ``resume`` says) does not continue
    from: its saves would interleave with them, and keeping the last ``keep_last`` by step would delete them, or the
    run's own."""
    in_the_way = conflicting_checkpoints(run_dir, ckpt)
    if not in_the_way:
        return
    names = ", ".join(p.name for p in in_the_way[:3]) + (", ..." if len(in_the_way) > 3 else "")
    where = f"out_dir: {run_dir} holds"
    if ckpt is None and resume == "auto":
        problem, fix = f"{where} only checkpoints that do not verify ({names})", "move them away"
    elif ckpt is None:
        problem, fix = f"{where} another run's checkpoints ({names})", "resume=auto to continue that run"
    elif not is_run_checkpoint(run_dir, ckpt):
        problem, fix = f"{where} checkpoints of another run than {ckpt}'s ({names})", "move them away"
    else:
        problem, fix = f"{where} checkpoints after {ckpt.name}, which this run resumes from ({names})", \
            f"move them away to go on from {ckpt.name}"
    raise ValueError(f"{problem}: this run's saves would be mixed with them and pruned by step. Train into a new "
                     f"out_dir, or {fix}")


def load_trainer_state(ckpt: str | os.PathLike) -> dict:
    """The non-model state of a verified checkpoint (safe: ``weights_only=True``)."""
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(f"checkpoint {ckpt}: {problem}; refusing to load it")
    return torch.load(Path(ckpt) / "trainer.pt", map_location="cpu", weights_only=True)


def full_state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state dicts on the CPU, by their parameter names (one process's save; runs
    of several save shards instead)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options), get_optimizer_state_dict(module, optimizer, options=options)


def model_name(cfg: dict) -> str:
    """"fox-pro tiny" ("hf:llama" for a Hugging Face model, which has no size), with the config's model overrides."""
    name = f"{cfg['arch']} {cfg['size']}" if has_size(cfg["arch"]) else cfg["arch"]
    return name + (f" with model={cfg['model']}" if cfg["model"] else "")


def _weights_differ(found: dict[str, tuple[int, ...]], module: torch.nn.Module) -> str | None:
    """None if weights of these names and shapes are exactly ``module``'s (unsharded), else how they differ."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    if found == expected:
        return None
    differ = sorted(set(found) ^ set(expected)) or [n for n in expected if found[n] != expected[n]]
    return (f"{len(differ)} weights differ (e.g. {differ[0]}: {found.get(differ[0], 'absent')} there, "
            f"{expected.get(differ[0], 'absent')} here)")


def restore_checkpoint(ckpt: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, tok_spec: dict,
                       config: dict) -> tuple[dict, list[str]]:
    """Load a verified checkpoint's weights and optimizer state into ``module`` (unwrapped) and ``optimizer``, after
    checking that it was trained on ``tok_spec`` data as the same model. Returns its trainer state (counters, loader,
    RNG) and the settings of training config ``config`` that differ from the checkpoint's ("key: old -> new")."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = load_trainer_state(ckpt)  # verifies the manifest first
    if not same_tokenizer(state["tokenizer"], tok_spec):  # its content: the folder may have moved since
        raise ValueError(f"tokenizer: the checkpoint was trained with {state['tokenizer']}, the data is {tok_spec}")
    sharded = is_sharded(ckpt)
    weights = None if sharded else read_model_weights(resolve_model_dir(ckpt, "resume"), "resume")
    found = _sharded_model_shapes(ckpt) if sharded else {name: tuple(t.shape) for name, t in weights.items()}
    problem = _weights_differ(found, module)
    if problem is not None:
        raise ValueError(f"resume: {ckpt} was trained as {model_name(state['config'])}, this config is "
                         f"{model_name(config)}: {problem}. Train into a new out_dir to start this model")
    if sharded:  # each process reads its own part, whatever the number of processes that wrote them
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        shards = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}
        load_shards(shards, ckpt / SHARDS, "resume", no_dist=not dist.is_initialized())
        set_model_state_dict(module, shards["model"])
        set_optimizer_state_dict(module, optimizer, shards["optimizer"])
    else:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, weights, options=options)
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=options)
    changed = [f"{key}: {was!r} -> {config[key]!r}" for key, was in state["config"].items()
               if key not in DISPLAY_KEYS and key in config and config[key] != was]
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
    keys = (model_fields() - {"train_length"} if isinstance(model_config, FoxConfig)
            else set(now) - {"transformers_version"})
    return folder, [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in sorted(keys)
                    if key in saved and saved[key] != now[key]]


def _sharded_model_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """The names and full shapes of a sharded checkpoint's model weights, from its DCP metadata."""
    metadata = read_shard_metadata(ckpt / SHARDS, "resume").state_dict_metadata
    return {key[len("model."):]: tuple(meta.size) for key, meta in metadata.items() if key.startswith("model.")}


def export_model(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the model of ``src`` (a run folder: its latest valid checkpoint, or a checkpoint folder, sharded or not)
    as a ``save_pretrained`` folder ``dst`` (safetensors, with the tokenizer where the checkpoint has one), for
    ``AutoModelForCausalLM.from_pretrained``. One process; a sharded checkpoint's weights are read whole into it.
    ``dst`` must not exist; it appears complete or not at all."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if (src / "config.json").is_file():  # an export's manifest would pass it for a checkpoint
        raise ValueError(f"src: {src} is a save_pretrained folder already; export reads a run or checkpoint folder")
    ckpt = latest_valid_checkpoint(src) if (src / "checkpoints").is_dir() else src
    if ckpt is None:
        raise FileNotFoundError(f"src: run {src} has no complete checkpoint")
    if not (ckpt / "manifest.json").is_file():
        raise FileNotFoundError(f"src: {src} is neither a run folder nor a checkpoint folder (no manifest.json)")
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(f"src: checkpoint {ckpt}: {problem}; refusing to export it")
    if dst.exists():
        raise FileExistsError(f"dst: {dst} exists; export into a new folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(dst, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's, whose PID this process has now
    try:
        shutil.copytree(ckpt / "model", tmp)  # config, tokenizer, and the weights of an unsharded checkpoint
        if is_sharded(ckpt):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))  # foxlm's or any registered
            weights = model.state_dict()
            load_shards({"model": weights}, ckpt / SHARDS, "src", no_dist=True)  # the model's keys only
            model.load_state_dict(weights)
            model.save_pretrained(tmp)
        run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
        step = checkpoint_step(ckpt)
        write_model_card(tmp, title=dst.name, run_dir=run_dir, step=step, source=(
            f"Exported by `foxlm export` from step {step} of the `foxlm train` run `{run_dir or ckpt}`. Load it with "
            "`import foxlm` and `AutoModelForCausalLM.from_pretrained`."))
        write_manifest(tmp)  # checked whenever foxlm loads it
        _fsync_tree(tmp)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
