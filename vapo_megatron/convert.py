"""vapo-convert: HF <-> Megatron checkpoints for the supported model families.

    vapo-convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--critic] [--tp N --pp N] [--dtype D] [--overwrite]
    vapo-convert mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--tp N --pp N] [--max-shard-mb M] [--overwrite]
    torchrun --nproc-per-node 4 -m vapo_megatron.convert mcore-to-hf --ckpt ... --out ... --tp 2 --pp 2

Both directions stream, with the model on the meta device (vapo_megatron/weights/convert.py;
docs/conversion.md has the measured memory). Trainer checkpoints (run_dir/checkpoints/iter_N/actor)
convert like those hf-to-mcore writes; --ckpt iter_N converts its actor.

--out must be new or empty; --overwrite replaces a directory that the same direction of
vapo-convert wrote, never anything else (nor the input). Bad input: one line, exit 2
(VAPO_VERBOSE=1 adds the traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_SHARD_MB = 512  # weights/hf_write.py's DEFAULT_SHARD_BYTES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vapo-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF model directory -> Megatron dist checkpoint")
    a.add_argument("--hf", type=Path, required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    a.add_argument("--critic", action="store_true", help="build the critic (trunk + value head from score.*, "
                   "or freshly initialized when the HF model has none)")
    a.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="parameter dtype (default: the config's dtype)")
    b = sub.add_parser("mcore-to-hf",
                       help="Megatron checkpoint written by hf-to-mcore (or the trainer) -> HF directory")
    b.add_argument("--ckpt", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--max-shard-mb", type=int, default=DEFAULT_SHARD_MB,
                   help="largest safetensors shard, MiB; also bounds the tensors held in memory at once")
    for q in (a, b):
        q.add_argument("--tp", type=int, default=1, help="tensor parallel size of this run (ranks = tp * pp * dp)")
        q.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this run")
        q.add_argument("--overwrite", action="store_true", help="replace --out when it is an earlier output of this "
                       "same direction of vapo-convert (nothing else is ever replaced)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from vapo_megatron.config.cli import answer
    from vapo_megatron.config.quiet import device_startup, quiet_startup

    quiet_startup()
    args = parse_args(argv)

    def convert() -> None:
        if args.cmd == "mcore-to-hf" and args.max_shard_mb < 1:  # --tp and --pp: the layout check
            from vapo_megatron.config import ConfigError

            raise ConfigError(f"--max-shard-mb={args.max_shard_mb} must be >= 1 (MiB per safetensors shard)")
        device_startup()
        from vapo_megatron.mcore import parallel
        from vapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf

        try:
            if args.cmd == "hf-to-mcore":
                path = hf_to_mcore(args.hf, args.out, critic=args.critic, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                   overwrite=args.overwrite)
            else:
                path = mcore_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, max_shard_bytes=args.max_shard_mb << 20,
                                   overwrite=args.overwrite)
            if parallel.is_rank0():
                print(f"wrote {path}")
        finally:
            parallel.destroy()

    return answer("vapo-convert", convert, bad_input=bad_input_errors())


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What a wrong path, model or flag raises (the rest would be a bug)."""
    from model_providers import HFConfigError
    from vapo_megatron.checkpoint.dist_io import CheckpointError
    from vapo_megatron.config import ConfigError
    from vapo_megatron.runtime.atomic import TargetRefused
    from vapo_megatron.weights.hf_read import HFCheckpointError

    return CheckpointError, HFCheckpointError, HFConfigError, ConfigError, TargetRefused


if __name__ == "__main__":
    sys.exit(main())
