"""The run configuration: typed sections, loading, every check, and the rules for a resume.

    schema.py     the dataclasses: every key and its one default
    load.py       YAML + dotted overrides -> Config, with every problem collected
    checks.py     values that need nothing else
    estimators.py what each advantage estimator is (algo.estimator), as a record
    engines.py    what each rollout engine is (rollout.engine), as a record: its section, colocated or not
    critic_start.py where the critic's weights come from (critic.warm_start, model.critic_hf_path or the policy)
    layout.py     the one parallel-layout check (config, start-up, eval, convert, plan)
    preflight.py  the config against the launch and the files, before anything is built
    resume.py     run_dir/config.yaml, and what a resume may change
    reference.py  docs/config.md, the configuration reference, generated from schema.py
    cli.py        how the commands answer bad input (one message, exit 2)
    quiet.py      a quiet start-up: library noise filtered, one line on absent accelerators
    determinism.py  the environment trainer.deterministic needs, set before CUDA initialises

Pure Python: vapo-train checks a command completely before it imports torch or megatron-core.
"""

from vapo_megatron.config.load import load_config, parse_config, run_record, to_dict
from vapo_megatron.config.schema import (
                                         AlgoConfig,
                                         Config,
                                         ConfigError,
                                         DataConfig,
                                         EvalConfig,
                                         ModelConfig,
                                         OptimConfig,
                                         ParallelConfig,
                                         PartialRolloutConfig,
                                         RewardConfig,
                                         RolloutConfig,
                                         SFTConfig,
                                         SGLangConfig,
                                         SGLangHttpConfig,
                                         TrainerConfig,
                                         WandbConfig,
                                         problems_error,
)

__all__ = ["AlgoConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PartialRolloutConfig", "RewardConfig", "RolloutConfig", "SFTConfig", "SGLangConfig",
           "SGLangHttpConfig", "TrainerConfig", "WandbConfig", "load_config", "parse_config", "problems_error",
           "run_record", "to_dict"]
