"""The serving side a Triton model runs: TensorRT-LLM's tensors in and out (protocol, contract, output arrays,
responses), the engine loop and its responder thread, the engine's own process and a stub's client of it, the
metrics and the heartbeat."""
