"""The training loop: one process, or many under ``torchrun`` (FSDP2 ``fully_shard`` or DDP).

Per step: the global batch (``TokenLoader``) is split over processes and micro-batches; every micro-batch loss is
weighted by its share of the step's targets, so the update is that of one big batch whatever the split. Then:
NaN/Inf check (skip + count), gradient clipping, AdamW with warmup + cosine to ``min_lr``. Validation loss every
``eval_every`` steps; JSONL + TensorBoard logs and a progress bar on rank 0; atomic checkpoints every
``save_every`` steps and at the end; ``resume="auto"`` continues a run from its latest valid checkpoint and
reproduces the losses of an uninterrupted run. SIGTERM (a scheduler preempting the job; torchrun passes it on)
ends the run after the current step, with a checkpoint. ``cuda_graph=true`` replays each micro-batch's forward +
backward from a CUDA graph (``GraphedMicroStep``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist
import yaml

from ..data import TokenDataset, ensure_default_corpus
from ..models import FoxConfig, FoxForCausalLM
from ..ops.backend import use_triton
from .checkpoint import (conflicting_checkpoints, is_run_checkpoint, latest_valid_checkpoint, load_trainer_state,
                         lock_run, read_model_weights, resolve_model_dir, write_checkpoint)
from .config import TrainConfig, model_fields
from .cuda_graph import GraphedMicroStep
from .loader import Batch, TokenLoader

# Dense bf16 peak TFLOP/s per device, for the MFU estimate.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices (projections, embeddings, LM head), none on norms, biases and gate biases."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def flops_per_token(config: FoxConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters except the embedding) + causal attention 6 x L x T x H x D."""
    embed = config.vocab_size * config.hidden_size
    attn = 6 * config.num_hidden_layers * seq_len * config.num_attention_heads * config.head_dim
    return 6 * (num_params - embed) + attn


@dataclass
class _Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    owns_group: bool = False  # this trainer initialized the process group (and so tears it down)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on any process (one all-reduce; none in a single process)."""
        return flag if self.world == 1 else bool(self.sum(torch.tensor([float(flag)], device=device)).item())


def _causal_lm_loss(model: torch.nn.Module, autocast: bool, input_ids: torch.Tensor, labels: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The model's mean next-token loss on input_ids / labels [B, T], under bf16 autocast when ``autocast``."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=input_ids, labels=labels, cu_seqlens=cu_seqlens, use_cache=False).loss


def _setup_distributed(cfg: TrainConfig) -> tuple[_Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        if device.index >= torch.cuda.device_count():
            where = f" for LOCAL_RANK={local_rank} (one process per GPU, or device=cpu)" if world > 1 else ""
            raise ValueError(f"device: {device} is not one of the {torch.cuda.device_count()} visible GPUs{where}")
        torch.cuda.set_device(device)
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return _Dist(rank, local_rank, world, owns_group), device


def _wrap(model: FoxForCausalLM, cfg: TrainConfig, d: _Dist, device: torch.device) -> torch.nn.Module:
    if d.world == 1:
        return model
    if cfg.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh on the trainer's device: fully_shard's default takes the GPU whenever one is visible, even for gloo
    mesh = init_device_mesh(device.type, (d.world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _unwrap(model: torch.nn.Module) -> FoxForCausalLM:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _grad_sync(model: torch.nn.Module, sync: bool):
    """Context for one micro-batch's backward: reduce gradients over processes only when ``sync``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


class _Preemption:
    """While entered, SIGTERM is recorded instead of killing the process, so that the loop can save and stop after
    the current step (where Python lets a handler be installed: the main thread)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# Settings that change what a run shows, not what it trains: not reported as changed on resume.
_DISPLAY_KEYS = {"resume", "progress", "tensorboard", "log_every", "peak_tflops", "sample_prompt", "sample_tokens"}


def _model_name(cfg: dict) -> str:
    """"fox-pro tiny", with the config's model overrides."""
    return f"{cfg['arch']} {cfg['size']}" + (f" with model={cfg['model']}" if cfg["model"] else "")


def _weights_differ(weights: dict[str, torch.Tensor], module: torch.nn.Module) -> str | None:
    """None if ``weights`` has exactly ``module``'s names and shapes, else how they differ."""
    found = {name: tuple(t.shape) for name, t in weights.items()}
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    if found == expected:
        return None
    differ = sorted(set(found) ^ set(expected)) or [n for n in expected if found[n] != expected[n]]
    return (f"{len(differ)} weights differ (e.g. {differ[0]}: {found.get(differ[0], 'absent')} there, "
            f"{expected.get(differ[0], 'absent')} here)")


class _Logger:
    """JSONL + TensorBoard + progress bar, on the main process only."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, start_step: int, main: bool):
        self.main, self.bar, self.tb, self.file = main, None, None, None
        if not main:
            return
        log_path = run_dir / "log.jsonl"
        kept = []
        if start_step > 0 and log_path.exists():  # resuming: drop what the killed run logged after the checkpoint
            kept = [line for line in log_path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
        log_path.write_text("".join(line + "\n" for line in kept))
        self.file = open(log_path, "a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                print("tensorboard is not installed: no TensorBoard logs", file=sys.stderr)
        if cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def log(self, record: dict) -> None:
        if not self.main:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(f"train/{key}" if not key.startswith("val") else key, value, record["step"])

    def progress(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


class Trainer:
    """Builds data, model, optimizer from a ``TrainConfig``; ``run()`` trains and returns a summary."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.d, self.device = _setup_distributed(cfg)
        self.run_dir = Path(cfg.out_dir).expanduser()
        self.autocast = (cfg.precision == "bf16") or (cfg.precision == "auto" and self.device.type == "cuda")

        # data: the embedded corpus is prepared once, by rank 0
        if cfg.data == "shakespeare":
            if self.d.main:
                ensure_default_corpus(cfg.tokenizer or "gpt2", progress=cfg.progress)
            self.d.barrier()
            data_path = ensure_default_corpus(cfg.tokenizer or "gpt2", progress=False)
        else:
            data_path = Path(cfg.data).expanduser()
            if not (data_path / "meta.json").is_file():
                problem = "is not a `foxlm data prepare` folder (no meta.json)" if data_path.exists() else \
                    "does not exist"
                raise FileNotFoundError(f"data: {data_path} {problem}; prepare text with `foxlm data prepare "
                                        f"FILES_OR_DIRS --out DIR`, then train with data=DIR")
        self.train_ds, self.val_ds = TokenDataset(data_path, "train"), TokenDataset(data_path, "val")
        self.data_path = data_path
        self.tok_spec = self.train_ds.meta["tokenizer"]
        if cfg.tokenizer is not None and cfg.tokenizer != self.tok_spec["name"]:
            raise ValueError(f"tokenizer: the config expects {cfg.tokenizer!r}, but {data_path} was prepared "
                             f"with {self.tok_spec['name']!r}")
        self.tokenizer = self.train_ds.tokenizer()  # rebuilds it and checks it is the recorded one

        # model
        overrides = {"vocab_size": 64 * math.ceil(self.tok_spec["vocab_size"] / 64),
                     "bos_token_id": self.tok_spec["eot_id"], "eos_token_id": self.tok_spec["eot_id"], **cfg.model}
        self.model_config = FoxConfig.preset(cfg.arch, cfg.size, **overrides)
        if self.model_config.vocab_size < self.tok_spec["vocab_size"]:
            raise ValueError(f"model.vocab_size: {self.model_config.vocab_size} is smaller than the tokenizer's "
                             f"{self.tok_spec['vocab_size']}")
        for ds in (self.train_ds, self.val_ds):  # an id past the embedding would be an IndexError mid-run
            ds.check_ids(self.model_config.vocab_size)
        self.model_config.foxlm_tokenizer = self.tok_spec
        torch.manual_seed(cfg.seed)
        model = FoxForCausalLM(self.model_config).to(self.device)
        self.num_params = model.num_parameters()
        if cfg.activation_checkpointing:
            model.model.gradient_checkpointing = True
        if cfg.compile:
            for block in model.model.layers:
                block.compile()
        self.model = _wrap(model, cfg, self.d, self.device)
        fused = self.device.type == "cuda" and not (self.d.world > 1 and cfg.parallel == "fsdp")
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           **({"fused": True} if fused else {}))

        self._loss = functools.partial(_causal_lm_loss, self.model, self.autocast)

        # CUDA graph of the micro-step; its gradients stay at fixed addresses (zeroed in place)
        self.graphed = None
        use_graph = cfg.cuda_graph
        # the PyTorch paths of the ops size their work on the host (not capturable): graphs need the Triton kernels
        kernels = self.device.type == "cuda" and use_triton(torch.empty(0, device=self.device))
        if use_graph == "auto":
            use_graph = (self.device.type == "cuda" and self.d.world == 1 and cfg.packing == "windows"
                         and not cfg.compile and kernels)
        if use_graph:
            if self.device.type != "cuda" or self.d.world > 1:
                raise ValueError(f"cuda_graph: needs one CUDA device and one process, got {self.device} x "
                                 f"{self.d.world}")
            if not kernels:
                raise ValueError("cuda_graph: needs foxlm's Triton kernels (the PyTorch paths sync with the host), "
                                 "got use_backend('torch')")
            # the loss does not hold the Trainer: no reference cycle keeps a finished run's graph for the GC to free
            self.graphed = GraphedMicroStep(self._loss, [p for p in self.model.parameters() if p.requires_grad])

        # loaders
        micro = cfg.micro_batch_size or cfg.batch_size // self.d.world
        if micro < 1 or cfg.batch_size % self.d.world:
            raise ValueError(f"batch_size: {cfg.batch_size} cannot be split over {self.d.world} processes")
        common = dict(seq_len=cfg.seq_len, batch_size=cfg.batch_size, micro_batch_size=micro, packing=cfg.packing,
                      seed=cfg.seed, rank=self.d.rank, world_size=self.d.world)
        self.loader = TokenLoader(self.train_ds, **common)
        self.val_loader = TokenLoader(self.val_ds, shuffle=False, **common) if len(self.val_ds.tokens) > cfg.seq_len \
            else None
        self.step, self.bad_steps, self.tokens_seen = 0, 0, 0
        self._lock: IO[str] | None = None  # out_dir's lock while the run holds it (rank 0)
        self._started: list[str] | None = None  # after start(): what it did, for the log ("resumed from ...")

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _state_dict_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save(self) -> Path | None:
        """Checkpoint the current step (collective: every process calls it; rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = _unwrap(self.model)
        model_sd = get_model_state_dict(module, options=self._state_dict_options())
        optim_sd = get_optimizer_state_dict(module, self.optimizer, options=self._state_dict_options())
        path = None
        if self.d.main:
            state = {
                "step": self.step,
                "optimizer": optim_sd,
                "scheduler": {"step": self.step, "lr": lr_at(max(self.step - 1, 0), self.cfg)},
                "loader": self.loader.state_dict(),
                "rng": {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                "bad_steps": self.bad_steps,
                "tokens_seen": self.tokens_seen,
                "tokenizer": self.tok_spec,
                "world_size": self.d.world,
                "config": self.cfg.to_dict(),
            }
            path = write_checkpoint(self.run_dir, self.step, lambda folder: self._save_model(module, model_sd, folder),
                                    state, self.cfg.keep_last)
        self.d.barrier()
        return path

    def _save_model(self, module: torch.nn.Module, state_dict: dict, folder: Path) -> None:
        """The model's ``save_pretrained`` folder, with the tokenizer in Hugging Face's format where there is one (GPT-2
        BPE), so that ``AutoTokenizer`` loads it from the same folder."""
        module.save_pretrained(folder, state_dict=state_dict)
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(folder)

    def load(self, ckpt: Path) -> list[str]:
        """Restore model, optimizer, counters and RNG from a verified checkpoint; return the settings this run
        changes from the checkpoint's run ("key: old -> new")."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = load_trainer_state(ckpt)  # verifies the manifest first
        if state["tokenizer"] != self.tok_spec:
            raise ValueError(f"tokenizer: the checkpoint was trained with {state['tokenizer']}, the data is "
                             f"{self.tok_spec}")
        module = _unwrap(self.model)
        weights = read_model_weights(resolve_model_dir(ckpt, "resume"))
        problem = _weights_differ(weights, module)
        if problem is not None:
            raise ValueError(f"resume: {ckpt} was trained as {_model_name(state['config'])}, this config is "
                             f"{_model_name(self.cfg.to_dict())}: {problem}. Train into a new out_dir to start this "
                             f"model")
        self.loader.load_state_dict(state["loader"])
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(module, weights, options=options)
        set_optimizer_state_dict(module, self.optimizer, state["optimizer"], options=options)
        self.step, self.bad_steps, self.tokens_seen = state["step"], state["bad_steps"], state["tokens_seen"]
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        now = self.cfg.to_dict()
        return [f"{key}: {was!r} -> {now[key]!r}" for key, was in state["config"].items()
                if key not in _DISPLAY_KEYS and key in now and now[key] != was]

    def initialize(self, path: str | os.PathLike) -> tuple[Path, list[str]]:
        """Load the weights of a trained model (a run folder, a checkpoint or a ``save_pretrained`` folder) into this
        run's model; return its folder and the model settings this config changes from it ("key: old -> new")."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        folder = resolve_model_dir(path, "init_from")
        saved = json.loads((folder / "config.json").read_text())
        if saved.get("model_type") != FoxConfig.model_type:
            raise ValueError(f"init_from: {folder} holds a {saved.get('model_type')!r} model, not a foxlm model")
        tokenizer = saved.get("foxlm_tokenizer")
        if tokenizer is not None and tokenizer != self.tok_spec:
            raise ValueError(f"init_from: {folder} was trained with the tokenizer {tokenizer}, the data "
                             f"{self.data_path} was prepared with {self.tok_spec}")
        module = _unwrap(self.model)
        weights = read_model_weights(folder)
        problem = _weights_differ(weights, module)
        if problem is not None:
            raise ValueError(f"init_from: {folder} holds another model than this config's "
                             f"{_model_name(self.cfg.to_dict())}: {problem}. Set arch, size and model.* to build it")
        set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
        now = self.model_config.to_dict()
        return folder, [f"{key}: {saved[key]!r} -> {now[key]!r}" for key in sorted(model_fields())
                        if key in saved and saved[key] != now[key]]

    def _check_out_dir(self, ckpt: Path | None) -> None:
        """Refuse to train into checkpoints this run does not continue from: its saves would interleave with them,
        and keeping the last ``keep_last`` by step would delete them, or this run's own."""
        in_the_way = conflicting_checkpoints(self.run_dir, ckpt)
        if not in_the_way:
            return
        names = ", ".join(p.name for p in in_the_way[:3]) + (", ..." if len(in_the_way) > 3 else "")
        where = f"out_dir: {self.run_dir} holds"
        if ckpt is None and self.cfg.resume == "auto":
            problem, fix = f"{where} only checkpoints that do not verify ({names})", "move them away"
        elif ckpt is None:
            problem, fix = f"{where} another run's checkpoints ({names})", "resume=auto to continue that run"
        elif not is_run_checkpoint(self.run_dir, ckpt):
            problem, fix = f"{where} checkpoints of another run than {ckpt}'s ({names})", "move them away"
        else:
            problem, fix = f"{where} checkpoints after {ckpt.name}, which this run resumes from ({names})", \
                f"move them away to go on from {ckpt.name}"
        raise ValueError(f"{problem}: this run's saves would be mixed with them and pruned by step. Train into a new "
                         f"out_dir, or {fix}")

    def _resume_point(self) -> Path | None:
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume == "auto":
            return latest_valid_checkpoint(self.run_dir)
        return Path(self.cfg.resume).expanduser()

    # --- steps ------------------------------------------------------------------------------------------------
    def _forward(self, b: Batch) -> torch.Tensor:
        b = b.to(self.device)
        return self._loss(b.input_ids, b.labels, b.cu_seqlens)

    def train_step(self) -> dict:
        """One optimizer step (or a skipped one); returns the step's record."""
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro = self.loader.batch(step)
        total = float(sum(b.num_targets for b in micro))
        if self.d.world > 1:
            total = self.d.sum(torch.tensor([total], device=self.device)).item()
        loss_sum = torch.zeros((), device=self.device)
        for i, b in enumerate(micro):
            # DDP/FSDP average gradients over processes: scale so that the result is the global mean.
            weight = b.num_targets * self.d.world / total
            if self.graphed is not None:
                b = b.to(self.device)
                loss = self.graphed(b.input_ids, b.labels, weight)
            else:
                with _grad_sync(self.model, sync=i == len(micro) - 1):
                    loss = self._forward(b)
                    (loss * weight).backward()
            loss_sum += loss.detach().float() * b.num_targets
        loss = (self.d.sum(loss_sum) / total).item()
        tokens = sum(b.input_ids.numel() for b in micro) * self.d.world
        self.tokens_seen += tokens
        self.step += 1
        record = {"step": self.step, "loss": loss, "lr": lr, "tokens": self.tokens_seen}
        grad_norm = None
        if math.isfinite(loss):
            params = [p for p in self.model.parameters() if p.grad is not None]
            if cfg.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
            record["grad_norm"] = grad_norm
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=self.graphed is None)
            self.bad_steps += 1
            record["skipped"] = True
            return record
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.graphed is None)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Over fixed validation batches (``eval_batches``, or fewer to read the split at most once): the mean loss
        ``val_loss`` and, for a model with forget gates, ``val_acp_skipped``, the share of attention tiles ACP skips
        there (or, with ACP off, would skip). None without a validation split."""
        if self.val_loader is None:
            return None
        module = _unwrap(self.model)
        gated = module.config.gate != "none"
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        count = 0.0
        per_batch = self.cfg.batch_size * self.cfg.seq_len
        with module.probe_acp() if gated else contextlib.nullcontext() as share:
            for k in range(max(1, min(self.cfg.eval_batches, len(self.val_ds.tokens) // per_batch))):
                for b in self.val_loader.batch(k):
                    loss_sum += self._forward(b).float() * b.num_targets
                    count += b.num_targets
        self.model.train()
        total = self.d.sum(torch.tensor([count], device=self.device)).item()
        out = {"val_loss": (self.d.sum(loss_sum) / total).item()}
        if gated:
            out["val_acp_skipped"] = (self.d.sum(share.per_head().mean().reshape(1)) / self.d.world).item()
        return out

    @torch.no_grad()
    def sample(self) -> str:
        """A sampled continuation of ``sample_prompt`` (default: the start of the first validation document)."""
        if self.cfg.sample_prompt is not None:
            prompt = [self.tokenizer.eot_id] + self.tokenizer.encode(self.cfg.sample_prompt)
        else:
            source = self.val_ds if self.val_ds.num_docs else self.train_ds
            prompt = source.document(0)[:24].tolist()
        module = _unwrap(self.model)
        module.eval()
        generator_state = torch.get_rng_state()
        torch.manual_seed(self.cfg.seed)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = module.generate(torch.tensor([prompt], device=self.device), max_new_tokens=self.cfg.sample_tokens,
                                  do_sample=True, top_k=50, temperature=0.8, pad_token_id=self.tokenizer.eot_id)
        torch.set_rng_state(generator_state)
        module.train()
        return self.tokenizer.decode(out[0, 1:].tolist())

    def _mfu(self, tokens_per_s: float) -> float | None:
        peak = self.cfg.peak_tflops
        if peak is None and self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak is None:
            return None
        per_token = flops_per_token(self.model_config, self.num_params, self.cfg.seq_len)
        return tokens_per_s * per_token / (peak * 1e12 * self.d.world)

    def start(self) -> None:
        """Lock ``out_dir`` (a second run there, e.g. a requeued job while the first still runs, is refused), then
        resume or initialize the model as configured: all that can refuse the run (ValueError, FileNotFoundError),
        before anything is written. ``run()`` calls it when it was not called."""
        if self._started is not None:
            return
        if self.d.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run(self.run_dir)
        try:
            if self.d.any(self.d.main and self._lock is None, self.device):
                holder = (self.run_dir / ".lock").read_text().strip() if self.d.main else "?"
                raise ValueError(f"out_dir: {self.run_dir} is in use by another foxlm train (pid {holder}); wait for "
                                 f"it to end, or train into a new out_dir")
            ckpt = self._resume_point()
            self._check_out_dir(ckpt)
            notes = []
            if ckpt is not None:
                changed = self.load(ckpt)
                notes.append(f"resumed from {ckpt} at step {self.step}"
                             + (f", with changed settings: {'; '.join(changed)}" if changed else ""))
            elif self.cfg.init_from is not None:
                folder, differ = self.initialize(self.cfg.init_from)
                notes.append(f"initialized from {folder}"
                             + (f", with changed model settings: {'; '.join(differ)}" if differ else ""))
        except BaseException:
            self._unlock()
            raise
        self._started = notes

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def run(self) -> dict:
        """Train to ``max_steps`` (after ``start()``), with validation, logs and checkpoints; return a summary. On
        SIGTERM the run stops after the current step with a checkpoint (the same command resumes it), and the summary
        has ``stopped="SIGTERM"``. ``out_dir`` is unlocked at the end."""
        try:
            self.start()
            with _Preemption() as preemption:
                return self._run(preemption)
        finally:
            self._unlock()

    def _run(self, preemption: _Preemption) -> dict:
        cfg = self.cfg
        if self.d.main:
            (self.run_dir / "train_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        log = _Logger(cfg, self.run_dir, self.step, self.d.main)
        for note in self._started:
            log.write(note)
        log.write(f"{cfg.arch} {cfg.size}: {self.num_params / 1e6:.1f}M parameters on {self.device} x {self.d.world}"
                  f" ({'bf16 autocast' if self.autocast else 'fp32'}); data {self.data_path}: "
                  f"{len(self.train_ds.tokens):,} train / {len(self.val_ds.tokens):,} val tokens "
                  f"({self.tok_spec['name']}); {cfg.batch_size} x {cfg.seq_len} tokens per step, "
                  f"{self.loader.grad_accum} micro-batches per process"
                  + ("; forward + backward replayed from a CUDA graph" if self.graphed is not None else ""))
        if self.step >= cfg.max_steps:
            log.write(f"nothing to train: the run is at step {self.step}, max_steps={cfg.max_steps} (raise "
                      f"max_steps to continue it)")
        if self.val_loader is None and cfg.eval_every:
            log.write(f"no validation loss: the val split of {self.data_path} has {len(self.val_ds.tokens):,} tokens, "
                      f"fewer than seq_len + 1 = {cfg.seq_len + 1}")
        summary = {"first_loss": None, "val_loss": None}
        self.model.train()
        t0, tokens0 = time.perf_counter(), self.tokens_seen  # throughput since the last log line
        try:
            while self.step < cfg.max_steps:
                record = self.train_step()
                if summary["first_loss"] is None:
                    summary["first_loss"] = record["loss"]
                summary["loss"] = record["loss"]
                now = time.perf_counter()
                tps = (self.tokens_seen - tokens0) / max(now - t0, 1e-9)
                mfu = self._mfu(tps)
                record.update(tokens_per_s=tps, **({"mfu": mfu} if mfu is not None else {}))
                if record.get("skipped"):
                    log.write(f"step {self.step}: non-finite loss/gradient, step skipped "
                              f"({self.bad_steps}/{cfg.max_bad_steps})")
                # SIGTERM: every process stops after the same step (the save is collective), whichever received it
                stop = self.step < cfg.max_steps and self.d.any(preemption.requested, self.device)
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps or record.get("skipped") or stop:
                    log.log(record)
                    t0, tokens0 = now, self.tokens_seen
                if self.bad_steps > cfg.max_bad_steps:
                    raise FloatingPointError(
                        f"loss/gradient was NaN or Inf at {self.bad_steps} steps (max_bad_steps={cfg.max_bad_steps}),"
                        f" last at step {self.step}; lower lr (now {cfg.lr}) or check the data. Checkpoints before "
                        f"it are in {self.run_dir / 'checkpoints'}")
                postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
                if mfu is not None:
                    postfix["mfu"] = f"{100 * mfu:.1f}%"
                log.progress(postfix)
                last = self.step == cfg.max_steps
                if ((cfg.eval_every and self.step % cfg.eval_every == 0) or last) and not stop:
                    val = self.evaluate()
                    if val is not None:
                        summary["val_loss"] = val["val_loss"]
                        log.log({"step": self.step, **val})
                        line = f"step {self.step}: val loss {val['val_loss']:.4f}"
                        if "val_acp_skipped" in val:
                            verb = "skips" if _unwrap(self.model).config.acp else "would skip"
                            line += f", ACP {verb} {val['val_acp_skipped']:.1%} of the attention tiles"
                        log.write(line)
                if (cfg.save_every and self.step % cfg.save_every == 0) or last or stop:
                    path = self.save()
                    if path is not None:
                        log.write(f"saved {path}")
                if stop:
                    log.write(f"stopped by SIGTERM after step {self.step}; the same command resumes the run")
                    summary["stopped"] = "SIGTERM"
                    break
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or \
                        (cfg.save_every and self.step % cfg.save_every == 0):  # not training time
                    t0, tokens0 = time.perf_counter(), self.tokens_seen
        finally:
            log.close()
        summary.update(step=self.step, bad_steps=self.bad_steps, tokens=self.tokens_seen,
                       run_dir=str(self.run_dir))
        return summary


def train(cfg: TrainConfig | Trainer) -> dict:
    """Train with ``cfg`` (or a ``Trainer`` built from it, maybe started); print a sample at the end on rank 0 (unless
    ``sample_tokens=0``); tear down the process group the trainer made.

    Returns the summary: first/last training loss, last validation loss, steps, tokens, run folder, sample."""
    trainer = cfg if isinstance(cfg, Trainer) else Trainer(cfg)
    try:
        summary = trainer.run()
        if trainer.cfg.sample_tokens and not summary.get("stopped"):  # a preempted job has seconds left: no sample
            text = trainer.sample()
            if trainer.d.main:
                print(f"\n--- sample (step {trainer.step}) ---\n{text}\n---", flush=True)
            summary["sample"] = text
        return summary
    finally:
        if trainer.d.owns_group:
            dist.destroy_process_group()
