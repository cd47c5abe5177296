"""Engine and adapter-cache settings: validated dataclasses, one place for every knob."""
import os
import re
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "float16", "bfloat16")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")
WEIGHT_DTYPES = ("auto", "int8", "int4", "fp8")   # weight-only, quantized at load (kernels/quant.py); auto keeps
                                                  # a checkpoint's FP8 or 4-bit GPTQ/AWQ weights as they are
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # int8: against scales calibrated at start (backend/model/calibration.py);
                                           # fp8: e4m3 against scales of 1.0 (TensorRT-LLM's default)
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def as_bool(text: str) -> bool:
    """A boolean model parameter, or its LORA_LLM_* override: "true" or "1" (any case) is on, anything else off."""
    return text.lower() in ("true", "1")


def env_flag(name: str) -> bool:
    """A boolean setting from the environment, on unless set otherwise (as_bool)."""
    return as_bool(os.environ.get(name, "true"))


@dataclass(slots=True)
class LoraCacheConfig:
    max_lora_rank: int = 64
    max_loras: int = 8                        # device slots: adapters usable in one step
    host_memory_bytes: int | str = "auto"     # host tier budget (auto: backend/lora/limits.py)
    max_adapter_bytes: int | str = "auto"     # one adapter, as stored (in dtype); auto: max_lora_rank everywhere
    prefetch_dir: str | None = None           # <dir>/<task_id>/ loaded at engine start
    dtype: str = "auto"                       # adapters as stored: the model's, or fp16 beside fp32 (device.py)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"lora_dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_lora_rank", "max_loras", "host_memory_bytes", "max_adapter_bytes"):
            value = getattr(self, name)
            if value == "auto" and name in ("host_memory_bytes", "max_adapter_bytes"):
                continue
            if isinstance(value, str) or value < 1:
                raise ValueError(f"{name} must be >= 1{' or auto' if 'bytes' in name else ''}, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    model_dir: str
    dtype: str = "auto"                       # bfloat16 on CUDA and on CPUs with native bf16, else float32 (over
                                              # bf16 weights: backend.device.projection_dtype)
    weight_dtype: str = "auto"                # the projections' weights: as the checkpoint has them (auto), or
                                              # int8 weight-only (one scale per output channel), int4 (a scale
                                              # and a zero point per group of 128 inputs) or fp8 (e4m3, a scale
                                              # per output channel), quantized at load
    kv_cache_dtype: str = "auto"              # the KV cache: as the weights (auto), or int8 or fp8 (e4m3) with a scale
                                              # for K and one for V per layer (half a bf16 cache's bytes a token)
    lm_head_dtype: str = "auto"               # the LM head: in dtype (auto, as TensorRT-LLM and vLLM leave it), or
                                              # int8, int4, fp8 as weight_dtype's (llama.cpp's output tensor type)
    max_num_seqs: int = 64                    # sequences in one step
    max_num_batched_tokens: int = 2048        # tokens (prefill chunks + decodes) in one step
    kv_block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, kv_cache_free_gpu_mem_fraction on CUDA
    kv_cache_free_gpu_mem_fraction: float = 0.9   # of the memory free after the weights and a warm-up forward
    kv_watermark: float = 0.01                # share of blocks kept free when admitting new sequences
    enable_kv_cache_reuse: bool = False       # full blocks named by content and adapter, reused across requests
    max_queue_size: int = 1024                # requests waiting to start; past it, a retryable "queue full" error
    max_words: int = 1024                     # stop words, and bad words, per request
    max_word_len: int = 64                    # tokens per stop or bad word
    max_top_log_probs: int = 20               # top alternatives a request may ask for at each token (vLLM's
                                              # max_logprobs)
    max_log_probs_per_request: int = 1 << 22  # (k + 1) x (prompt tokens scored + output tokens) x sequences: the log
                                              # probs one request may ask for
    max_beam_width: int = 8                   # beams one request may ask for (TensorRT-LLM's name; at most
                                              # max_num_seqs: a request's beams step together)
    guided_decoding_backend: str = ""         # "xgrammar": guided decoding on (needs the model's tokenizer)
    tokenizer_dir: str | None = None          # for guided decoding; default: model_dir
    guided_decoding_compile_timeout_s: float = 5.0        # a grammar's compile, past which it is refused
    guided_decoding_compile_memory_bytes: int = 512 << 20  # what a compile's worker grows by, past which it is refused
    kernel_backend: str = "auto"
    cuda_graph_mode: bool = True              # decode steps replay CUDA graphs (CUDA, Triton kernels); False: eager
    device: str = "auto"                      # auto (CUDA when available), cpu, cuda, cuda:N
    kernel_self_check: str = "auto"          # the Triton kernels checked at start (backend/model/self_check.py):
                                              # true, strict (a failure refuses to start), false; auto: on CUDA
    overlap_steps: str = field(default_factory=lambda: os.environ.get("LORA_LLM_OVERLAP_STEPS", "auto"))
                                              # launch the next step before the last one's tokens land: true,
                                              # false; auto: on CUDA (one device)
    lora_overlap: bool = field(default_factory=lambda: env_flag("LORA_LLM_LORA_OVERLAP"))
                                              # CUDA graph steps run LoRA beside the base GEMMs on a side stream
                                              # (Triton kernels); False: after each GEMM
    lora_fold: bool = field(default_factory=lambda: env_flag("LORA_LLM_LORA_FOLD"))
                                              # and leave each product for the op after its GEMM to add; False:
                                              # merged after each GEMM
    tensor_parallel_size: int = 1             # ranks the model is split over: this process and N-1 workers
    tensor_parallel_timeout_s: float = 60.0   # a collective that takes longer: a worker hangs, the engine is broken
    lora: LoraCacheConfig = field(default_factory=LoraCacheConfig)
    inject_fault_steps: tuple[int, ...] = ()  # test hook: these steps (counted from 1) fail as a broken forward would
    inject_broken_ops: tuple[str, ...] = ()   # test hook: these Triton ops raise at every call, in every process
                                              # (tensor-parallel workers too), as a kernel that cannot launch would

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.lm_head_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"lm_head_dtype must be one of {WEIGHT_DTYPES}, got {self.lm_head_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.guided_decoding_backend not in ("", "xgrammar"):
            raise ValueError(f"guided_decoding_backend must be xgrammar (or empty: off), got "
                             f"{self.guided_decoding_backend!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if not DEVICE_RE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_block_size", "kv_cache_memory_bytes",
                     "max_queue_size", "max_words", "max_word_len", "tensor_parallel_size",
                     "max_log_probs_per_request", "max_beam_width"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ValueError("kv_cache_free_gpu_mem_fraction must be in (0, 1], "
                             f"got {self.kv_cache_free_gpu_mem_fraction}")
        if self.kernel_self_check not in ("auto", "true", "strict", "false"):
            raise ValueError(f"kernel_self_check must be true, strict, false or auto, got {self.kernel_self_check!r}")
        if self.overlap_steps not in ("auto", "true", "false"):
            raise ValueError(f"overlap_steps must be true, false or auto, got {self.overlap_steps!r}")
        if self.guided_decoding_compile_timeout_s <= 0 or self.guided_decoding_compile_memory_bytes < 1:
            raise ValueError("guided_decoding_compile_timeout_s and guided_decoding_compile_memory_bytes must be > 0, "
                             f"got {self.guided_decoding_compile_timeout_s} and "
                             f"{self.guided_decoding_compile_memory_bytes}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        if self.max_top_log_probs < 0:
            raise ValueError(f"max_top_log_probs must be >= 0, got {self.max_top_log_probs}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")

    def checks_at_start(self, device_type: str) -> bool:
        """The start-up checks run on this device (kernel_self_check): true or strict anywhere, auto on CUDA."""
        return self.kernel_self_check != "false" and (self.kernel_self_check != "auto" or device_type == "cuda")


# the names Triton model parameters use (TensorRT-LLM's where they exist) -> LoraCacheConfig fields
LORA_KWARGS = {"max_lora_rank": "max_lora_rank", "max_loras": "max_loras",
               "lora_cache_host_memory_bytes": "host_memory_bytes", "lora_cache_max_adapter_size": "max_adapter_bytes",
               "lora_prefetch_dir": "prefetch_dir", "lora_dtype": "dtype"}


def split_engine_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """Engine keywords -> (EngineConfig fields, LoraCacheConfig fields)."""
    engine = {k: v for k, v in kwargs.items() if k not in LORA_KWARGS}
    lora = {LORA_KWARGS[k]: v for k, v in kwargs.items() if k in LORA_KWARGS}
    return engine, lora
