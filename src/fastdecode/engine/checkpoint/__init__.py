"""Reading checkpoints: the file formats and the model assembly behind ``fastdecode.engine.loader.load``.

* ``detect``: which kind a path is (HF directory, GGUF file, preset; the embedded default model) and the
  quantisation format of a HF directory (``checkpoint_format``);
* ``safetensors_io``: safetensors files (index, headers checked for truncation, lazy slices);
* ``hf``: a HF directory opened as a ``Checkpoint`` (tensor names, FP8 / int4 storage);
* ``gguf_io``: GGUF files (checked reader, lazy tensors, llama.cpp's q / k row order) opened as a ``Checkpoint``;
* ``int4``: one reader per int4 source (GPTQ, AWQ, ``fastdecode quantize``, GGUF Q4_0 / Q4_1), each reading
  a whole weight or only a TP shard's bytes;
* ``spec``: what each model tensor is made of (``model_spec``) and the opened ``Checkpoint``;
* ``assemble``: check the names, build the model on ``meta``, read the weights (rank's shard), swap in the
  int4 modules, assign.

Nothing here imports ``engine.loader``, ``engine.tp`` or ``engine.tokenizer``.
"""

from fastdecode.engine.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
