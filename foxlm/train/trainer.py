"""The training loop: one process, or many under ``torchrun`` (FSDP2 ``fully_shard`` or DDP, ``parallel.py``).

Per step: the global batch (``TokenLoader``) is split over processes and micro-batches; every micro-batch loss is
weighted by its share of the step's targets, so the update is that of one big batch whatever the split. Then:
NaN/Inf check (skip + count), gradient clipping, AdamW with warmup + cosine to ``min_lr``. Validation loss every
``eval_every`` steps; logs (``logging.py``) on rank 0; atomic checkpoints (``checkpointing.py``) every ``save_every``
steps and at the end; ``resume="auto"`` continues a run from its latest valid checkpoint and reproduces the losses
of an uninterrupted run. SIGTERM ends the run at the next safe point (one process: inside the step, keeping the
last whole step; several: between micro-batches on the CPU, else after the step), with a checkpoint
(``preemption.py``). ``cuda_graph=true`` replays each micro-batch's forward + backward from a CUDA graph.

The parts have a home each: the data and its loaders (``data.py``), the model (``model.py``), parallelism and
compilation (``parallel.py``), the optimizer, schedule and clipping (``optim.py``), CUDA graphs (``cuda_graph.py``),
the run folder's lock, saving, resuming and initializing (``checkpointing.py``), each process's random draws
(``rng.py``), validation and sampling (``evaluation.py``), throughput and MFU (``metrics.py``), logs (``logging.py``),
SIGTERM (``preemption.py``). This module builds them from the config and runs the loop.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from ..checkpoint.export import export_model
from ..checkpoint.run_folder import list_checkpoints, write_train_config
from ..presets import has_size, is_hf_arch
from . import evaluation, parallel
from .checkpointing import Checkpointer, give_back_run_folder, take_run_folder
from .config import TrainConfig
from .cuda_graph import graph_micro_step
from .data import build_loaders, load_data
from .loader import Batch
from .logging import RunLog
from .metrics import Metrics, cpu_warning, pace
from .model import build_model, causal_lm_loss, model_config
from .optim import build_optimizer, clip_gradients, lr_at, set_lr
from .preemption import Preempted, Preemption
from .rng import rng_state, seed_process, set_rng_state


class Trainer:
    """A run of a ``TrainConfig``: its parts built from it; ``start()`` takes the run folder and resumes (or
    initializes), ``run()`` trains and returns a summary."""

    def __init__(self, cfg: TrainConfig):
        cfg.validate()  # one built in Python, not by load_config, too: min_lr < 0 would train at a negative lr
        self.cfg = cfg
        self.d, self.device = parallel.setup(cfg.device, cfg.cp)
        self.run_dir = Path(cfg.out_dir).expanduser()
        self.autocast = (cfg.precision == "bf16") or (cfg.precision == "auto" and self.device.type == "cuda")
        self.hf = is_hf_arch(cfg.arch)
        self.data = load_data(cfg, self.d)
        self.model_config = model_config(cfg, self.data.tok_spec, self.device)
        self.data.verify(self.model_config.vocab_size)
        module = build_model(cfg, self.model_config, self.device)
        seed_process(cfg.seed, self.d.rank)  # the same weights on every process, then each process's own draws
        self.num_params = module.num_parameters()
        self.model = parallel.parallelize(module, cfg.compile, cfg.parallel, self.d, self.device)
        self.optimizer = build_optimizer(cfg, self.model, self.d, self.device)
        # the loss holds no Trainer: no reference cycle keeps a finished run's CUDA graph for the GC to free
        self._loss = functools.partial(causal_lm_loss, self.model, self.autocast)
        self.graphed = graph_micro_step(cfg, self._loss, self.model, self.device, self.d.world, self.hf)
        self.loader, self.val_loader = build_loaders(cfg, self.data, self.d)
        self.checkpointer = Checkpointer(cfg, self.d, self.device, self.model, self.model_config, self.optimizer,
                                         self.loader, self.data)
        self.metrics = Metrics(self.model_config, self.num_params, cfg.seq_len, cfg.batch_size, self.hf,
                               cfg.peak_tflops, self.device, self.d.world)
        self.step, self.bad_steps, self.tokens_seen = 0, 0, 0
        self._interval = [0.0, 0]  # (sum of the losses, steps) that updated the model since the last logged loss
        self._val_due = False  # this step's validation is due and not logged: SIGTERM cut it, or stopped before it
        self.preemption = Preemption()  # replaced by the one run() installs for SIGTERM
        # several processes agree on a stop between micro-batches where that costs nothing (the CPU: no device to
        # sync with), so that a long CPU step stops within seconds; on a GPU steps are short: after the step
        self._stop_between_micro = self.d.world > 1 and self.device.type == "cpu"
        self.micro_progress: Callable[[int, int, float], None] | None = None  # (done, of, seconds) within a step
        self._warning: str | None = None  # cpu_warning's, when the run starts
        self._lock: IO[str] | None = None  # out_dir's lock while the run holds it (rank 0)
        self._started: list[str] | None = None  # after start(): what it did, for the log ("resumed from ...")

    # --- a step ------------------------------------------------------------------------------------------------
    def _forward(self, b: Batch) -> torch.Tensor:
        b = b.to(self.device)
        return self._loss(b.input_ids, b.labels, b.cu_seqlens, b.shifted)

    def _forward_backward(self, micro: list[Batch]) -> float | None:
        """Accumulate the gradient of the step's mean loss over its micro-batches (and processes); return the loss.

        The loss is that of HF ``Trainer`` with ``num_items_in_batch`` (and torchtitan's): the sum of the token losses
        of all micro-batches and processes over the step's count of targets. A micro-batch without targets (every label
        ignored: the loader makes none, a user's data may) adds 0: its mean loss is 0 (``causal_lm_loss`` averages over
        ``max(count, 1)``, a Hugging Face model's own loss too) and its weight 0. A step without a target anywhere
        has no loss: None, and no forward or backward runs."""
        started = time.perf_counter()
        total = float(sum(b.num_targets for b in micro))
        if self.d.world > 1:
            total = self.d.sum(torch.tensor([total], device=self.device)).item()
        if not total:  # every process sees the same total: all of them skip the step
            return None
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

    def train_step(self) -> dict:
        """One optimizer step (or a skipped one); returns the step's record. SIGTERM may cut the forward and backward
        short (``Preempted``): the model, optimizer, counters and random generators then hold the last whole step. A
        non-finite loss or gradient skips the update and counts as a bad step (``max_bad_steps``); a global batch
        without a single target (every label ignored) skips it too, with no ``loss`` in the record, and is not a bad
        step: the step counter, the schedule and the data go on."""
        lr = lr_at(self.step, self.cfg)
        set_lr(self.optimizer, lr)
        micro = self.loader.batch(self.step)
        if self.graphed is not None:  # a CUDA graph's capture must not be cut short; GPU steps are short anyway
            loss = self._forward_backward(micro)
        else:
            # a step given up has drawn random numbers (dropout) for the micro-batches it ran: the last whole step's
            # generator state is put back, so that its checkpoint resumes the draws of an uninterrupted run
            rng = rng_state(self.device)
            try:
                with self.preemption.interruptible():
                    loss = self._forward_backward(micro)
            except Preempted:  # outside the block: a second SIGTERM cannot cut this short
                set_rng_state(rng, self.device)
                raise
        self.tokens_seen += sum(b.input_ids.numel() for b in micro) * self.d.world  # whole sequences
        self.step += 1
        record = {"step": self.step, "lr": lr, "tokens": self.tokens_seen}
        if loss is None:  # no target: nothing to learn, and AdamW would still move the weights (momentum, decay)
            record["skipped"] = True
            return record
        record["loss"] = loss
        grad_norm = None
        if math.isfinite(loss):
            record["grad_norm"] = grad_norm = clip_gradients(self.model, self.cfg.grad_clip)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.bad_steps += 1
            record["skipped"] = True
        self.optimizer.zero_grad(set_to_none=self.graphed is None)
        return record

    def evaluate(self) -> dict | None:
        """``evaluation.validation_loss`` over ``eval_batches`` fixed batches; None without a validation split."""
        if self.val_loader is None:
            return None
        return evaluation.validation_loss(self.model, self._forward, self.val_loader, self.cfg.eval_batches, self.d,
                                          self.device, self.preemption.interruptible())

    def sample(self) -> str:
        """A sampled continuation of ``sample_prompt`` (default: the start of the first validation document)."""
        prompt = evaluation.prompt_ids(self.cfg.sample_prompt, self.data)
        tok = self.data.tokenizer
        return tok.decode(evaluation.sample(self.model, prompt, self.cfg.sample_tokens, self.cfg.seed, self.device,
                                            self.autocast, tok.eot_id, self.hf))

    # --- the run ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock ``out_dir`` (a second run there, e.g. a requeued job while the first still runs, is refused), then
        resume or initialize the model as configured (``Checkpointer.resume``): all that can refuse the run
        (ValueError, FileNotFoundError), before anything is written. ``run()`` calls it when it was not called."""
        if self._started is not None:
            return
        self._lock, created = take_run_folder(self.run_dir, self.d, self.device)
        try:
            state, notes = self.checkpointer.resume()
        except BaseException:
            self._unlock()
            give_back_run_folder(created)  # a refused run leaves out_dir as it was
            raise
        if state is not None:
            self.step, self.bad_steps, self.tokens_seen = state["step"], state["bad_steps"], state["tokens_seen"]
            # the steps after the last log record: the next record's mean takes them in, as without the resume
            self._interval = list(state.get("log_interval", (0.0, 0)))
            self._val_due = bool(state.get("val_due", False))  # run first: the log would miss it
        if self.cfg.async_checkpoint and self.d.world == 1:
            notes.append("async_checkpoint=true is not used: one process writes each checkpoint whole (background "
                         "saves write the shards of several processes)")
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
                  f" ({'bf16 autocast' if self.autocast else 'fp32'}); data {self.data.path}: "
                  f"{len(self.data.train.tokens):,} train / {len(self.data.val.tokens):,} val tokens "
                  f"({self.data.tok_spec['name']}); {cfg.batch_size} x {cfg.seq_len} tokens per step, "
                  f"{micro} micro-batch{'es' if micro > 1 else ''} per process"
                  + ("; forward + backward replayed from a CUDA graph" if self.graphed is not None else ""))
        self._warning = cpu_warning(self.metrics.step_flops() / self.d.world, self.device,
                                    f"{name} at {cfg.batch_size} x {cfg.seq_len} tokens")
        if self._warning is not None and not self.finished:
            log.write(self._warning)
        if cfg.warmup_steps > cfg.max_steps and not self.finished:
            log.write(f"warning: warmup_steps={cfg.warmup_steps} is more than max_steps={cfg.max_steps}: warming up "
                      f"over the {cfg.max_steps} steps instead, to lr={cfg.lr} at the last")
        if self.finished:
            log.write(f"nothing to train: the run is at step {self.step}, max_steps={cfg.max_steps} (raise "
                      f"max_steps to continue it)")
        if self.val_loader is not None and (n := evaluation.validation_batches(self.val_loader, cfg.eval_batches)) \
                < cfg.eval_batches:
            log.write(f"eval_batches={cfg.eval_batches} is more than the val split of {self.data.path} holds "
                      f"({len(self.data.val.tokens):,} tokens, {cfg.batch_size} x {cfg.seq_len} a batch): validation "
                      f"reads {n} batch{'es' if n > 1 else ''}")
        if self.val_loader is None and cfg.eval_every:
            log.write(f"no validation loss: the val split of {self.data.path} has {len(self.data.val.tokens):,} "
                      f"tokens, fewer than seq_len + 1 = {cfg.seq_len + 1}")

    def _run(self) -> dict:
        cfg, every = self.cfg, lambda n: n and self.step % n == 0  # noqa: E731
        if self.d.main:
            write_train_config(self.run_dir, cfg.to_dict())
        log = RunLog(self.run_dir, self.step, cfg.max_steps, main=self.d.main, tensorboard=cfg.tensorboard,
                     progress=cfg.progress, wandb=cfg.wandb, config=cfg.to_dict())
        self._announce(log)
        summary = {"first_loss": None, "val_loss": None}
        self.model.train()
        self.micro_progress = log.within_step
        first = self.step + 1
        try:
            if self._val_due:
                self._validate(log, summary)
            self.metrics.reset(self.tokens_seen)
            while not self.finished:
                started = time.perf_counter()
                record = self.train_step()
                took = time.perf_counter() - started
                if "loss" in record:
                    if summary["first_loss"] is None:
                        summary["first_loss"] = record["loss"]
                    summary["loss"] = record["loss"]
                # SIGTERM: every process stops after the same step (the save is collective), whichever received it
                stop = not self.finished and self.d.any(self.preemption.requested, self.device)
                self._record(log, record, stop, took, first=self.step == first)
                started = time.perf_counter()  # validation and checkpoints are not training time
                due = bool(every(cfg.eval_every) or self.finished)
                if due and not stop:
                    self._validate(log, summary)
                if every(cfg.save_every) or self.finished or stop:
                    background = cfg.async_checkpoint and not (self.finished or stop)
                    # a stop leaves a due validation to the resumed run
                    for path in self.checkpointer.save(self.step, self.bad_steps, self.tokens_seen, background,
                                                       tuple(self._interval), val_due=due and stop):
                        log.write(f"saved {path}")
                if stop:
                    log.write(f"stopped by SIGTERM after step {self.step}; the same command resumes the run")
                    summary["stopped"] = "SIGTERM"
                    break
                self.metrics.exclude(time.perf_counter() - started)
            if cfg.export_dir is not None and "stopped" not in summary:
                if self.d.main:
                    exported = export_model(list_checkpoints(self.run_dir)[-1], cfg.export_dir, "export_dir")
                    log.write(f"exported {exported}")
                self.d.barrier()
        except Preempted as e:  # SIGTERM cut a step or validation short
            self.optimizer.zero_grad(set_to_none=self.graphed is None)  # the given-up step's partial gradients
            kept = self.checkpointer.keep_last_step(self.step, self.bad_steps, self.tokens_seen, e.together,
                                                    tuple(self._interval), val_due=self._val_due)
            where = f"the validation of step {self.step}" if self._val_due else f"step {self.step + 1}"
            log.write(f"stopped by SIGTERM during {where}: {kept}")
            summary["stopped"] = "SIGTERM"
        finally:
            self.micro_progress = None
            log.close()
        saved = list_checkpoints(self.run_dir) if self.d.main else []
        summary.update(step=self.step, bad_steps=self.bad_steps, tokens=self.tokens_seen, run_dir=str(self.run_dir),
                       checkpoint=str(saved[-1]) if saved else None)
        return summary

    def _validate(self, log: RunLog, summary: dict) -> None:
        """Validate this step and log it (into ``summary`` too); until it is logged ``_val_due`` holds, so that a
        checkpoint saved when SIGTERM cuts it short has the resumed run validate this step first."""
        self._val_due = True
        val = self.evaluate()
        self._val_due = False
        if val is not None:
            summary["val_loss"] = val["val_loss"]
            log.validation(self.step, val, acp=getattr(parallel.unwrap(self.model).config, "acp", False))

    def _record(self, log: RunLog, record: dict, stop: bool, took: float, first: bool) -> None:
        """Add the throughput to the record of a step that ``took`` seconds and log it (every ``log_every`` steps, at
        the end, before a stop and past ``max_bad_steps``, with the mean loss of the steps that updated the model
        since the last such record, as HF ``Trainer`` and torchtitan log it, and the tokens/s of the training time
        since then; a skipped step at once, with its own loss); after the run's ``first`` step, if it was slow (or the
        CPU warning was given), what the rest will take at that pace. A run past ``max_bad_steps`` stops here."""
        if first and (self._warning is not None or took > 60):
            log.write(pace(self.step, took, self.cfg.max_steps))
        if not record.get("skipped"):
            self._interval[0] += record["loss"]
            self._interval[1] += 1
        record.update(self.metrics.throughput(self.tokens_seen))
        if record.get("skipped") and "loss" not in record:
            log.write(f"warning: step {self.step}: no target in the batch (every label ignored), step skipped")
        elif record.get("skipped"):
            log.write(f"step {self.step}: non-finite loss/gradient, step skipped "
                      f"({self.bad_steps}/{self.cfg.max_bad_steps})")
        skipped = record.get("skipped", False)
        if skipped:
            log.log(record)
        # the run's last record (the end, a stop, past max_bad_steps) holds the steps since the previous one also after
        # a skipped step: they were never logged (or, past max_bad_steps, the losses before the divergence)
        last = self.finished or stop or self.bad_steps > self.cfg.max_bad_steps
        if self._interval[1] and (last or (not skipped and self.step % self.cfg.log_every == 0)):
            own = ("skipped", "loss", "grad_norm") if skipped else ()
            log.log({**{k: v for k, v in record.items() if k not in own},
                     "loss": self._interval[0] / self._interval[1]})
            self._interval = [0.0, 0]
            self.metrics.reset(self.tokens_seen)
        if self.bad_steps > self.cfg.max_bad_steps:
            # a save still being written in the background is committed, not left for the next run to delete: every
            # process stops here at the same step (the loss and gradient norm are reduced over them)
            for path in self.checkpointer.finish_saving():
                log.write(f"saved {path}")
            ckpts = list_checkpoints(self.run_dir)
            kept = f"the last checkpoint is {ckpts[-1]}" if ckpts else f"no checkpoint was saved in {self.run_dir}"
            raise FloatingPointError(f"loss/gradient was NaN or Inf at {self.bad_steps} steps (max_bad_steps="
                                     f"{self.cfg.max_bad_steps}), last at step {self.step}; lower lr (now "
                                     f"{self.cfg.lr}) or check the data; {kept}")
        log.progress(record)


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
