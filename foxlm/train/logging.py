"""A run's logs on the main process: ``log.jsonl`` (one record per line), TensorBoard scalars, W&B metrics, a
progress bar.

TensorBoard tags and W&B keys are ``train/<key>`` for a step's record and ``val/<key>`` for the validation's
(``val_loss`` in the JSONL is ``val/loss`` there). A resumed run purges the TensorBoard events the previous run logged
after its checkpoint (a run starting again at step 0 deletes them); in W&B it is a run of its own (W&B takes no step
twice in one run).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..checkpoint.files import write_atomic


def read_log(path: Path) -> list[dict]:
    """The records of a ``log.jsonl``. A torn last line (a write cut off by a full disk or a power loss) is dropped;
    a damaged line before it is an error naming the line."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not a JSON record ({e}); move the file away to resume the "
                             f"run without its log") from None
    return records


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a record's key: ``val_loss`` -> ``val/loss``, ``loss`` -> ``train/loss``."""
    return "val/" + key[len("val_"):] if key.startswith("val_") else f"train/{key}"


class RunLog:
    """JSONL + TensorBoard + progress bar, on the main process only (``main``); ``write`` prints a line."""

    def __init__(self, run_dir: Path, start_step: int, max_steps: int, *, main: bool, tensorboard: bool,
                 progress: bool, wandb: bool = False, config: dict | None = None):
        """``wandb``: log to Weights & Biases too (``config``, the run's train config, as its config), a run named
        after ``run_dir`` in project ``foxlm`` (``WANDB_PROJECT``, ``WANDB_MODE`` etc. as W&B reads them), its
        files in ``run_dir/wandb`` unless ``WANDB_DIR`` says where."""
        self.main, self.bar, self.tb, self.wandb, self.file = main, None, None, None, None
        if not main:
            return
        log_path = run_dir / "log.jsonl"
        kept = []
        if start_step > 0 and log_path.exists():  # resuming: drop what the killed run logged after the checkpoint
            kept = [record for record in read_log(log_path) if record.get("step", 0) <= start_step]
        # replaced whole: a write cut off in place (a full disk) lost the records past the bytes it had written
        write_atomic(log_path, "".join(json.dumps(record) + "\n" for record in kept))
        self.file = open(log_path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("tensorboard=true: no TensorBoard logs, tensorboard is not installed (the extra [tensorboard]: "
                      "pip install 'foxlm[tensorboard]'; tensorboard=false silences this)", file=sys.stderr)
            else:
                if start_step == 0:  # as log.jsonl: the events of an attempt that died before its first checkpoint
                    # go (a purge marker in this run's file would be read first, and do nothing, where both files were
                    # made in one second and this one's name sorts first)
                    for events in (run_dir / "tb").glob("events.out.tfevents.*"):
                        events.unlink()
                # readers drop the events at and after purge_step: what a killed run logged after the checkpoint
                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step > 0 else None)
        if wandb:
            self.wandb = _wandb_run(run_dir, config)
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def log(self, record: dict) -> None:
        """Append ``record`` (with its ``step``) to the JSONL file, and its numbers to TensorBoard."""
        if not self.main:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {tensorboard_tag(key): value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))}
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def progress(self, record: dict) -> None:
        """Advance the bar by a step, showing its ``record``'s loss, throughput and, where known, MFU."""
        if self.bar is not None:
            mfu = record.get("mfu")
            loss = f"{record['loss']:.3f}" if "loss" in record else "-"  # a step without targets has none
            self.bar.set_postfix({"loss": loss, "tok/s": f"{record['tokens_per_s']:,.0f}",
                                  **({"mfu": f"{100 * mfu:.1f}%"} if mfu is not None else {})}, refresh=False)
            self.bar.update(1)

    def validation(self, step: int, val: dict, acp: bool) -> None:
        """Log validation ``val`` at ``step`` and write its line (with ACP's share of skipped tiles, where measured;
        ``acp``: whether the model skips them, or only would)."""
        self.log({"step": step, **val})
        line = f"step {step}: val loss {val['val_loss']:.4f}"
        if "val_acp_skipped" in val:
            line += f", ACP {'skips' if acp else 'would skip'} {val['val_acp_skipped']:.1%} of the attention tiles"
        self.write(line)

    def within_step(self, done: int, of: int, seconds: float) -> None:
        """Progress inside a long step (a CPU step can take minutes): ``done`` of its ``of`` micro-batches after
        ``seconds``, on the bar once the step has run a few seconds."""
        if self.bar is not None and seconds >= 2:
            self.bar.set_postfix_str(f"micro-batch {done}/{of} of step {self.bar.n + 1}, {seconds:.0f} s in")

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
        if self.wandb is not None:
            self.wandb.finish()
        if self.file is not None:
            self.file.close()


def _wandb_run(run_dir: Path, config: dict | None):
    """A W&B run for ``RunLog`` (see there), or None with a line on stderr when wandb is not installed."""
    try:
        import wandb
    except ImportError:
        print("wandb=true: no W&B logs, wandb is not installed (the extra [wandb]: pip install 'foxlm[wandb]'; "
              "wandb=false silences this)", file=sys.stderr)
        return None
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "foxlm"), name=run_dir.name, config=config,
                          dir=os.environ.get("WANDB_DIR") or run_dir)
    except wandb.Error as e:  # e.g. no API key: one line, with the way to log without an account
        raise ValueError(f"wandb=true: {e} (WANDB_MODE=offline logs to local files, `wandb sync` uploads them)") \
            from None
