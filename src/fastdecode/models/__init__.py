"""Model definitions (nn.Module) written against ``fastdecode.ops``; no Triton here."""

from fastdecode.models.config import PRESETS, ModelConfig, RopeScaling
from fastdecode.models.int4 import Int4Linear
from fastdecode.models.llama import Fp8Linear, Linear, Transformer

__all__ = ["PRESETS", "Fp8Linear", "Int4Linear", "Linear", "ModelConfig", "RopeScaling", "Transformer"]
