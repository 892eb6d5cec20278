"""Model definitions (nn.Module) written against ``fastdecode.ops``; no Triton here."""

from fastdecode.models.config import PRESETS, ModelConfig, RopeScaling
from fastdecode.models.llama import Fp8Linear, Int4Linear, Linear, Transformer

__all__ = ["PRESETS", "Fp8Linear", "Int4Linear", "Linear", "ModelConfig", "RopeScaling", "Transformer"]
