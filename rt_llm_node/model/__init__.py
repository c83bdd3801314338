"""HF-layout checkpoints: configuration, validated loading, synthetic test models."""

from rt_llm_node.model.checkpoint import Checkpoint
from rt_llm_node.model.checkpoint import load_checkpoint
from rt_llm_node.model.checkpoint import load_model
from rt_llm_node.model.checkpoint import load_tokenizer
from rt_llm_node.model.config import ModelConfig
from rt_llm_node.model.config import RopeConfig
from rt_llm_node.model.errors import CheckpointError

__all__ = ['Checkpoint', 'CheckpointError', 'ModelConfig', 'RopeConfig', 'load_checkpoint',
           'load_model', 'load_tokenizer']
