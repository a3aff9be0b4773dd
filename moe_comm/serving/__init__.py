"""Serving: tiny MoE decoder models, the DecodeEngine and its pluggable MoE comm backends.

The vLLM adapter lives in ``moe_comm.serving.vllm`` and is not imported here (it is only needed with vLLM).
"""

from .backends import (
    BACKEND_NAMES,
    DynamicAllToAll,
    FusedEP,
    MoEComm,
    PaddedAllToAll,
    SyncAllToAll,
    make_comms,
)
from .check import ReferenceMismatch, check_generation, default_rtol
from .configs import CONFIG_NAMES, ModelConfig, model_config
from .engine import DecodeEngine, Generation, Request, bucket_sizes
from .model import MoEDecoder, batched_experts
from .reference_model import ReferenceModel
from .weights import ModelWeights, build_weights

__all__ = [
    "BACKEND_NAMES",
    "CONFIG_NAMES",
    "DecodeEngine",
    "DynamicAllToAll",
    "FusedEP",
    "Generation",
    "ModelConfig",
    "ModelWeights",
    "MoEComm",
    "MoEDecoder",
    "PaddedAllToAll",
    "ReferenceMismatch",
    "ReferenceModel",
    "Request",
    "SyncAllToAll",
    "batched_experts",
    "bucket_sizes",
    "build_weights",
    "check_generation",
    "default_rtol",
    "make_comms",
    "model_config",
]
