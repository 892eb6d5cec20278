"""Decode engine: loading, tokenizer, KV cache, generate loop, sampler, CUDA-graph runner, TP, export, accuracy.

    from fastdecode.engine import Engine, load
    m = load()                                   # the embedded SmolLM2-135M-Instruct (GGUF)
    eng = Engine(m.model, m.tokenizer, max_batch=2)
    print(eng.generate("Hello", max_new_tokens=20)[0].text)
"""

from fastdecode.engine.generate import Engine, GenerationResult
from fastdecode.engine.kv_cache import KVCache
from fastdecode.engine.checkpoint.detect import default_model_path
from fastdecode.engine.checkpoint.errors import CheckpointError
from fastdecode.engine.loader import load, random_model
from fastdecode.engine.sampler import SamplingParams

__all__ = ["CheckpointError", "Engine", "GenerationResult", "KVCache", "SamplingParams", "default_model_path",
           "load", "random_model"]
