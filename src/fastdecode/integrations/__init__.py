"""fastdecode's ops in other frameworks' models, applied to loaded model instances.

* ``fastdecode.integrations.transformers``: ``apply(model, norm=True, act=True, linear=None)`` for a Hugging Face
  transformers Llama, Mistral, Qwen2 or Qwen3 model (``docs/integrations.md``).

Nothing here is imported by ``import fastdecode``, and the framework itself is imported only by the functions
that need it: fastdecode works without transformers installed.
"""
