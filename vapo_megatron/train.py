"""vapo-train: the one entry point of the VAPO trainer, for every launcher.

    vapo-train --config configs/demo_cpu.yaml trainer.total_steps=5
    torchrun --nproc-per-node 2 -m vapo_megatron.train --config FILE [dotted.key=value ...]

The algorithm is in docs/algorithm.md, the loop in vapo_megatron/trainer/trainer.py, every
config key in docs/config.md (`vapo-train --print-config --config FILE [overrides]` prints the
resolved configuration and exits). Exit codes: 0 done, 2 bad configuration, data or
checkpoint (one line says which and where), 3 stopped with a checkpoint (SIGUSR1, SIGTERM, Ctrl-C
or the job's deadline; only SIGUSR1 and the deadline ask for a requeue), 4 too many non-finite
optimizer steps in a row, 5 a checkpoint could not be written (full disk; one line says where and
how much space was free, the previous checkpoint is intact), 130 a second Ctrl-C (no checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from vapo_megatron.config import Config, ConfigError, parse_config, problems_error
from vapo_megatron.config.cli import BAD_INPUT_EXIT_CODE, INTERRUPTED_EXIT_CODE, verbose
from vapo_megatron.config.estimators import estimator_of
from vapo_megatron.config.layout import launcher_env
from vapo_megatron.config.quiet import device_startup, quiet_startup
from vapo_megatron.trainer.run_guard import RunDirLocked, die_with_launcher, remove_unused_run_dir

SAVE_FAILED_EXIT_CODE = 5  # a checkpoint could not be written (full disk, ...); the previous one is intact
INTERRUPTED = "interrupted: stopped without a checkpoint; the same command resumes from the last one"


def checked_config(config_path: str, overrides: list[str]) -> Config:
    """Every setting checked, against the launch and the files, before anything is built; one
    ConfigError listing every problem, the hardware's (torch's CUDA, for the settings that need it)
    among them. Runs without torch and megatron-core unless a setting needs CUDA: a command with a
    typo fails in seconds. Then the run directory's saved config."""
    from vapo_megatron.config import resume
    from vapo_megatron.config.determinism import determinism_env
    from vapo_megatron.config.preflight import hardware_problems, startup_problems

    # The Slurm job's run dir (slurm/vapo_train.sbatch) only where the file and overrides name none.
    job_run_dir = {"trainer.run_dir": os.environ["VAPO_RUN_DIR"]} if os.environ.get("VAPO_RUN_DIR") else None
    rank, world_size, _ = launcher_env()
    cfg, problems = parse_config(config_path, overrides, fallbacks=job_run_dir)
    problems += startup_problems(cfg, world_size)
    if problems:  # with the machine's (torch is imported for them only when a setting needs CUDA)
        raise problems_error(problems + hardware_problems(cfg))
    determinism_env(cfg.trainer.deterministic)  # before torch is imported, let alone CUDA initialised
    problems = hardware_problems(cfg)
    problems += model_file_problems(cfg)
    if problems:
        raise problems_error(problems)
    resume.check_resume(cfg, announce=rank == 0)  # vs. run_dir/config.yaml
    return cfg


def model_file_problems(cfg: Config) -> list[str]:
    """The policy's tokenizer, chat template and generation config, loaded once as the run will
    load them (data/model_files.py): a file that parses but does not load is one line naming it,
    before the run directory is made. transformers is imported here (as the trainer would)."""
    from vapo_megatron.data.model_files import loading_problems

    return [f"model.hf_path: {p}" for p in loading_problems(cfg.model.hf_path)]


def print_config(config_path: str, overrides: list[str]) -> int:
    """The resolved configuration as YAML (what run_dir/config.yaml would hold), built from nothing
    but the file and the overrides: no torch, no files read besides the YAML (a config for another
    machine prints here). Its value checks still apply: a bad setting is one message, exit 2."""
    import yaml

    from vapo_megatron.config import load_config, run_record

    job_run_dir = {"trainer.run_dir": os.environ["VAPO_RUN_DIR"]} if os.environ.get("VAPO_RUN_DIR") else None
    try:
        cfg = load_config(config_path, overrides, check_paths=False, fallbacks=job_run_dir)
    except ConfigError as e:
        print(f"vapo-train: configuration error: {e}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    sys.stdout.write(yaml.safe_dump(run_record(cfg), sort_keys=False))
    return 0


def finished(cfg: Config) -> bool:
    """Whether the run's newest checkpoint is whole and finished at the iterations this command asks
    for (checkpoint/complete.py); then rank 0 says so, as Trainer.run would after loading it all."""
    from vapo_megatron.checkpoint.complete import finished_at, finished_message

    total = cfg.algo.value_pretrain_steps + cfg.trainer.total_steps  # Trainer.total_iterations
    models = ("actor", "critic") if estimator_of(cfg).needs_critic else ("actor",)  # mcore/critic.py build_critic
    done = finished_at(cfg.trainer.run_dir, models)
    if done is None or done < total:
        return False
    if launcher_env()[0] == 0:
        print(finished_message(cfg.trainer.run_dir, done, cfg.trainer.total_steps, total), flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vapo-train", description=__doc__.split("\n\n")[0],
                                     epilog="The algorithm: docs/algorithm.md; every key: docs/config.md.")
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration (file + overrides + defaults) as YAML and exit; "
                             "every key: docs/config.md")
    args = parser.parse_args(argv)
    quiet_startup(loading_bars=False)  # before anything imports a library that warns (config/quiet.py)
    if args.print_config:
        return print_config(args.config, args.overrides)
    die_with_launcher()  # a worker never outlives its torchrun agent (trainer/run_guard.py)
    try:
        cfg = checked_config(args.config, args.overrides)
    except ConfigError as e:
        if verbose():
            traceback.print_exc()
        print(f"vapo-train: configuration error: {e}", file=sys.stderr)
        return BAD_INPUT_EXIT_CODE
    device_startup()
    if finished(cfg):  # a rerun of a finished run: said before any model is built or checkpoint loaded
        return 0
    from model_providers import HFConfigError
    from vapo_megatron.checkpoint.manager import CheckpointCorrupt, CheckpointMismatch, CheckpointSaveError
    from vapo_megatron.data.prompts import PromptDataError
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.update import NonFiniteError
    from vapo_megatron.sizing.plan import check_engine_share
    from vapo_megatron.sizing.step_config import predict_on_this_gpu
    from vapo_megatron.trainer.signals import StopSignals, leave_together
    from vapo_megatron.trainer.trainer import NON_FINITE_EXIT_CODE, Planner, Trainer

    stop = StopSignals().install()  # before any helper process exists
    fresh = not os.path.lexists(cfg.trainer.run_dir)  # made by this start: a refused start removes it again
    try:
        trainer = Trainer(cfg, stop, Planner(check_engine_share, predict_on_this_gpu))  # vapo-plan's models, handed in
    except (PromptDataError, ConfigError, HFConfigError, CheckpointCorrupt, CheckpointMismatch,
            OSError) as e:  # before any step
        if verbose():
            traceback.print_exc()
        kind = {PromptDataError: "data", CheckpointCorrupt: "checkpoint", CheckpointMismatch: "checkpoint"}.get(
            type(e), "file" if isinstance(e, OSError) else "configuration")
        print(f"vapo-train: {kind} error: {e}", file=sys.stderr, flush=True)
        parallel.destroy()
        if fresh and not isinstance(e, RunDirLocked) and launcher_env()[0] == 0:
            remove_unused_run_dir(cfg.trainer.run_dir)
        return BAD_INPUT_EXIT_CODE
    except KeyboardInterrupt:  # a second Ctrl-C while starting
        print(f"vapo-train: {INTERRUPTED}", file=sys.stderr, flush=True)
        parallel.destroy()
        return INTERRUPTED_EXIT_CODE
    message = ""  # printed after close(): the progress bar ends its line first
    try:
        code = trainer.run()
    except NonFiniteError as e:  # raised on every rank at the same step (the decision is collective)
        code, message = NON_FINITE_EXIT_CODE, f"numerical error: {e}"
    except CheckpointSaveError as e:  # raised on every rank together (checkpoint/manager.py)
        if verbose():
            traceback.print_exc()
        if stop.interrupted:  # a second Ctrl-C cut the save: the partial checkpoint was removed
            code, message = INTERRUPTED_EXIT_CODE, INTERRUPTED
        else:
            code, message = SAVE_FAILED_EXIT_CODE, f"checkpoint save error: {e}"
    except KeyboardInterrupt:  # a second Ctrl-C (signals.py): at once, one line, no traceback
        trainer.close()
        print(f"vapo-train: {INTERRUPTED}", file=sys.stderr, flush=True)
        parallel.destroy()
        return INTERRUPTED_EXIT_CODE
    except BaseException:
        trainer.close()
        parallel.destroy()
        raise
    leave_together()
    trainer.close()
    if message and parallel.is_rank0():
        print(f"vapo-train: {message}", file=sys.stderr, flush=True)
    parallel.destroy()
    return code

if __name__ == "__main__":
    sys.exit(main())
