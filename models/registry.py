"""Architecture name -> model class. The config's `arch` picks the class; nothing else branches on it."""

from __future__ import annotations

from models.base import CausalLM
from models.config import ModelConfig


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.arch in ("deepseek_v2", "deepseek_v3"):
        from models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    if cfg.arch == "llama":
        from models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise ValueError(f"no model class for architecture {cfg.arch!r}")
