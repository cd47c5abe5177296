"""A request's adapter as one value, checked once where it enters (the TensorRT-LLM inputs, the engine's API) and
passed whole to the cache and the scheduler."""
from dataclasses import dataclass, replace

from backend.core.request import RequestError
from backend.lora.format import LoraAdapter


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """An adapter by task id: cached already, or brought by this request as TensorRT-LLM's lora_weights [N, R] and
    lora_config [N, 3|4] (its first request), or those parsed already (off the engine loop: `parsed`)."""
    task_id: int
    weights: object | None = None             # lora_weights as sent (numpy or torch)
    config: object | None = None              # lora_config as sent
    adapter: LoraAdapter | None = None        # the weights parsed (LoraCache.parse)
    name: str | None = None                   # what the client calls it (request parameter lora_name): metrics

    def __post_init__(self):
        if (self.weights is None) != (self.config is None):
            raise RequestError("lora_config" if self.config is None else "lora_weights",
                               "lora_weights and lora_config must be sent together")
        if self.adapter is not None and self.weights is not None:
            raise ValueError("a LoraRequest carries its weights as sent or parsed, not both")

    @classmethod
    def of(cls, task_id, weights=None, config=None, name: str | None = None) -> "LoraRequest | None":
        """From a request's loose inputs; None where it names no adapter."""
        if task_id is None:
            if weights is not None or config is not None:
                raise RequestError("lora_task_id", "must be set when lora_weights are sent")
            return None
        return cls(int(task_id), weights, config, name=name)

    @property
    def sent(self) -> bool:
        """It brings weights, as sent or parsed."""
        return self.weights is not None or self.adapter is not None

    def parsed(self, adapter: LoraAdapter | None) -> "LoraRequest":
        """The same request with its weights parsed (None: dropped, as the cache holds them already)."""
        return replace(self, weights=None, config=None, adapter=adapter)

    def named(self, name: str | None) -> "LoraRequest":
        return replace(self, name=name)
