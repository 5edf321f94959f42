"""Where the critic's weights come from, asked by the trainer's build, its warm start and vapo-plan:
critic.warm_start (a value model: an HF directory, or a Megatron critic checkpoint whose config is
in its hf/), else model.critic_hf_path (a trunk, its head fresh unless it has one), else the
policy's model.hf_path (its trunk, a fresh head). Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_providers.files import megatron_model_dir
from vapo_megatron.config.schema import Config


@dataclass(frozen=True)
class CriticStart:
    path: Path       # the directory named by `key`
    key: str         # the setting that named it
    megatron: bool   # a Megatron dist checkpoint (loaded into the built model), else HF safetensors

    @property
    def config_dir(self) -> Path:
        """The directory holding its config.json."""
        return self.path / "hf" if self.megatron else self.path


def critic_start(cfg: Config) -> CriticStart:
    if cfg.critic.warm_start:
        path = Path(cfg.critic.warm_start)
        return CriticStart(path, "critic.warm_start", megatron_model_dir(path))
    if cfg.model.critic_hf_path:
        return CriticStart(Path(cfg.model.critic_hf_path), "model.critic_hf_path", False)
    return CriticStart(Path(cfg.model.hf_path), "model.hf_path", False)


__all__ = ["CriticStart", "critic_start"]
