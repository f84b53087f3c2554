"""The run's configuration: one frozen dataclass per flag group, each field one option
(config/options.py). Each class validates its own fields; `RunConfig` holds the groups, checks
what spans them and derives what several decide. megalite/arguments.py generates the command line."""

from megalite.config.data import DataConfig
from megalite.config.model import ModelConfig, num_parameters, recompute_segments
from megalite.config.parallel import ParallelConfig, Sharding
from megalite.config.presets import MODEL_PRESETS, describe_model, model_config_from_preset
from megalite.config.run import DEFAULT_RUN_SAVE, CheckpointConfig, LoggingConfig, RunConfig
from megalite.config.train import TrainConfig

__all__ = ["DEFAULT_RUN_SAVE", "CheckpointConfig", "DataConfig", "LoggingConfig", "MODEL_PRESETS", "ModelConfig",
           "ParallelConfig", "RunConfig", "Sharding", "TrainConfig", "describe_model", "model_config_from_preset",
           "num_parameters", "recompute_segments"]
