"""fastdecode: fast LLM decoding on NVIDIA Hopper GPUs."""

__version__ = "0.1.0"

from fastdecode.ops import *  # noqa: F401,F403
