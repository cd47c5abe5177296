"""An OpenAI-compatible API in front of the core model: completions and chat completions, adapters by name.

A process of its own beside tritonserver (scripts/launch_server.py starts and supervises it), speaking to the core
model over tritonserver's gRPC streaming API; tokenization and detokenization happen here (backend/text.py).
"""
