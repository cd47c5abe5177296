"""The engine core: a request's parameters and sequences, the scheduler and the KV block manager, the step
(LLMEngine) and the sampler. No server, no thread of its own: a caller adds requests and steps."""
