"""Model definitions (nn.Module) written against ``fastdecode.ops``; no Triton here."""

from fastdecode.models.config import PRESETS, ModelConfig, RopeScaling
from fastdecode.models.llama import Linear, Transformer

__all__ = ["PRESETS", "Linear", "ModelConfig", "RopeScaling", "Transformer"]
