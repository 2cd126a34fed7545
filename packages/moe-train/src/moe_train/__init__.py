"""moe-train: MoE models, configs, data, the trainer and the pretraining CLI."""

from moe_train.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, RouterConfig, TrainConfig
from moe_train.config_io import build_config
from moe_train.model import Transformer, count_params, flops_per_token
from moe_train.presets import PRESETS, get_preset

__version__ = "0.27.27"

__all__ = ["Config", "ConfigError", "ModelConfig", "RouterConfig", "DataConfig", "TrainConfig", "ParallelConfig",
           "build_config", "get_preset", "PRESETS", "Transformer", "count_params", "flops_per_token"]
