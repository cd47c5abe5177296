"""The serving engine: imports and runs without Triton server. Its names load on first use, so that a process that
needs only a light part of it (the text models' tokenizer) does not import torch."""
__all__ = ["LLMEngine", "StepOutput", "RequestError", "SamplingParams", "LoraRequest"]


def __getattr__(name: str):
    if name in ("LLMEngine", "StepOutput"):
        from backend.core import engine
        return getattr(engine, name)
    if name in ("RequestError", "SamplingParams"):
        from backend.core import request
        return getattr(request, name)
    if name == "LoraRequest":
        from backend.lora.request import LoraRequest
        return LoraRequest
    raise AttributeError(f"module 'backend' has no attribute {name!r}")
