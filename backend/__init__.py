"""The serving engine: imports and runs without Triton server."""
from backend.engine import LLMEngine, StepOutput
from backend.request import RequestError, SamplingParams

__all__ = ["LLMEngine", "StepOutput", "RequestError", "SamplingParams"]
