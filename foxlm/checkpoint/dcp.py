"""Sharded checkpoints (torch.distributed.checkpoint, DCP): each process saves and loads its own part of the model
and optimizer state, and nothing is read as code.

Saving is DCP's own (``save_shards``); reading is not. torch's ``FileSystemReader`` unpickles ``.metadata`` with
plain ``pickle``, and its ``DefaultLoadPlanner`` loads the non-tensor entries of the ``.distcp`` shards (the
optimizer's hyperparameters) with ``torch.load(weights_only=False)``: either runs whatever a crafted file names, and
a checkpoint's manifest is written by whoever wrote it. Here the metadata is unpickled with DCP's own metadata
classes allowed and nothing else, and bytes entries with ``weights_only=True``; anything more is refused as
``UnsafeCheckpointError``. Tensors DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # private, as DefaultLoadPlanner uses it (2.11-2.13)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["UnsafeCheckpointError", "full_state_dicts", "load_sharded", "load_shards", "read_shard_metadata",
           "save_shards", "sharded_model_shapes", "sharded_state_dicts"]

# What a DCP .metadata pickle names (torch 2.11 to 2.13): its dataclasses, the sizes, dtypes and layouts of tensors,
# and the checkpoint's path. Each is plain data: building one runs nothing of the file's choosing.
_METADATA_CLASSES = {
    *{("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
    *{(module, name) for module in ("pathlib", "pathlib._local")  # pathlib._local: Python 3.13's
      for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")},
}
_REFUSED = "refusing to unpickle it (it could run code)"


class UnsafeCheckpointError(ValueError):
    """A sharded checkpoint holds something that loading it would run as code, or that is not DCP's."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not a DCP metadata class")


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` unpickles DCP's metadata classes only; ``arg`` (the argument
    that named the checkpoint) starts its errors."""

    def __init__(self, path: str | os.PathLike, arg: str = "checkpoint"):
        super().__init__(path)
        self.arg = arg

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, KeyError, TypeError, ValueError) as e:
            raise UnsafeCheckpointError(f"{self.arg}: {path}: {_REFUSED}: {e}") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{self.arg}: {path} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with bytes entries loaded by ``torch.load(weights_only=True)``: plain numbers, strings,
    tuples, lists and dicts, all an optimizer's hyperparameters are."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message: its advice, then why, then a link; why is kept
            why = [p.strip() for p in str(e).split("\n\n")[1:] if p.strip() and "documentation" not in p]
            reason = why[0].splitlines()[0] if why else "it is not plain data"
            raise UnsafeCheckpointError(f"entry {fqn}: {_REFUSED}: {reason}") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes stores what it loads
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def read_shard_metadata(folder: str | os.PathLike, arg: str = "checkpoint") -> Metadata:
    """The DCP metadata of shard folder ``folder``, unpickled safely (else ``UnsafeCheckpointError``, naming the
    argument ``arg``)."""
    return SafeFileSystemReader(folder, arg).read_metadata()


def load_shards(state_dict: dict, folder: str | os.PathLike, arg: str = "checkpoint", no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=folder)`` (in place; every process of the
    default group calls it unless ``no_dist``), reading nothing as code: ``UnsafeCheckpointError`` instead, naming
    the argument ``arg``."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(folder, arg)
    reader.read_metadata()  # DCP would log a refused metadata file as missing, and fail without saying why
    try:
        dcp.load(state_dict, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # each process's failure, wrapped; a refusal is the user's to see
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise UnsafeCheckpointError(f"{arg}: {Path(folder)}: {refused[0]}") from None
        raise


def sharded_state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This process's part of the model's and optimizer's state dicts (``{"model": ..., "optimizer": ...}``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}


def full_state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state dicts on the CPU, by their parameter names (one process's save; runs
    of several save shards instead)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options), get_optimizer_state_dict(module, optimizer, options=options)


def save_shards(shards: dict, folder: str | os.PathLike, background=None):
    """Write this process's ``shards`` into ``folder`` (collective; DCP fsyncs its files); with ``background`` (a
    process group used by nothing else) in a thread, from a copy in CPU memory: returns the future to wait on."""
    import torch.distributed.checkpoint as dcp

    if background is None:
        dcp.save(shards, checkpoint_id=folder)
        return None
    return dcp.async_save(shards, checkpoint_id=folder, process_group=background)


def load_sharded(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str | os.PathLike,
                 arg: str = "checkpoint", no_dist: bool = False) -> None:
    """Load ``folder``'s shards into ``module`` and ``optimizer``: each process reads its own part, whatever the number
    of processes that wrote them (safely, as ``load_shards``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    shards = sharded_state_dicts(module, optimizer)
    load_shards(shards, folder, arg, no_dist=no_dist)
    set_model_state_dict(module, shards["model"])
    set_optimizer_state_dict(module, optimizer, shards["optimizer"])


def sharded_model_shapes(folder: str | os.PathLike, arg: str = "checkpoint") -> dict[str, tuple[int, ...]]:
    """The names and full shapes of the model weights in shard folder ``folder``, from its DCP metadata."""
    metadata = read_shard_metadata(folder, arg).state_dict_metadata
    return {key[len("model."):]: tuple(meta.size) for key, meta in metadata.items() if key.startswith("model.")}
