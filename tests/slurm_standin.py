"""Stand-in for `python -m vapo_megatron.train` under slurm/vapo_train.sbatch (tests/test_slurm.py).

Run by torchrun on every rank: `slurm_standin.py --config FILE [key=value ...]`. Keys it reads:
  standin.steps=N        steps in the whole run; each step sums (rank + 1) over the ranks (gloo)
  standin.pause_at=K     a fresh run (no checkpoint yet) holds at step K until SIGUSR1 arrives
                         (at most 60 s); -1: never hold
  trainer.run_dir=DIR    where it writes (the sbatch script appends this key)

SIGUSR1 is handled as the trainer will: the ranks agree (all-reduce of a flag) on the step to stop
at, rank 0 writes a checkpoint marker holding the next step, and all exit with the trainer's
PREEMPTED_EXIT_CODE (3). A run that finds the marker resumes from it. Rank 0 writes result.json at the end.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 3  # what vapo_megatron.train exits with after its checkpoint on SIGUSR1


def parse_args(argv: list[str]) -> tuple[str, dict[str, str]]:
    if len(argv) < 2 or argv[0] != "--config":
        raise SystemExit(f"usage: slurm_standin.py --config FILE [key=value ...], got {argv}")
    overrides = {}
    for item in argv[2:]:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"argument '{item}' is not key=value")
        overrides[key] = value
    return argv[1], overrides


def main() -> None:
    config, overrides = parse_args(sys.argv[1:])
    run_dir = overrides["trainer.run_dir"]
    steps = int(overrides["standin.steps"])
    pause_at = int(overrides["standin.pause_at"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    stop_requested = False

    def on_usr1(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGUSR1, on_usr1)
    dist.init_process_group("gloo")

    marker = os.path.join(run_dir, "checkpoint.json")
    start = 0
    if os.path.exists(marker):
        with open(marker) as f:
            start = json.load(f)["next_step"]

    total = torch.zeros(1)
    step = start
    held_since = None
    while step < steps:
        stop = torch.tensor([1.0 if stop_requested else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item() > 0:
            if stop_requested:  # this worker saw the signal itself (not only through the all-reduce)
                open(os.path.join(run_dir, f"signalled.rank{rank}"), "w").close()
            if rank == 0:
                with open(marker, "w") as f:
                    json.dump({"next_step": step}, f)
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(PREEMPTED_EXIT_CODE)
        if start == 0 and step == pause_at:  # hold until the test sends SIGUSR1
            if held_since is None:
                held_since = time.monotonic()
                open(os.path.join(run_dir, f"holding.rank{rank}"), "w").close()
            if time.monotonic() - held_since > 60:
                raise SystemExit(f"rank {rank}: no SIGUSR1 within 60 s of holding at step {step}")
            time.sleep(0.1)
            continue
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        total += value
        step += 1

    if rank == 0:
        result = {
            "config": config, "overrides": overrides, "world_size": world, "resumed_from": start,
            "steps": step, "mean_step_sum": total.item() / max(step - start, 1),
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        }
        with open(os.path.join(run_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
