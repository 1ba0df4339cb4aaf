"""``foxlm convert``: the FoX authors' released checkpoints and fla's ForgettingTransformer models as foxlm folders, and
foxlm folders back in the authors' format. The mapping of configs and tensors is ``state_dict_adapter.py``'s; this
module reads the source folder and writes the converted one (atomically, with a manifest and a model card).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint.files import file_above, read_json, remove_stale_temporaries, replace_folder, temporary_path
from ..checkpoint.manifest import MANIFEST, verify_model_folder, write_manifest
from ..checkpoint.weights import DAMAGED_MODEL, add_shard, index_shards, reading_weights, resolve_model_dir
from .card import write_model_card
from .configuration_fox import FoxConfig
from .state_dict_adapter import FORMATS, authors_config, fla_config, foxlm_to_authors, peer_to_foxlm, to_authors_config

if TYPE_CHECKING:
    from ..data.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------------- reading
def read_folder(src: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, the state dict) of a ``save_pretrained`` folder: ``model.safetensors``, sharded
    safetensors (``model.safetensors.index.json``), or ``pytorch_model.bin`` (sharded or not) read with
    ``torch.load(weights_only=True)``; the first of these the folder holds, in that order, as ``from_pretrained``
    reads it (an unsharded save over a sharded one leaves the index behind, and the reverse the single file)."""
    from safetensors.torch import load_file

    folder = Path(src).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"src: {folder} holds no config.json (expected a save_pretrained folder)")
    verify_model_folder(folder, "src")
    config = read_json(folder / "config.json", DAMAGED_MODEL)
    weights: dict[str, torch.Tensor] = {}
    for index, single, load in (
        ("model.safetensors.index.json", "model.safetensors", lambda p: load_file(p, device="cpu")),
        ("pytorch_model.bin.index.json", "pytorch_model.bin",
         lambda p: torch.load(p, map_location="cpu", weights_only=True)),
    ):
        if (folder / single).is_file():
            shards = [single]
        elif (folder / index).is_file():
            shards = index_shards(folder / index, "src")
        else:
            continue
        for shard in shards:
            with reading_weights(folder / shard, "src"):
                part = load(folder / shard)
            if not isinstance(part, dict) or not all(isinstance(t, torch.Tensor) for t in part.values()):
                raise ValueError(f"src: {folder / shard} holds no state dict (a dict of tensors)")
            add_shard(weights, part, folder / shard, "src")
        return config, weights
    raise ValueError(f"src: {folder} holds no model.safetensors, sharded safetensors or pytorch_model.bin")


def _model_folder(src: Path) -> Path:
    """The model folder to read: ``src``, or the model of a run folder (its latest valid checkpoint) or of a checkpoint
    folder, as ``generate`` and ``eval`` take them."""
    if not src.exists():
        raise FileNotFoundError(f"src: {src} does not exist")
    if not (src / "config.json").is_file() and ((src / "checkpoints").is_dir() or (src / "model").is_dir()):
        return resolve_model_dir(src, "src")  # verified; a sharded checkpoint is refused naming `foxlm export`
    return src


def _dtype_of(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's dtype: that of its floating tensors, or float32 where they mix dtypes (no tensor loses
    precision). config.json's dtype field is not read: it is a label, and a wrong one would cast the weights down."""
    found = {t.dtype for t in weights.values() if t.is_floating_point()}
    if not found <= set(DTYPES.values()):
        names = sorted(str(d).removeprefix("torch.") for d in found - set(DTYPES.values()))
        raise ValueError(f"dtype: the weights hold {', '.join(names)} tensors; pass one of {sorted(DTYPES)}")
    return found.pop() if len(found) == 1 else torch.float32


def _stored_dtype(name: str, t: torch.Tensor, target: torch.dtype, to: str) -> torch.dtype:
    """The dtype tensor ``name`` is written in: ``target``, except that a foxlm model's forget gate and token shift
    are never narrowed (they stay fp32 when from_pretrained loads the model in bf16 or fp16: their error sums over the
    whole context), as ``from_pretrained(dtype=...)`` then ``save_pretrained`` would store them."""
    from .modeling_fox import FoxPreTrainedModel, _names_module

    if to == "foxlm" and any(_names_module(name, key) for key in FoxPreTrainedModel._keep_in_fp32_modules_strict):
        return torch.promote_types(target, t.dtype)
    return target


# ------------------------------------------------------------------------------------------------------------ output
# what convert writes into DST (save_pretrained's files, sharded or not): --overwrite replaces a folder with no more
WRITTEN = re.compile(r"(generation_)?config\.json|model(-\d{5}-of-\d{5})?\.safetensors"
                     r"|model\.safetensors\.index\.json|manifest\.json|README\.md|tokenizer(_config)?\.json")
# the copy of its tokenizer a foxlm model folder carries (``save_pretrained`` of a GPT-2 or tokenizer.json folder one)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _prepare_dst(dst: Path, src: Path, overwrite: bool) -> None:
    """Refuse to write over anything but a model folder of a known kind holding nothing but what convert writes, and
    that only with ``overwrite``; never the home folder or a folder holding the source."""
    if dst.resolve() == src.resolve():
        raise ValueError(f"dst: {dst} is the source folder; convert into another folder")
    if dst.resolve() in src.resolve().parents:
        raise ValueError(f"dst: {dst} holds the source {src}; convert into a folder outside it")
    if dst.resolve() == Path.home().resolve():
        raise ValueError(f"dst: {dst} is the home folder; convert into a folder of its own")
    if (holder := _in_manifest_of(dst)) is not None:
        raise ValueError(f"dst: {dst} is part of the checkpoint {holder}; convert into a folder of its own")
    if not dst.exists() or (dst.is_dir() and not any(dst.iterdir())):
        if (parent := file_above(dst)) is not None:
            raise ValueError(f"dst: {parent} is a file, not a folder to write {dst} in")
        return
    model_type = None
    if (dst / "config.json").is_file():
        try:
            model_type = json.loads((dst / "config.json").read_text()).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            pass
    if model_type not in FORMATS or FORMATS[model_type] == "fla":
        raise ValueError(f"dst: {dst} exists and is not a foxlm or FoX-authors model folder; refusing to replace it")
    if not overwrite:
        raise ValueError(f"dst: {dst} exists; pass overwrite=True (--overwrite) to replace it")
    foreign = sorted(e.name for e in dst.iterdir() if not WRITTEN.fullmatch(e.name) or not e.is_file())
    if foreign:
        raise ValueError(f"dst: {dst} holds files convert did not write ({', '.join(foreign[:5])}"
                         f"{', ...' if len(foreign) > 5 else ''}); --overwrite replaces only a folder holding nothing "
                         "but a converted model: convert into a new folder")


def _in_manifest_of(dst: Path) -> Path | None:
    """The folder (a run's checkpoint) whose manifest.json hashes files under ``dst`` (its model/), if any: replacing
    them would break it."""
    manifest = dst.parent / MANIFEST
    try:
        files = json.loads(manifest.read_text()).get("files") if manifest.is_file() else None
    except (OSError, ValueError, AttributeError):  # unreadable: nothing foxlm would use as a checkpoint
        return None
    prefix = f"{dst.name}/"
    return dst.parent if isinstance(files, dict) and any(str(name).startswith(prefix) for name in files) else None


def _tokenizer(src: Path, raw: dict, fmt: str, tokenizer: str | None, vocab_size: int) -> Tokenizer | None:
    """The tokenizer to record (a ``foxlm.data`` tokenizer): ``tokenizer`` if given, else SRC's (``_src_tokenizer``).
    Its ids must fit the model's ``vocab_size`` embedding rows (more would index past them later), or this raises
    naming --tokenizer; only the authors' default, guessed where SRC says nothing, is then left unrecorded instead (a
    model of fewer rows was not trained on their data). Where SRC's tokenizer is left unrecorded, as that guess or as
    one SRC names but foxlm cannot read, one stderr line says so and names --tokenizer."""
    from ..data.tokenizer import get_tokenizer

    tok, unsure = (get_tokenizer(tokenizer), None) if tokenizer is not None else _src_tokenizer(src, raw, fmt)
    if tok is not None and tok.vocab_size <= vocab_size:
        return tok
    if tok is not None and unsure is None:
        where = "--tokenizer" if tokenizer is not None else f"{src}'s tokenizer"
        raise ValueError(f"tokenizer: {tok.name} ({where}) has {tok.vocab_size} ids, more than the model's vocabulary "
                         f"of {vocab_size}; pass --tokenizer naming the tokenizer it was trained with")
    if unsure is not None:
        guess = "" if tok is None else (f", and the FoX authors' {tok.name} ({tok.vocab_size} ids) does not fit its "
                                        f"vocabulary of {vocab_size}")
        print(f"src: {unsure}{guess}: none recorded (pass --tokenizer to record the one it was trained with)",
              file=sys.stderr)
    return None


def _src_tokenizer(src: Path, raw: dict, fmt: str) -> tuple[Tokenizer | None, str | None]:
    """(The tokenizer SRC names or None, and None or why that is unsure: the line said where none is recorded): what SRC
    records (foxlm's key, found in SRC's copy first); else the authors' JSON GPT-2 where its tokenizer_config.json names
    it; else the tokenizer SRC's own files hold (a ``tokenizer.json``, as ``save_pretrained`` writes it, or GPT-2's
    files): fla's checkpoints carry their tokenizer so; else GPT-2 where tokenizer_config.json names a GPT-2 class (and
    any vocab.json / merges.txt beside it are GPT-2's); else none where tokenizer_config.json names another tokenizer
    (or none), whose files foxlm cannot read (unsure); else the authors' JSON GPT-2 for their format (the default, a
    guess: unsure); else none. An authors' model with GPT-2's tokenizer is their JSON GPT-2 whatever class saved it:
    GPT-2 BPE saw their data (LongCrawl64) only JSON-escaped, and raw text would give it ids in an order it never
    saw."""
    from ..data.tokenizer import get_tokenizer, tokenizer_from_spec

    if (record := raw.get("foxlm_tokenizer")) is not None:  # SRC's own copy first: the recorded folder may move
        if not isinstance(record, dict) or not isinstance(record.get("name"), str):
            raise ValueError(f"src: {src / 'config.json'} records foxlm_tokenizer={record!r}, expected a "
                             "tokenizer record (a mapping with a name); pass --tokenizer")
        return tokenizer_from_spec(record, [src]), None
    has_config = (src / "tokenizer_config.json").is_file()
    cls = read_json(src / "tokenizer_config.json", "pass --tokenizer").get("tokenizer_class") if has_config else None
    if cls == "JSONGPT2Tokenizer":
        return get_tokenizer("json-gpt2"), None
    if (src / "tokenizer.json").is_file() or (src / "encoder.json").is_file():
        # the files, not the class name: a GPT2TokenizerFast of another vocabulary is no GPT-2 (a folder that
        # gives GPT-2's ids is named "gpt2")
        try:
            tok = get_tokenizer(str(src))
        except ValueError as e:
            raise ValueError(f"src: {e}; pass --tokenizer") from e
    elif cls in ("GPT2Tokenizer", "GPT2TokenizerFast"):
        if (different := _not_gpt2_files(src)) is not None:
            raise ValueError(f"src: {src / different} is not GPT-2's, though tokenizer_config.json names {cls}; "
                             "pass --tokenizer")
        tok = get_tokenizer("gpt2")
    elif has_config:
        named = f", and its tokenizer_config.json names {cls}" if isinstance(cls, str) and cls else ""
        return None, (f"{src} holds no tokenizer files foxlm reads (a tokenizer.json, or encoder.json and vocab.bpe)"
                      f"{named}")
    else:
        return (get_tokenizer("json-gpt2"), f"{src} names no tokenizer") if fmt == "fox-authors" else (None, None)
    return (get_tokenizer("json-gpt2") if fmt == "fox-authors" and tok.name == "gpt2" else tok), None


def _not_gpt2_files(src: Path) -> str | None:
    """The first of a slow GPT-2 tokenizer's files in ``src`` (vocab.json, merges.txt: GPT-2's encoder.json and
    vocab.bpe under transformers' names) whose content is not GPT-2's, or None."""
    from ..data.assets import gpt2_files

    def merges(path: Path) -> list[str]:  # the merge rules, without the "#version" header
        return [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                if line and not line.startswith("#")]

    encoder, bpe = gpt2_files()
    if (src / "vocab.json").is_file() and read_json(src / "vocab.json", "pass --tokenizer") != read_json(encoder, ""):
        return "vocab.json"
    if (src / "merges.txt").is_file() and merges(src / "merges.txt") != merges(bpe):
        return "merges.txt"
    return None


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str = "auto",
    to: str = "foxlm",
    dtype: str = "auto",
    tokenizer: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert the model folder ``src`` (or the model of a foxlm run or checkpoint folder) into ``dst``; returns
    ``dst``.

    src_format: "auto" (from config.json's model_type), "fox-authors" or "fla" (for ``to="foxlm"``), "foxlm" (for
        ``to="fox-authors"``). to: "foxlm" (a folder ``AutoModelForCausalLM`` loads after ``import foxlm``) or
        "fox-authors" (the authors' classes' format). dtype: "auto" (the source weights': float32 where they mix
        dtypes) or float32 / bfloat16 / float16.
    tokenizer: the tokenizer to record in a foxlm ``dst`` (default: what ``src`` records or carries; the authors'
        models: their JSON-escaped GPT-2, "json-gpt2", also where ``src`` carries GPT-2's files); its ids must fit
        the model's vocabulary. ``dst`` carries a copy of its files, as a run's model folder does, and so does an
        authors' ``dst`` of the copy ``src`` carries.
    overwrite: replace an existing foxlm / authors model folder at ``dst``.
    """
    from .modeling_fox import FoxForCausalLM

    src = _model_folder(Path(src).expanduser())
    dst = Path(os.path.abspath(Path(dst).expanduser()))  # "." and ".." name their folder
    if dst.is_symlink():  # the model goes where the link points, and the link stays (a swap would move it)
        dst = dst.resolve()
    if to not in ("foxlm", "fox-authors"):
        raise ValueError(f"to: expected 'foxlm' or 'fox-authors', got {to!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype: expected 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    if tokenizer is not None and to != "foxlm":  # it was dropped: the authors' format keeps what SRC records
        raise ValueError(f"tokenizer: --to {to} carries the tokenizer SRC records; --tokenizer names the one to record "
                         "converting to foxlm")
    raw, weights = read_folder(src)
    found = FORMATS.get(raw.get("model_type"))
    remote = raw.get("auto_map")  # classes in SRC's own .py files: remote code, which convert never runs
    if found is None:
        raise ValueError(f"src: model_type {raw.get('model_type')!r} is none of {sorted(FORMATS)}"
                         + ("; its auto_map names remote code, which convert never runs" if remote else ""))
    if src_format not in ("auto", found):
        raise ValueError(f"src_format: {src} holds a {found!r} model (model_type {raw['model_type']!r}), "
                         f"not {src_format!r}")
    wanted = ("fox-authors", "fla") if to == "foxlm" else ("foxlm",)
    if found not in wanted:
        raise ValueError(f"src: a {found!r} model converts to {to!r} only from {' or '.join(wanted)}")
    _prepare_dst(dst, src, overwrite)
    if remote:  # as from_pretrained without trust_remote_code where the model_type's classes are installed
        names = ", ".join(sorted(remote)) if isinstance(remote, dict) else str(remote)
        print(f"src: ignored {src / 'config.json'}'s auto_map ({names}): remote code is never run; read as "
              f"{found}'s model_type {raw['model_type']!r}", file=sys.stderr)
    target = _dtype_of(weights) if dtype == "auto" else DTYPES[dtype]

    if to == "foxlm":
        fields = authors_config(raw, weights) if found == "fox-authors" else fla_config(raw, weights)
        tok = _tokenizer(src, raw, found, tokenizer, fields["vocab_size"])
        cfg = FoxConfig(**fields, **({} if tok is None else {"foxlm_tokenizer": tok.spec()}))
        state = peer_to_foxlm(weights, cfg, found)
    else:
        cfg = FoxConfig.from_dict(raw)
        state = foxlm_to_authors(weights, cfg)
        out_config = {**to_authors_config(cfg), "torch_dtype": str(target).removeprefix("torch.")}
        if getattr(cfg, "foxlm_tokenizer", None) is not None:
            out_config["foxlm_tokenizer"] = cfg.foxlm_tokenizer
    state = {k: v.to(_stored_dtype(k, v, target, to)) if v.is_floating_point() else v for k, v in state.items()}

    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dst)
    tmp = temporary_path(dst, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's, whose PID this process has now
    tmp.mkdir()
    try:
        if to == "foxlm":
            with torch.device("meta"):
                model = FoxForCausalLM(cfg)
            model.load_state_dict(state, strict=True, assign=True)  # shapes checked against the config
            model.save_pretrained(tmp)
            if hasattr(tok, "save_pretrained"):  # a copy, as foxlm train's model folders carry: its folder may move
                tok.save_pretrained(tmp)
        else:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
            if "foxlm_tokenizer" in out_config:  # SRC's copy of the recorded tokenizer, for converting back
                for name in TOKENIZER_FILES:
                    if (src / name).is_file():
                        shutil.copyfile(src / name, tmp / name)
        loads = ("Load it with `import foxlm` and `AutoModelForCausalLM.from_pretrained`." if to == "foxlm"
                 else "It is in the FoX authors' format, for their model classes.")
        write_model_card(tmp, title=dst.name,
                         source=f"Converted by `foxlm convert` from `{src}` (a {found} model). {loads}")
        write_manifest(tmp)  # checked whenever foxlm loads it
        replace_folder(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
