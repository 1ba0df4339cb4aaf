"""The training loop: one process, or many under ``torchrun`` (FSDP2 ``fully_shard`` or DDP, ``parallel.py``).

Per step: the global batch (``TokenLoader``) is split over processes and micro-batches; every micro-batch loss is
weighted by its share of the step's targets, so the update is that of one big batch whatever the split. Then:
NaN/Inf check (skip + count), gradient clipping, AdamW with warmup + cosine to ``min_lr``. Validation loss every
``eval_every`` steps; logs (``logging.py``) on rank 0; atomic checkpoints (``checkpoint.py``) every ``save_every``
steps and at the end; ``resume="auto"`` continues a run from its latest valid checkpoint and reproduces the losses
of an uninterrupted run. SIGTERM ends the run at the next safe point (one process: inside the step, keeping the
last whole step; several: between micro-batches on the CPU, else after the step), with a checkpoint
(``preemption.py``). ``cuda_graph=true`` replays each micro-batch's forward + backward from a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from ..checkpoint.checkpointer import initialize_model, model_name, restore_checkpoint
from ..checkpoint.export import export_model
from ..checkpoint.run_folder import check_out_dir, checkpoint_step, list_checkpoints, resume_point, write_train_config
from ..data import TokenDataset, ensure_default_corpus
from ..models import FoxConfig, FoxForCausalLM
from ..models.baselines import check_device
from ..models.hf import build_model, decoder_layers, hf_config, use_chunked_loss
from ..ops.backend import use_triton
from ..parallel import apply_context_parallel
from ..presets import has_size, is_hf_arch
from . import evaluation, parallel
from .checkpointing import Checkpointer, take_run_folder
from .config import TrainConfig
from .cuda_graph import GraphedMicroStep
from .loader import Batch, TokenLoader
from .logging import RunLog
from .metrics import Metrics, cpu_warning, duration
from .preemption import Preempted, Preemption


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


def _causal_lm_loss(model: torch.nn.Module, autocast: bool, input_ids: torch.Tensor, labels: torch.Tensor,
                    cu_seqlens: torch.Tensor | None = None, shifted: bool = False) -> torch.Tensor:
    """The model's mean next-token loss on input_ids / labels [B, T], under bf16 autocast when ``autocast``;
    ``shifted``: labels are the targets of the tokens (a context-parallel shard's)."""
    targets = {"shift_labels" if shifted else "labels": labels}
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=input_ids, cu_seqlens=cu_seqlens, use_cache=False, **targets).loss


def _data_folder(cfg: TrainConfig, d: parallel.Dist) -> Path:
    """The prepared data folder ``cfg.data`` names; the embedded corpus is prepared once, by rank 0."""
    if cfg.data == "shakespeare":
        if d.main:
            ensure_default_corpus(cfg.tokenizer or "gpt2", progress=cfg.progress)
        d.barrier()
        return ensure_default_corpus(cfg.tokenizer or "gpt2", progress=False)
    data_path = Path(cfg.data).expanduser()
    if not (data_path / "meta.json").is_file():
        problem = "is not a `foxlm data prepare` folder (no meta.json)" if data_path.exists() else "does not exist"
        raise FileNotFoundError(f"data: {data_path} {problem}; prepare text with `foxlm data prepare "
                                f"FILES_OR_DIRS --out DIR`, then train with data=DIR")
    return data_path


class Trainer:
    """Builds data, model, optimizer from a ``TrainConfig``; ``run()`` trains and returns a summary."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.d, self.device = parallel.setup(cfg.device, cfg.cp)
        self.run_dir = Path(cfg.out_dir).expanduser()
        self.autocast = (cfg.precision == "bf16") or (cfg.precision == "auto" and self.device.type == "cuda")

        # data
        self.data_path = data_path = _data_folder(cfg, self.d)
        self.train_ds, self.val_ds = TokenDataset(data_path, "train"), TokenDataset(data_path, "val")
        self.tok_spec = self.train_ds.meta["tokenizer"]
        if cfg.tokenizer is not None and cfg.tokenizer != self.tok_spec["name"]:
            raise ValueError(f"tokenizer: the config expects {cfg.tokenizer!r}, but {data_path} was prepared "
                             f"with {self.tok_spec['name']!r}; train with tokenizer=null (the data's own) or "
                             f"tokenizer={self.tok_spec['name']}, or prepare the data with --tokenizer "
                             f"{cfg.tokenizer}")
        self.tokenizer = self.train_ds.tokenizer()  # rebuilds it and checks it is the recorded one

        # model
        overrides = {"vocab_size": 64 * math.ceil(self.tok_spec["vocab_size"] / 64),
                     "bos_token_id": self.tok_spec["eot_id"], "eos_token_id": self.tok_spec["eot_id"], **cfg.model}
        self.hf = is_hf_arch(cfg.arch)
        if self.hf:
            check_device(cfg.arch, self.device.type)
            self.model_config = hf_config(cfg.arch, overrides, cfg.size)
        else:
            self.model_config = FoxConfig.preset(cfg.arch, cfg.size, **{"train_length": cfg.seq_len, **overrides})
        if self.model_config.vocab_size < self.tok_spec["vocab_size"]:
            raise ValueError(f"model.vocab_size: {self.model_config.vocab_size} is smaller than the tokenizer's "
                             f"{self.tok_spec['vocab_size']}")
        for ds in (self.train_ds, self.val_ds):
            ds.verify()  # a shard changed since prepare (a flipped byte, bad offsets) would train on silently
            ds.check_ids(self.model_config.vocab_size)  # an id past the embedding: an IndexError mid-run
        self.model_config.foxlm_tokenizer = self.tok_spec
        torch.manual_seed(cfg.seed)
        if self.hf:
            model = use_chunked_loss(build_model(self.model_config)).to(self.device)
        else:
            model = FoxForCausalLM(self.model_config).to(self.device)
        self.num_params = model.num_parameters()
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.d.cp_size > 1:
            apply_context_parallel(model, self.d.cp_group)
        if cfg.compile:
            for block in decoder_layers(model):
                block.compile()
        self.model = parallel.wrap(model, cfg.parallel, self.d, self.device)
        fused = self.device.type == "cuda" and not (self.d.world > 1 and cfg.parallel == "fsdp")
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           **({"fused": True} if fused else {}))
        self._loss = functools.partial(_causal_lm_loss, self.model, self.autocast)
        self.graphed = self._graph_micro_step()

        # loaders: each data-parallel process reads its share of the global batch
        dp = self.d.dp_size
        micro = cfg.micro_batch_size or cfg.batch_size // dp
        if micro < 1 or cfg.batch_size % dp:
            raise ValueError(f"batch_size: {cfg.batch_size} cannot be split over {dp} processes")
        common = dict(seq_len=cfg.seq_len, batch_size=cfg.batch_size, micro_batch_size=micro, packing=cfg.packing,
                      seed=cfg.seed, rank=self.d.dp_rank, world_size=dp, cp_rank=self.d.cp_rank,
                      cp_size=self.d.cp_size)
        self.loader = TokenLoader(self.train_ds, **common)
        self.val_loader = TokenLoader(self.val_ds, shuffle=False, **common) if len(self.val_ds.tokens) > cfg.seq_len \
            else None
        self.step, self.bad_steps, self.tokens_seen = 0, 0, 0
        self.preemption = Preemption()  # replaced by the one run() installs for SIGTERM
        # several processes agree on a stop between micro-batches where that costs nothing (the CPU: no device to
        # sync with), so that a long CPU step stops within seconds; on a GPU steps are short: after the step
        self._stop_between_micro = self.d.world > 1 and self.device.type == "cpu"
        self.micro_progress: Callable[[int, int, float], None] | None = None  # (done, of, seconds) within a step
        self._warning: str | None = None  # cpu_warning's, when the run starts
        self._lock: IO[str] | None = None  # out_dir's lock while the run holds it (rank 0)
        self._started: list[str] | None = None  # after start(): what it did, for the log ("resumed from ...")
        self.checkpointer = Checkpointer(self.run_dir, cfg.keep_last, self.d, self.tokenizer)
        self.metrics = Metrics(self.model_config, self.num_params, cfg.seq_len, cfg.batch_size, self.hf,
                               cfg.peak_tflops, self.device, self.d.world)

    def _graph_micro_step(self) -> GraphedMicroStep | None:
        """The micro-step replayed from a CUDA graph, as ``cuda_graph`` asks; its gradients stay at fixed addresses
        (zeroed in place)."""
        cfg, on_gpu = self.cfg, self.device.type == "cuda"
        # the PyTorch paths of the ops size their work on the host (not capturable): graphs need the Triton kernels
        kernels = on_gpu and use_triton(torch.empty(0, device=self.device))
        use_graph = cfg.cuda_graph
        if use_graph == "auto":
            use_graph = on_gpu and self.d.world == 1 and cfg.packing == "windows" and not cfg.compile and kernels \
                and not self.hf
        if not use_graph:
            return None
        if not on_gpu or self.d.world > 1:
            raise ValueError(f"cuda_graph: needs one CUDA device and one process, got {self.device} x {self.d.world}")
        if not kernels:
            raise ValueError("cuda_graph: needs foxlm's Triton kernels (the PyTorch paths sync with the host), "
                             "got use_backend('torch')")
        # the loss does not hold the Trainer: no reference cycle keeps a finished run's graph for the GC to free
        return GraphedMicroStep(self._loss, [p for p in self.model.parameters() if p.requires_grad])

    # --- checkpoints ------------------------------------------------------------------------------------------
    def save(self, background: bool = False) -> list[Path]:
        """Checkpoint the current step (collective: every process calls it; ``Checkpointer.save`` says how, and what
        it returns)."""
        return self.checkpointer.save(self.step, parallel.unwrap(self.model), self.optimizer, self._trainer_state,
                                      background)

    def finish_saving(self) -> list[Path]:
        """Commit the checkpoint being written in the background, if any (collective); returns it on rank 0."""
        return self.checkpointer.finish_saving()

    def _trainer_state(self, optimizer: dict | None) -> dict:
        """What a checkpoint holds besides the model: counters, schedule, loader, RNG, and ``optimizer`` (the whole
        optimizer state of one process; None: it is in the shards)."""
        return {
            "step": self.step,
            **({} if optimizer is None else {"optimizer": optimizer}),
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

    def load(self, ckpt: Path) -> list[str]:
        """Restore model, optimizer, counters and RNG from a verified checkpoint; return the settings this run
        changes from the checkpoint's run ("key: old -> new")."""
        state, changed = restore_checkpoint(ckpt, parallel.unwrap(self.model), self.optimizer, self.tok_spec,
                                            self.cfg.to_dict())
        self.loader.load_state_dict(state["loader"])
        self.step, self.bad_steps, self.tokens_seen = state["step"], state["bad_steps"], state["tokens_seen"]
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return changed

    def initialize(self, path: str | os.PathLike) -> tuple[Path, list[str]]:
        """Load the weights of a trained model (a run folder, a checkpoint or a ``save_pretrained`` folder) into this
        run's model; return its folder and the model settings this config changes from it ("key: old -> new")."""
        return initialize_model(path, parallel.unwrap(self.model), self.model_config, self.tok_spec, self.data_path,
                                model_name(self.cfg.to_dict()))

    # --- steps ------------------------------------------------------------------------------------------------
    def _forward(self, b: Batch) -> torch.Tensor:
        b = b.to(self.device)
        return self._loss(b.input_ids, b.labels, b.cu_seqlens, b.shifted)

    def _forward_backward(self, micro: list[Batch]) -> float:
        """Accumulate the gradient of the step's mean loss over its micro-batches (and processes); return the loss."""
        started = time.perf_counter()
        total = float(sum(b.num_targets for b in micro))
        if self.d.world > 1:
            total = self.d.sum(torch.tensor([total], device=self.device)).item()
        loss_sum = torch.zeros((), device=self.device)
        for i, b in enumerate(micro):
            if i and self._stop_between_micro and self.d.any(self.preemption.requested, self.device):
                raise Preempted(together=True)  # every process gives the step up here, so they can save together
            # DDP/FSDP average gradients over processes (dp x cp): scale so that the result is the global mean.
            weight = b.num_targets * self.d.world / total
            if self.graphed is not None:
                b = b.to(self.device)
                loss = self.graphed(b.input_ids, b.labels, weight)
            else:
                with parallel.grad_sync(self.model, sync=i == len(micro) - 1):
                    loss = self._forward(b)
                    (loss * weight).backward()
            loss_sum += loss.detach().float() * b.num_targets
            if self.micro_progress is not None:
                self.micro_progress(i + 1, len(micro), time.perf_counter() - started)
        return (self.d.sum(loss_sum) / total).item()

    def _grad_norm(self) -> float:
        """The gradients' global norm, after clipping them to ``grad_clip`` (when it is positive)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    def train_step(self) -> dict:
        """One optimizer step (or a skipped one); returns the step's record. SIGTERM may cut the forward and backward
        short (``Preempted``): the model, optimizer and counters then hold the last whole step."""
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro = self.loader.batch(self.step)
        # a CUDA graph's capture must not be cut short; GPU steps are short anyway
        with self.preemption.interruptible() if self.graphed is None else contextlib.nullcontext():
            loss = self._forward_backward(micro)
        self.tokens_seen += sum(b.input_ids.numel() for b in micro) * self.d.world  # whole sequences
        self.step += 1
        record = {"step": self.step, "loss": loss, "lr": lr, "tokens": self.tokens_seen}
        grad_norm = None
        if math.isfinite(loss):
            record["grad_norm"] = grad_norm = self._grad_norm()
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.bad_steps += 1
            record["skipped"] = True
        self.optimizer.zero_grad(set_to_none=self.graphed is None)
        return record

    def evaluate(self) -> dict | None:
        """Over fixed validation batches (``eval_batches``, or fewer to read the split at most once): the mean loss
        ``val_loss`` and, for a model with forget gates, ``val_acp_skipped`` (``evaluation.validation_loss``). None
        without a validation split."""
        if self.val_loader is None:
            return None
        batches = max(1, min(self.cfg.eval_batches, len(self.val_ds.tokens) // (self.cfg.batch_size * self.cfg.seq_len)))
        return evaluation.validation_loss(self.model, self._forward, self.val_loader, batches, self.d, self.device,
                                          self.preemption.interruptible())

    def sample(self) -> str:
        """A sampled continuation of ``sample_prompt`` (default: the start of the first validation document)."""
        if self.cfg.sample_prompt is not None:
            prompt = [self.tokenizer.eot_id] + self.tokenizer.encode(self.cfg.sample_prompt)
        else:
            source = self.val_ds if self.val_ds.num_docs else self.train_ds
            prompt = source.document(0)[:24].tolist()
        ids = evaluation.sample(self.model, prompt, self.cfg.sample_tokens, self.cfg.seed, self.device, self.autocast,
                                self.tokenizer.eot_id, self.hf)
        return self.tokenizer.decode(ids)

    # --- the run ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock ``out_dir`` (a second run there, e.g. a requeued job while the first still runs, is refused), then
        resume or initialize the model as configured: all that can refuse the run (ValueError, FileNotFoundError),
        before anything is written. ``run()`` calls it when it was not called."""
        if self._started is not None:
            return
        self._lock = take_run_folder(self.run_dir, self.d, self.device)
        try:
            export = self.cfg.export_dir
            if export is not None and Path(export).expanduser().exists():
                raise ValueError(f"export_dir: {export} exists; the run exports its model into a new folder")
            ckpt = resume_point(self.run_dir, self.cfg.resume)
            check_out_dir(self.run_dir, ckpt, self.cfg.resume)
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

    @property
    def finished(self) -> bool:
        """Whether the run is at ``max_steps`` (a resumed finished run trains nothing)."""
        return self.step >= self.cfg.max_steps

    def run(self) -> dict:
        """Train to ``max_steps`` (after ``start()``), with validation, logs and checkpoints; return a summary. On
        SIGTERM the run stops after the current step with a checkpoint (the same command resumes it), on a second one
        at once, and the summary has ``stopped="SIGTERM"``. ``out_dir`` is unlocked at the end."""
        try:
            self.start()
            with Preemption(announce=self.d.main, stop_after=1 if self.d.world == 1 else 2) as self.preemption:
                return self._run()
        finally:
            self._unlock()

    def _announce(self, log: RunLog) -> None:
        cfg, micro = self.cfg, self.loader.grad_accum
        for note in self._started:
            log.write(note)
        name = f"{cfg.arch} {cfg.size}" if has_size(cfg.arch) else cfg.arch
        log.write(f"{name}: {self.num_params / 1e6:.1f}M parameters on {self.device} x {self.d.world}"
                  f" ({'bf16 autocast' if self.autocast else 'fp32'}); data {self.data_path}: "
                  f"{len(self.train_ds.tokens):,} train / {len(self.val_ds.tokens):,} val tokens "
                  f"({self.tok_spec['name']}); {cfg.batch_size} x {cfg.seq_len} tokens per step, "
                  f"{micro} micro-batch{'es' if micro > 1 else ''} per process"
                  + ("; forward + backward replayed from a CUDA graph" if self.graphed is not None else ""))
        self._warning = cpu_warning(self.metrics.step_flops() / self.d.world, self.device,
                                    f"{name} at {cfg.batch_size} x {cfg.seq_len} tokens")
        if self._warning is not None and not self.finished:
            log.write(self._warning)
        if self.finished:
            log.write(f"nothing to train: the run is at step {self.step}, max_steps={cfg.max_steps} (raise "
                      f"max_steps to continue it)")
        if self.val_loader is None and cfg.eval_every:
            log.write(f"no validation loss: the val split of {self.data_path} has {len(self.val_ds.tokens):,} tokens, "
                      f"fewer than seq_len + 1 = {cfg.seq_len + 1}")

    def _run(self) -> dict:
        cfg, every = self.cfg, lambda n: n and self.step % n == 0  # noqa: E731
        if self.d.main:
            write_train_config(self.run_dir, cfg.to_dict())
        log = RunLog(self.run_dir, self.step, cfg.max_steps, main=self.d.main, tensorboard=cfg.tensorboard,
                     progress=cfg.progress, wandb=cfg.wandb, config=cfg.to_dict())
        self._announce(log)
        summary = {"first_loss": None, "val_loss": None}
        self.model.train()
        self.metrics.reset(self.tokens_seen)
        self.micro_progress = log.within_step
        first = self.step + 1
        try:
            while not self.finished:
                record = self._timed_step(log, first)
                if summary["first_loss"] is None:
                    summary["first_loss"] = record["loss"]
                summary["loss"] = record["loss"]
                # SIGTERM: every process stops after the same step (the save is collective), whichever received it
                stop = not self.finished and self.d.any(self.preemption.requested, self.device)
                self._record(log, record, stop)
                if (every(cfg.eval_every) or self.finished) and not stop:
                    self._validate(log, summary)
                if every(cfg.save_every) or self.finished or stop:
                    for path in self.save(background=cfg.async_checkpoint and not (self.finished or stop)):
                        log.write(f"saved {path}")
                if stop:
                    log.write(f"stopped by SIGTERM after step {self.step}; the same command resumes the run")
                    summary["stopped"] = "SIGTERM"
                    break
                if every(cfg.eval_every) or every(cfg.save_every):  # not training time
                    self.metrics.reset(self.tokens_seen)
            if cfg.export_dir is not None and "stopped" not in summary:
                if self.d.main:
                    log.write(f"exported {export_model(list_checkpoints(self.run_dir)[-1], cfg.export_dir)}")
                self.d.barrier()
        except Preempted as e:
            self._stop_at_once(log, e.together)
            summary["stopped"] = "SIGTERM"
        finally:
            self.micro_progress = None
            log.close()
        saved = list_checkpoints(self.run_dir) if self.d.main else []
        summary.update(step=self.step, bad_steps=self.bad_steps, tokens=self.tokens_seen, run_dir=str(self.run_dir),
                       checkpoint=str(saved[-1]) if saved else None)
        return summary

    def _timed_step(self, log: RunLog, first: int) -> dict:
        """``train_step``; after the run's ``first`` step, if it was slow (or the CPU warning was given), what the
        rest will take at that pace."""
        started = time.perf_counter()
        record = self.train_step()
        took = time.perf_counter() - started
        if self.step == first and (self._warning is not None or took > 60):
            left = self.cfg.max_steps - self.step
            log.write(f"step {self.step} took {duration(took)}; the {left:,} steps to max_steps="
                      f"{self.cfg.max_steps:,} at that pace: about {duration(took * left)}")
        return record

    def _record(self, log: RunLog, record: dict, stop: bool) -> None:
        """Add the throughput to a step's record and log it (every ``log_every`` steps, at the end, on a skipped step
        and before a stop); a run past ``max_bad_steps`` stops here."""
        record.update(self.metrics.throughput(self.tokens_seen))
        if record.get("skipped"):
            log.write(f"step {self.step}: non-finite loss/gradient, step skipped "
                      f"({self.bad_steps}/{self.cfg.max_bad_steps})")
        if (self.cfg.log_every and self.step % self.cfg.log_every == 0) or self.finished or record.get("skipped") \
                or stop:
            log.log(record)
            self.metrics.reset(self.tokens_seen)
        self._check_bad_steps()
        mfu = record.get("mfu")
        log.progress({"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}",
                      **({"mfu": f"{100 * mfu:.1f}%"} if mfu is not None else {})})

    def _validate(self, log: RunLog, summary: dict) -> None:
        val = self.evaluate()
        if val is None:
            return
        summary["val_loss"] = val["val_loss"]
        log.log({"step": self.step, **val})
        line = f"step {self.step}: val loss {val['val_loss']:.4f}"
        if "val_acp_skipped" in val:
            verb = "skips" if parallel.unwrap(self.model).config.acp else "would skip"
            line += f", ACP {verb} {val['val_acp_skipped']:.1%} of the attention tiles"
        log.write(line)

    def _check_bad_steps(self) -> None:
        if self.bad_steps <= self.cfg.max_bad_steps:
            return
        ckpts = list_checkpoints(self.run_dir)
        kept = f"the last checkpoint is {ckpts[-1]}" if ckpts else f"no checkpoint was saved in {self.run_dir}"
        raise FloatingPointError(
            f"loss/gradient was NaN or Inf at {self.bad_steps} steps (max_bad_steps={self.cfg.max_bad_steps}), last at "
            f"step {self.step}; lower lr (now {self.cfg.lr}) or check the data; {kept}")

    def _stop_at_once(self, log: RunLog, together: bool) -> None:
        """After SIGTERM cut a step or validation short: keep the last whole step (saved unless out_dir's newest
        checkpoint is of it). Several processes save only when they gave the step up ``together``: else the others
        may be inside the step's collectives, which a save needs."""
        self.optimizer.zero_grad(set_to_none=self.graphed is None)  # the given-up step's partial gradients
        saved = list_checkpoints(self.run_dir) if self.d.main else []
        if self.d.world > 1 and not together:
            kept, resumes = "no save (it needs every process)", "the same command resumes the run"
        else:
            kept = None  # every process takes the same branch: a save is collective
            if self.step == 0:
                kept, resumes = "no step finished, nothing saved", "the same command starts the run again"
            elif self.d.any(bool(saved) and checkpoint_step(saved[-1]) == self.step, self.device):
                kept, resumes = f"step {self.step} is saved", "the same command resumes the run"
            else:
                written = self.save()
                kept, resumes = f"saved {written[0] if written else 'step ' + str(self.step)}", \
                    "the same command resumes the run"
        log.write(f"stopped by SIGTERM during step {self.step + 1}: {kept}; {resumes}")


def train(cfg: TrainConfig | Trainer) -> dict:
    """Train with ``cfg`` (or a ``Trainer`` built from it, maybe started); print a sample at the end on rank 0 (unless
    ``sample_tokens=0``, or no step was trained); tear down the process group the trainer made.

    Returns the summary: first/last training loss, last validation loss, steps, tokens, run folder, sample."""
    trainer = cfg if isinstance(cfg, Trainer) else Trainer(cfg)
    try:
        summary = trainer.run()
        # a preempted job has seconds left; a finished run printed its sample when it finished
        if trainer.cfg.sample_tokens and not summary.get("stopped") and "loss" in summary:
            text = trainer.sample()
            if trainer.d.main:
                print(f"\n--- sample (step {trainer.step}) ---\n{text}\n---", flush=True)
            summary["sample"] = text
        return summary
    finally:
        if trainer.d.owns_group:
            dist.destroy_process_group()
