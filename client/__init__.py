"""gRPC streaming client for the lora_llm Triton model (TensorRT-LLM backend tensors)."""
from client.grpc_client import LoraLLMClient, build_inputs

__all__ = ["LoraLLMClient", "build_inputs"]
