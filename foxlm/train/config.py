"""``TrainConfig``: one YAML file plus ``key=value`` overrides; unknown keys are errors.

``foxlm train --config NAME_OR_YAML lr=2e-3 model.acp=true`` — top-level keys are the fields below;
``model.*`` keys override fields of ``FoxConfig`` (on top of ``arch`` / ``size``). ``--config`` takes a YAML file or
the name of a config shipped in ``foxlm/configs/`` (``default``: the embedded Shakespeare job; ``fox-pro-125m``, ...),
which works from any folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..presets import (
    ARCHS,
    BASELINES,
    FOX_FIELDS,
    HF_PREFIX,
    SIZES,
    baseline_fields,
    check_fla,
    derived_fields,
    has_size,
    is_hf_arch,
    preset_fields,
)

PACKAGED = Path(__file__).resolve().parent.parent / "configs"


def _key(default, help: str = ""):
    """A config key: its default (a dict default is copied for each config) and the meaning ``foxlm train --help``
    shows."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # model
    arch: str = _key("fox-pro", "fox-llama | fox-pro | transformer-llama | transformer-pro; the recurrent baselines "
                     "mamba2 | hgrn2 | delta-net | gated-delta-net (fla's need a GPU); or any model registered with "
                     "AutoModelForCausalLM: hf:MODEL_TYPE (e.g. hf:llama) or a config.json path, its fields set by "
                     "model.*")
    size: str = _key("tiny", "tiny | 125m | 360m | 760m (foxlm's models and the baselines)")
    model: dict = _key({}, "the model config's overrides, e.g. {acp: true, hidden_size: 256}")
    init_from: str | None = _key(None, "start from a trained model's weights (a run folder, a checkpoint or a "
                                 "save_pretrained folder), with a new optimizer, schedule and step count: fine-tuning, "
                                 "or training on at a longer seq_len; the weights must fit the model that arch, size "
                                 "and model.* build. Unused when the run resumes (resume=auto finding a checkpoint in "
                                 "out_dir, or resume=PATH).")
    # data
    data: str = _key("shakespeare", 'a `foxlm data prepare` folder, or "shakespeare" (the embedded corpus)')
    tokenizer: str | None = _key(None, "expected tokenizer name; None: whatever the data was prepared with")
    seq_len: int = _key(256, "tokens per training sequence")
    batch_size: int = _key(16, "sequences per optimizer step, over all processes")
    micro_batch_size: int | None = _key(None, "sequences per forward per process; None: batch_size / world size")
    packing: str = _key("windows", "windows: random windows | documents: packed documents with cu_seqlens")
    # optimization
    max_steps: int = _key(1000, "optimizer steps of the run")
    lr: float = _key(1e-3, "peak learning rate, after warmup_steps of linear warmup")
    min_lr: float = _key(1e-4, "cosine floor")
    warmup_steps: int = _key(100)
    weight_decay: float = _key(0.1, "not on norms, biases, gate biases (parameters with fewer than 2 dims)")
    beta1: float = _key(0.9)
    beta2: float = _key(0.95)
    eps: float = _key(1e-8)
    grad_clip: float = _key(1.0, "0: off")
    max_bad_steps: int = _key(10, "NaN/Inf losses skipped before the run stops")
    # precision / speed / parallelism
    device: str = _key("auto", "auto | cpu | cuda | cuda:N")
    precision: str = _key("auto", "auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32")
    compile: bool = _key(False, "torch.compile each block")
    cuda_graph: bool | str = _key(False, "replay each micro-batch's forward + backward from a CUDA graph (one GPU, "
                                  "packing=windows, no compile, the Triton kernels); auto: whenever those hold")
    activation_checkpointing: bool = _key(False)
    parallel: str = _key("fsdp", "under torchrun: fsdp (FSDP2 fully_shard) | ddp")
    cp: int = _key(1, "under torchrun: processes that split each sequence (context parallel, zigzag shards); the "
                   "others (world / cp) split the batch. seq_len must be a multiple of 2 x cp; packing=windows only")
    peak_tflops: float | None = _key(None, "per device, for MFU; None: known GPUs only")
    # evaluation / logging / checkpoints
    eval_every: int = _key(100, "0: only at the end")
    eval_batches: int = _key(10, "validation batches of batch_size sequences (at most those the val split holds: "
                             "it is read once at most)")
    log_every: int = _key(10, "steps per log record; its loss is the mean of those steps' losses (skipped steps "
                          "apart: logged at once), its tokens_per_s their training throughput")
    save_every: int = _key(500, "0: only at the end")
    keep_last: int = _key(3)
    async_checkpoint: bool = _key(False, "several processes: write the shards in a background thread while training "
                                  "goes on (from a copy in CPU memory); such a checkpoint is committed, and so used, "
                                  "from the next save on. The last save waits.")
    export_dir: str | None = _key(None, "at the end, the final model as a save_pretrained folder there (foxlm "
                                  "export)")
    out_dir: str | None = _key(None, "a new or empty folder, or a run's own; None: runs/<data>-<arch>-<size> (the "
                               "default job's: runs/shakespeare-fox-pro-tiny), so runs of other data or models do not "
                               "meet")
    resume: str = _key("auto", "auto (latest valid checkpoint in out_dir, if any) | never | a checkpoint path; "
                       "out_dir may hold no checkpoint this run does not continue from")
    seed: int = _key(0, "model initialization, data order, sampling, and each process's random draws (dropout)")
    progress: bool = _key(True)
    tensorboard: bool = _key(True)
    wandb: bool = _key(False, "the metrics to Weights & Biases too (the extra [wandb]; WANDB_MODE=offline: local "
                       "files)")
    sample_prompt: str | None = _key(None, "printed sample at the end; None: the data's first tokens")
    sample_tokens: int = _key(100, "0: no sample")

    def __post_init__(self) -> None:
        if self.out_dir is None:
            self.out_dir = default_out_dir(self.arch, self.size, self.data)

    def validate(self) -> None:
        hf = is_hf_arch(self.arch)
        if not hf and self.arch not in ARCHS:
            raise ValueError(f"arch: expected one of {', '.join(ARCHS)}, the baselines {', '.join(BASELINES)}, "
                             f"{HF_PREFIX}MODEL_TYPE or a config.json path, got {self.arch!r}")
        choices = {"size": SIZES, "packing": ("windows", "documents"),
                   "precision": ("auto", "bf16", "fp32"), "parallel": ("fsdp", "ddp")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {sorted(allowed)}, got {getattr(self, name)!r}")
        for name in ("seq_len", "batch_size", "max_steps", "eval_batches", "log_every", "keep_last", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.seq_len < 2:  # a sequence of one token predicts nothing: the step's loss would divide by 0 targets
            raise ValueError(f"seq_len: expected at least 2 tokens (a target needs a token before it), got "
                             f"{self.seq_len}")
        for name in ("warmup_steps", "eval_every", "save_every", "max_bad_steps", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {getattr(self, name)}")
        # numpy's generators (the data order: default_rng([seed, step])) take no negative seed, torch's none past 64
        # bits: the first step failed with "expected non-negative integer", after the run had taken out_dir
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: expected an integer in [0, 2**64), got {self.seed}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: expected a positive integer, got {self.micro_batch_size}")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:  # no world size fits
            raise ValueError(f"batch_size: {self.batch_size} is not a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")
        # the syntax only: whether this machine has that GPU is the trainer's check (reading or printing a config
        # needs no torch)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr: expected a positive, finite learning rate, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr: expected 0 <= min_lr <= lr={self.lr}, got {self.min_lr}")
        for name in ("beta1", "beta2"):  # what torch's AdamW would refuse mid-setup, naming no key
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a number in [0, 1), got {getattr(self, name)}")
        if not 0 < self.eps < math.inf:  # eps=0 divides 0 by 0 for a weight whose gradients are all zero
            raise ValueError(f"eps: expected a positive, finite number, got {self.eps}")
        for name in ("weight_decay", "grad_clip"):  # NaN fails too
            if not 0 <= getattr(self, name) < math.inf:
                off = " (0: no clipping)" if name == "grad_clip" else ""
                raise ValueError(f"{name}: expected a non-negative, finite number{off}, got {getattr(self, name)}")
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:  # MFU divides by it
            raise ValueError(f"peak_tflops: expected a positive, finite number (or null), got {self.peak_tflops}")
        if self.cuda_graph not in (True, False, "auto"):
            raise ValueError(f"cuda_graph: expected true, false or auto, got {self.cuda_graph!r}")
        if self.cuda_graph is True and (self.packing != "windows" or self.compile):
            raise ValueError("cuda_graph: needs packing=windows (packed documents change shape every batch) and "
                             "compile=false (torch.compile's mode='reduce-overhead' is its compiled form)")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(f"seq_len: {self.seq_len} must be a multiple of 2 x cp = {2 * self.cp} (each of the cp "
                             f"processes holds two equal chunks of every sequence)")
        if self.cp > 1 and self.packing != "windows":
            raise ValueError("packing: context parallelism (cp > 1) needs packing=windows; packed documents whose "
                             "boundaries fall inside other processes' shards are not supported")
        if hf:
            self._validate_hf()
            return
        for key, value in self.model.items():
            if key not in FOX_FIELDS:
                raise ValueError(f"model.{key}: not a FoxConfig field" + _expected(key, FOX_FIELDS, "model."))
            _check_field_type(key, value)
        # else the first step's forward refused it on every process, after the run had taken out_dir
        if self.cp > 1 and (window := resolved_model(self)["window"]) is not None:
            raise ValueError(f"model.window: a sliding window ({window}) is not available with context parallelism "
                             f"(cp={self.cp}): each process holds chunks of the sequence; cp=1 or model.window=null")

    def _validate_hf(self) -> None:
        """What a Hugging Face model (``arch=hf:...``, a config.json or a baseline) cannot do in foxlm's trainer."""
        for key in ("acp", "acp_tolerance"):
            if key in self.model:
                raise ValueError(f"model.{key}: ACP prunes by forget-gate decay; arch={self.arch} has no forget gates")
        check_fla(self.arch)
        if self.model or self.arch not in BASELINES:  # a baseline's preset is valid as it is, without transformers
            from ..models.hf import hf_config

            hf_config(self.arch, self.model, self.size)  # an unknown model type or field fails here, before the data
        refused = {"packing": self.packing != "windows", "cp": self.cp > 1, "cuda_graph": self.cuda_graph is True}
        for name, bad in refused.items():
            if bad:
                raise ValueError(f"{name}: {getattr(self, name)!r} is for foxlm's own models, not arch={self.arch} "
                                 f"(packed documents, context parallelism and CUDA graphs need foxlm's blocks)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _check_field_type(key: str, value) -> None:
    """A ``model.*`` number or switch of the wrong type (model.hidden_size=abc) is refused here: building the model
    from it was a TypeError's traceback."""
    default = FOX_FIELDS[key]
    kind = type(default) if default is not None else float if key == "qk_norm_eps" else int  # None: a derived size
    if kind is str or (value is None and default is None):
        return
    ok = isinstance(value, bool) if kind is bool else \
        isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"model.{key}: expected {kind.__name__}, got {value!r}")


def _expected(key: object, known, prefix: str = "") -> str:
    """What an unknown ``key`` error adds: the known key it is near, else every known one."""
    near = difflib.get_close_matches(str(key).lower(), known, n=1)
    return f"; did you mean {prefix}{near[0]}?" if near else f" (expected one of {sorted(known)})"


def default_out_dir(arch: str, size: str, data: str) -> str:
    """``runs/<data>-<arch>-<size>``: the data folder's name ("shakespeare" for the embedded corpus), the arch
    (``hf:llama`` as ``hf-llama``, a config.json by its folder's or file's name) and, where it applies, the size."""
    model = arch.replace(HF_PREFIX, "hf-", 1)
    if arch.endswith(".json"):
        path = Path(arch)
        model = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    parts = [Path(data.rstrip("/\\")).name or "data", model] + ([size] if has_size(arch) else [])
    return "runs/" + "-".join(re.sub(r"[^\w.-]+", "_", part) for part in parts)


def config_keys_help() -> str:
    """Every ``TrainConfig`` key with its default and, where it has one, its meaning (the field's ``help``): one per
    line, for ``foxlm train --help``."""
    rows = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        rows.append(f"  {f.name}={yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...')}"
                    .rstrip() + (f"  ({f.metadata['help']})" if f.metadata["help"] else ""))
    return "\n".join(rows)


# model fields a run sets from its data's tokenizer and seq_len, whatever arch and size say
FROM_THE_DATA = ("vocab_size", "bos_token_id", "eos_token_id", "train_length")


def resolved_model(cfg: TrainConfig) -> dict | None:
    """The model fields ``cfg`` builds, but those in ``FROM_THE_DATA``: every ``FoxConfig`` field for foxlm's archs
    (as ``FoxConfig.preset`` resolves them), a baseline's preset fields (its config class's other fields keep their
    defaults); None for ``hf:`` and config.json archs. Needs neither torch nor transformers."""
    if cfg.arch in BASELINES:
        fields = {**baseline_fields(cfg.arch, cfg.size), **cfg.model}
    elif cfg.arch in ARCHS:
        fields = derived_fields({**FOX_FIELDS, **preset_fields(cfg.arch, cfg.size), **cfg.model})
    else:
        return None
    return {k: v for k, v in fields.items() if k not in FROM_THE_DATA}


def printed_config(cfg: TrainConfig) -> str:
    """``cfg`` as the YAML ``--print-config`` writes: every key, and after ``model`` (its overrides) the model they
    build, field by field, as comments (the file loads back to ``cfg``)."""
    values = cfg.to_dict()
    keys = list(values)
    head = {k: values[k] for k in keys[:keys.index("model") + 1]}
    tail = {k: values[k] for k in keys[keys.index("model") + 1:]}
    text = yaml.safe_dump(head, sort_keys=False)
    model = resolved_model(cfg)
    if model is not None:
        built = f"# the model that arch={cfg.arch}, size={cfg.size} and model build"
        if cfg.arch in BASELINES:
            text += (f"{built}: its preset's fields (model.FIELD=value\n# sets any field of its config class, whose "
                     "others keep their defaults); the data's tokenizer sets vocab_size,\n# bos_token_id, "
                     "eos_token_id:\n")
        else:
            text += (f"{built}, every field (model.FIELD=value sets one);\n# the data's tokenizer sets vocab_size, "
                     "bos_token_id, eos_token_id, and seq_len sets train_length:\n")
        text += "".join(f"#   {yaml.safe_dump({k: v}, default_flow_style=True, width=1000).strip()[1:-1]}\n"
                        for k, v in model.items())
    return text + yaml.safe_dump(tail, sort_keys=False)


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2's core schema: true/false, null/~, decimal, 0o and 0x integers and floats (1e-3 too) are typed; YAML
    1.1's yes/no/on/off, 0777 (octal), 1:30 (base 60) and dates stay strings. No tags beyond safe YAML's."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag.rpartition(":")[2] not in ("bool", "int", "float", "null",
                                                                              "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),  # before float, which matches 7 too
        ("float", r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
         "-+.0123456789"),
        ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""])):
    _Yaml12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_rx})$"), list(_first))
del _tag, _rx, _first


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    digits, sign = text.lstrip("+-"), -1 if text.startswith("-") else 1
    base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer", node.start_mark) from None


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (PyYAML's own message spans several lines)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"{e.problem}{where}"
    return " ".join(str(e).split())


def _parse_yaml(text: str, what: str):
    """(the value of YAML ``text`` under the 1.2 core schema, its node); a ValueError naming ``what`` if it is not
    valid safe YAML (a syntax error, a !!python tag)."""
    loader = _Yaml12Loader(text)
    try:
        node = loader.get_single_node()
        return (None if node is None else loader.construct_document(node)), node
    except yaml.YAMLError as e:
        raise ValueError(f"{what} not valid YAML: {_yaml_problem(e)}") from None
    finally:
        loader.dispose()


def _allowed(name: str) -> tuple:
    hint = typing.get_type_hints(TrainConfig)[name]
    return typing.get_args(hint) or (hint,)


def _override_value(name: str, text: str):
    """An override's value, typed by its field: the text as written for a string (0777, 1:30, off and ~ are names,
    not numbers or null; the empty text or null unsets an optional one), else YAML 1.2 (strict: 1e-3 is a float, off
    is not a bool)."""
    allowed = _allowed(name)
    if type(None) in allowed and text in ("", "null"):
        return None
    if str in allowed and not (bool in allowed and text.lower() in ("true", "false")):
        return text
    return _parse_yaml(text, f"{name}: expected {_FIELDS[name].type}, got {text!r}, which is")[0]


def _file_strings(node) -> dict:
    """The plain scalars of a config file's string fields as written (``out_dir: 0777`` is the folder 0777, not
    511): {key: text}; YAML's null stays null."""
    strings = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if (isinstance(key, yaml.ScalarNode) and key.value in _FIELDS and str in _allowed(key.value)
                    and isinstance(value, yaml.ScalarNode) and value.style is None
                    and value.tag.rpartition(":")[2] not in ("null", "bool")):
                strings[key.value] = value.value
    return strings


def _refuse_repeated_keys(node, path: Path, prefix: str = "") -> None:
    """A ValueError if a mapping of a config file (the top one or a nested one, e.g. ``model``) sets a key twice:
    PyYAML keeps the last, silently."""
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode):
            if key.value in lines:
                raise ValueError(f"config: {path}: {prefix}{key.value} is given twice (lines {lines[key.value]} and "
                                 f"{key.start_mark.line + 1}); give it once")
            lines[key.value] = key.start_mark.line + 1
            _refuse_repeated_keys(value, path, f"{prefix}{key.value}.")


def _check_type(name: str, value, annotation: str):
    """``value`` if it has a type of the field's annotation (``int``, ``float``, ``str | None``, ...; an int is a
    float too, a bool is not a number), else a ValueError naming the field."""
    allowed = _allowed(name)
    if value is None and type(None) in allowed:
        return None
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if float in allowed and isinstance(value, str):  # Python's spellings too: inf, nan
        try:
            return float(value)
        except ValueError:
            pass
    if not any(t is not type(None) and isinstance(value, t) and not (t in (int, float) and isinstance(value, bool))
               for t in allowed):
        raise ValueError(f"{name}: expected {annotation}, got {value!r}")
    return value


def resolve_config_path(config: str | os.PathLike) -> Path:
    """A YAML path, or the name of a shipped config (``foxlm/configs/NAME.yaml``)."""
    path = Path(config).expanduser()
    if path.is_file():
        return path
    packaged = PACKAGED / f"{config}.yaml"
    if packaged.is_file():
        return packaged
    names = sorted(p.stem for p in PACKAGED.glob("*.yaml"))
    raise FileNotFoundError(f"config: {config} is neither a file nor a shipped config ({names})")


def load_config(config: str | os.PathLike | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Build a ``TrainConfig`` from a YAML file (or shipped name; None: ``default``) and ``key=value`` strings."""
    path = resolve_config_path(config or "default")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"config: {path} is not a YAML file (not UTF-8 text)") from None
    raw, node = _parse_yaml(text, f"config: {path} is")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config: {path} must hold a mapping of keys to values")
    _refuse_repeated_keys(node, path)
    raw.update(_file_strings(node))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override: expected key=value, got {item!r}")
        if key.startswith("model."):
            raw.setdefault("model", {})
            if not isinstance(raw["model"], dict):
                raise ValueError(f"model: expected a mapping in {path}")
            raw["model"][key[len("model."):]] = _parse_yaml(text, f"{key}: {text!r} is")[0] if text else None
        elif key not in _FIELDS:
            raise ValueError(f"{key}: unknown config key" + _expected(key, _FIELDS))
        else:
            raw[key] = _override_value(key, text)
    kwargs = {}
    for key, value in raw.items():
        if isinstance(key, str) and key.startswith("model."):  # an override's spelling
            nested = yaml.safe_dump({key[len("model."):]: value}, default_flow_style=True, width=1000).strip()
            raise ValueError(f"{key}: unknown config key; in a config file model fields nest under model: "
                             f"(model: {nested})")
        if key not in _FIELDS:
            raise ValueError(f"{key}: unknown config key" + _expected(key, _FIELDS))
        kwargs[key] = _check_type(key, value, str(_FIELDS[key].type))
    if not isinstance(kwargs.get("model", {}), dict):
        raise ValueError(f"model: expected a mapping of FoxConfig fields, got {kwargs['model']!r}")
    cfg = TrainConfig(**kwargs)
    cfg.validate()
    return cfg
