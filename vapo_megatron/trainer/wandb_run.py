"""Weights & Biases tracking of a run (trainer.wandb; off by default), on global rank 0 only.

    tracker = WandbTracker.start(cfg.trainer.wandb, run_dir, run_record(cfg))   # None: not tracking
    tracker.log(step, metrics)      # what MetricsLogger writes to metrics.jsonl, same names and step
    tracker.finish()

One W&B run per run directory: its id is created once and kept in run_dir/wandb_id, so a
resumed or requeued job continues the same W&B run (resume="allow") instead of starting another.
W&B's files go to run_dir/wandb (an offline run: `wandb sync run_dir/wandb/offline-run-*`).

Every step once. W&B holds exactly what reached its transaction logs, and a killed process
loses what it had not flushed yet (W&B flushes every few seconds), so at each start the tracker
asks W&B how far it got: the server's step for an online run, the run's local logs
(wandb_records.py) for an offline one. Then it logs only later steps, since W&B's steps must
increase: first the records of metrics.jsonl that the resume keeps and W&B lacks (`backfill`),
then the steps the run computes. The trainer's resume is exact, so a recomputed step that W&B
already holds has the values W&B shows (perf/ timings aside). A crash between two records of one
step (a step's metrics, then its eval) leaves the later one out of W&B; metrics.jsonl and
TensorBoard keep it.

The warm start's records all sit at step 0 in metrics.jsonl (their own counter is sft_step), so
in W&B, whose step 0 is one row, the sft/ metrics hold their last values; their curve is in
TensorBoard (tensorboard/sft) and metrics.jsonl.

wandb is imported only here and only when enabled. Missing, or unable to start: one warning and
the run goes on (online falls back to offline first, so nothing is lost).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import sys
from pathlib import Path

from vapo_megatron.config.cli import verbose
from vapo_megatron.config.schema import WandbConfig
from vapo_megatron.runtime.atomic import write_atomic
from vapo_megatron.trainer import wandb_records

ID_FILE = "wandb_id"
RECORD_KEYS = ("step", "phase", "sft_step")  # metrics.jsonl's bookkeeping: W&B's step is the row's step
# W&B writes its transaction log every 15 s by default; a killed job loses what was not written.
# Records are small and a step takes seconds or more, so flush often.
FLUSH_INTERVAL_S = 2.0


def warn(message: str) -> None:
    print(f"[vapo] warning: W&B: {message}", file=sys.stderr, flush=True)


def run_id(run_dir: Path) -> str:
    """The run directory's W&B id: read from run_dir/wandb_id, or created there (its name plus
    random letters: a new run in the same place after the old one was deleted is a new W&B run)."""
    path = run_dir / ID_FILE
    if path.is_file():
        text = path.read_text().strip()
        if text:
            return text
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", run_dir.resolve().name).strip("-")[:48] or "run"
    new = f"{name}-{secrets.token_hex(4)}"
    write_atomic(path, new + "\n")
    return new


class WandbTracker:
    def __init__(self, run, run_id: str, wandb_dir: Path, first_new_step: int):
        self.run = run
        self.run_id = run_id
        self.wandb_dir = wandb_dir
        self.first_new_step = first_new_step  # steps below it are held by W&B already

    @classmethod
    def start(cls, settings: WandbConfig, run_dir: str, config: dict) -> WandbTracker | None:
        if settings.mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            warn(f"trainer.wandb.mode={settings.mode} but the wandb package is not installed "
                 "(pip install '.[wandb]'); the run goes on with metrics.jsonl and TensorBoard only")
            return None
        root = Path(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        rid = run_id(root)
        mode = settings.mode
        if mode == "online":  # said before W&B's start, which waits for an unreachable server
            timeout = os.environ.get("WANDB_INIT_TIMEOUT", "90")
            base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
            print(f"[vapo] W&B: connecting to {base} (an unreachable server: offline after "
                  f"WANDB_INIT_TIMEOUT={timeout} s)", flush=True)
        try:
            run = _init(wandb, settings, mode, rid, root, config)
        except Exception as e:  # noqa: BLE001 - W&B must never stop a training run
            if mode != "online":
                warn(f"could not start the offline run ({_first_line(e)}); the run goes on without W&B")
                return None
            mode = "offline"
            warn(f"could not start the online run ({_first_line(e)}); logging offline into {root / 'wandb'} "
                 f"instead (upload later: wandb sync {root / 'wandb'}/offline-run-*)")
            try:
                wandb.teardown()  # the failed start holds the run id in this process's W&B service
                run = _init(wandb, settings, mode, rid, root, config)
            except Exception as e2:  # noqa: BLE001
                warn(f"could not start the offline run either ({_first_line(e2)}); the run goes on without W&B")
                return None
        wandb_dir = root / "wandb"
        first_new = max(int(run.step or 0), wandb_records.last_step(wandb_dir, rid) + 1)
        where = f"offline, in {wandb_dir} (upload: wandb sync {wandb_dir}/offline-run-*)" if mode == "offline" \
            else (run.url or "online")
        resumed = f", continuing after step {first_new - 1}" if first_new > 0 else ""
        print(f"[vapo] W&B run {rid}: {where}{resumed}", flush=True)
        return cls(run, rid, wandb_dir, first_new)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One record of metrics.jsonl at `step`; records of one step share one W&B row."""
        if self.run is None or step < self.first_new_step:
            return
        try:
            self.run.log(dict(metrics), step=step)
        except Exception as e:  # noqa: BLE001
            warn(f"logging failed ({_first_line(e)}); W&B tracking stops here, metrics.jsonl goes on")
            self.run = None

    def backfill(self, records: list[dict]) -> None:
        """metrics.jsonl records (as MetricsLogger keeps them on a resume) at steps W&B lacks."""
        for r in records:
            self.log(r["step"], {k: (math.nan if v is None else v) for k, v in r.items() if k not in RECORD_KEYS})

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
                # finish() returns before W&B's service has written the run's files; the service's
                # end waits for it, so the next start (a requeue) reads a complete log.
                import wandb

                wandb.teardown()
            except Exception as e:  # noqa: BLE001
                warn(f"could not finish the run ({_first_line(e)})")
            self.run = None


def _init(wandb, settings: WandbConfig, mode: str, rid: str, root: Path, config: dict):
    quiet = not verbose()
    run = wandb.init(
        project=settings.project, entity=settings.entity or None, name=settings.name or root.resolve().name,
        tags=list(settings.tags) or None, id=rid, resume="allow", mode=mode, dir=str(root),
        settings=wandb.Settings(
            silent=quiet,
            # The job's log is the terminal's: W&B does not wrap stdout (tqdm, subprocesses).
            console="off",
            x_transaction_log_flush_interval=FLUSH_INTERVAL_S,
        ),  # an unreachable server: W&B gives up after WANDB_INIT_TIMEOUT seconds (default 90)
    )
    # A resume may change some settings (config/resume.py): the run's config is the latest start's.
    run.config.update(config, allow_val_change=True)
    return run


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


__all__ = ["ID_FILE", "WandbTracker", "run_id"]
