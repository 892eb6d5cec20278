"""``fastdecode serve``: an OpenAI-compatible HTTP server with continuous batching on the engine.

    protocol.py    OpenAI request checks (-> engine requests) and response bodies; plain Python
    scheduler.py   the scheduler thread: owns the Engine and its ContinuousBatcher (engine/batching.py)
    app.py         the FastAPI app: /v1/completions, /v1/chat/completions (SSE streaming or whole), /v1/models,
                   /health; OpenAI error JSON
    server.py      uvicorn in the foreground (``serve``) or a background thread (``start_in_thread``)

FastAPI and uvicorn are the optional extra ``fastdecode[serve]``: nothing here imports them at module level
except ``app.py`` inside ``create_app``, so ``import fastdecode`` and the other commands work without them.
"""
