"""What a Hugging Face model directory holds: the model's shape (config.json, `ModelConfig`) and which safetensors
file holds each weight. The model (backend/model/) and the adapters (backend/lora/) both read it."""
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from safetensors import safe_open

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}   # config -> ours
LAYER_TYPES = ("full_attention", "sliding_attention")
QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")       # biases on q, k and v (unless qkv_bias: false)


READ_QUANTIZATION = ("fp8 (e4m3, weight_block_size or per-tensor scales, weight_scale_inv)",
                     "compressed-tensors float-quantized (8-bit float weights: tensor, channel or block scales)",
                     "gptq (2, 4 or 8 bits, any group size, act order, formats gptq and gptq_v2)",
                     "awq (4 bits, version gemm, zero point)")


@dataclass(frozen=True, slots=True)
class WeightStorage:
    """How a quantized checkpoint stores each quantized linear weight X (a weight stored as `X.weight` in a float
    dtype is read as it is: the modules a checkpoint leaves unquantized):
    - "fp8": `X.weight` in float8_e4m3fn beside a float32 scale, `X.weight_scale_inv` (quant_method fp8, DeepSeek-V3
      and Qwen3-FP8's layout) or `X.weight_scale` (compressed-tensors), of shape [] or [1] (per tensor), [rows, 1]
      (per channel) or [ceil(rows / block[0]), ceil(cols / block[1])] (per block); the weight is fp8 x scale.
      `X.input_scale` (a static activation scale) is read and not applied: activations stay in the served dtype
      (weight-only, as vLLM serves FP8 where a GPU has no FP8 math).
    - "gptq" / "awq": `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`), no `X.weight`: integers packed in
      int32 with a scale and a zero point per group of input channels (kernels/quant.dequantize_gptq, _awq)."""
    method: str                               # "fp8", "gptq" or "awq"
    scale_suffix: str = ""                    # fp8: "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None = None      # fp8: the block shape, where scales are per block
    bits: int = 0                             # gptq, awq: bits a value
    group_size: int = 0                       # gptq, awq: input channels a group (-1: one group; GPTQ's g_idx,
                                              # where it has one, says each channel's)
    zero_offset: int = 0                      # gptq: 1 in its first format, which stores each zero point - 1
    kv_scales: bool = False                   # compressed-tensors' kv_cache_scheme: each layer's FP8 KV cache
                                              # scales, `self_attn.k_scale` and `v_scale` (kv_cache_dtype fp8)

    @property
    def packed(self) -> bool:
        return self.method in ("gptq", "awq")


def weight_storage(hf: dict) -> WeightStorage | None:
    """config.json's quantization_config as WeightStorage: None for an unquantized checkpoint; a ValueError naming
    what is not read (its quant_method, format or scheme) and what is."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config: fmt {quant['fmt']!r} is not read (e4m3 only)")
        block = quant.get("weight_block_size")
        return WeightStorage("fp8", "weight_scale_inv", tuple(block) if block else None)
    if method == "compressed-tensors":
        return compressed_tensors_storage(quant)
    if method == "gptq":
        if quant.get("bits") not in (2, 4, 8):
            raise ValueError(f"quantization_config: gptq bits {quant.get('bits')} is not read (2, 4 or 8)")
        checkpoint_format = quant.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config: gptq checkpoint_format {checkpoint_format!r} is not read "
                             "(gptq, gptq_v2)")
        return WeightStorage("gptq", bits=quant["bits"], group_size=quant.get("group_size", 128),
                             zero_offset=int(checkpoint_format == "gptq"))
    if method == "awq":
        scheme = (quant.get("bits", quant.get("w_bit")), quant.get("version", "gemm").lower(),
                  quant.get("zero_point", True))
        if scheme != (4, "gemm", True):
            raise ValueError(f"quantization_config: awq bits, version, zero_point {scheme} is not read "
                             "(4, gemm, true)")
        return WeightStorage("awq", bits=4, group_size=quant.get("group_size", quant.get("q_group_size", 128)))
    raise ValueError(f"quantization_config: quant_method {method!r} is not read; read: {'; '.join(READ_QUANTIZATION)}"
                     "; else unquantized weights (bfloat16, float16, float32)")


def compressed_tensors_storage(quant: dict) -> WeightStorage:
    """compressed-tensors' float-quantized format: 8-bit float weights, symmetric, static, one block shape; an FP8
    KV cache's scales per layer (kv_cache_scheme: float, 8 bits, per tensor)."""
    for name in ("sparsity_config", "transform_config"):
        if quant.get(name):
            raise ValueError(f"quantization_config: compressed-tensors {name} is not read")
    kv = quant.get("kv_cache_scheme")
    if kv:
        scheme = (kv.get("type"), kv.get("num_bits"), kv.get("strategy", "tensor"))
        if scheme != ("float", 8, "tensor") or not kv.get("symmetric", True) or kv.get("dynamic"):
            raise ValueError(f"quantization_config: compressed-tensors kv_cache_scheme {scheme} is not read (8-bit "
                             "float, symmetric, static, a scale per tensor: k_scale and v_scale)")
    if quant.get("format") != "float-quantized":
        raise ValueError(f"quantization_config: compressed-tensors format {quant.get('format')!r} is not read; "
                         f"read: {'; '.join(READ_QUANTIZATION)}")
    blocks = set()
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if scheme[:2] != ("float", 8) or scheme[2] not in ("tensor", "channel", "block") \
                or not weights.get("symmetric", True):
            raise ValueError(f"quantization_config: config_groups.{name}.weights {scheme} is not read (8-bit "
                             "float, symmetric, per tensor, channel or block)")
        if weights.get("dynamic"):
            raise ValueError(f"quantization_config: config_groups.{name}.weights dynamic is not read")
        blocks.add(tuple(weights["block_structure"]) if scheme[2] == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"quantization_config: config_groups of different block shapes {sorted(map(str, blocks))}"
                         " are not read")
    return WeightStorage("fp8", "weight_scale", blocks.pop() if blocks else None, kv_scales=bool(kv))


def refuse_unread(hf: dict) -> None:
    """Fields of config.json that change the model's math and that this server does not read: refused at start,
    by name, rather than served as another model."""
    weight_storage(hf)
    if hf.get("attention_bias") and hf.get("architectures", ["?"])[0] not in QKV_BIAS:
        raise ValueError("attention_bias: true (biases on q, k, v and o_proj) is not read; only Qwen2's q, k, v "
                         "biases are")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias: true (biases on gate_proj, up_proj and down_proj) is not read")
    for name in ("hidden_act", "hidden_activation"):
        if hf.get(name) is not None and hf[name] not in ACTIVATIONS:
            raise ValueError(f"{name} {hf[name]!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    unknown = set(hf.get("layer_types") or ()) - set(LAYER_TYPES)
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if (hf.get("pretraining_tp") or 1) != 1:
        raise ValueError(f"pretraining_tp {hf['pretraining_tp']} is not read (1 only)")


def layer_windows(hf: dict, window: int | None) -> tuple | None:
    """Each layer's sliding window where config.json's layer_types says which layers slide (Qwen2 and Qwen3 with
    use_sliding_window: the layers from max_window_layers on); None where every layer has `window`."""
    types = hf.get("layer_types")
    if window is None or not types or len(set(types)) == 1:
        return None
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None                 # RoPE scaling with its rope_type (backend/model/rope.py), or None
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    qk_norm: bool = False                     # RMSNorm over each head of q and k before RoPE (Qwen3)
    fused_projections: bool = False           # qkv_proj and gate_up_proj fused in the checkpoint, and so in its
                                              # adapters (Phi-3): modules 0 (attn_qkv) and 5 (mlp_h_to_4h, gate and
                                              # up) have no q, k, v or up module beside them
    layer_windows: tuple | None = None        # each layer's sliding window (None: it sees everything), where layers
                                              # differ (Gemma 3); else sliding_window for every layer
    local_rope_theta: float | None = None     # the RoPE base of the sliding-window layers, where theirs differs
    sandwich_norms: bool = False              # RMSNorm on the attention's and the MLP's outputs too (Gemma)
    norm_offset: float = 0.0                  # added to every norm weight at load (Gemma scales by 1 + w)
    hidden_act: str = "silu"                  # the gated MLP's: "silu" or "gelu_pytorch_tanh"
    embedding_scale: float = 1.0              # the embeddings times this (Gemma: sqrt(hidden))
    attention_scale: float | None = None      # the scores' scale where it is not head_dim ** -0.5 (Gemma)
    attn_logit_softcap: float | None = None   # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_logit_softcap: float | None = None  # the logits alike (Gemma 2)
    rotary_dim: int | None = None             # RoPE over this many of a head's channels where not all (Phi-4-mini:
                                              # partial_rotary_factor 0.75): see rotary_order
    num_experts: int = 0                      # routed experts of a mixture-of-experts layer (0: a dense model)
    num_experts_per_tok: int = 0              # experts each token is routed to (top k)
    moe_intermediate_size: int = 0            # each expert's gated MLP width
    norm_topk_prob: bool = False              # the top k routing weights renormalized to sum to 1 (Mixtral: always)
    moe_layers: tuple[bool, ...] = ()         # which layers are mixtures of experts (the others: a dense MLP)
    shared_expert: bool = False               # a dense MLP (intermediate_size) beside the experts, its output scaled
                                              # by sigmoid(shared_expert_gate . x) (Qwen2-MoE)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts "
                             f"{self.num_experts}]")

    def is_moe(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def has_dense_mlp(self, layer: int) -> bool:
        """Layer `layer` has a dense gated MLP (its own, or the shared expert beside its experts): the projections
        gate_up and down that modules 5, 6 and 7 adapt."""
        return not self.is_moe(layer) or self.shared_expert

    @property
    def any_dense_mlp(self) -> bool:
        """Some layer has a dense gated MLP (has_dense_mlp): without one (Mixtral, Qwen3-30B-A3B) modules 5-7 adapt
        nothing and no slot holds them."""
        return not self.moe_layers or not all(self.moe_layers) or self.shared_expert

    def shard(self, tp_size: int) -> "ModelConfig":
        """One tensor-parallel rank's share: its attention heads, KV heads and MLP columns (hidden and vocab whole).
        With fewer KV heads than ranks each KV head is replicated on tp_size / num_kv_heads ranks, as vLLM does."""
        if tp_size == 1:
            return self
        for name, count in (("num_attention_heads", self.num_heads), ("intermediate_size", self.intermediate_size),
                            ("moe_intermediate_size", self.moe_intermediate_size)):
            if count % tp_size:
                raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {name} {count}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp_size} and the model's num_key_value_heads "
                             f"{self.num_kv_heads}: neither divides the other")
        return replace(self, num_heads=self.num_heads // tp_size, num_kv_heads=self.kv_head_part(tp_size, 0)[2],
                       intermediate_size=self.intermediate_size // tp_size,
                       moe_intermediate_size=self.moe_intermediate_size // tp_size)

    def kv_head_part(self, tp_size: int, rank: int) -> tuple[int, int, int]:
        """(parts, index, heads): the KV heads split into `parts` equal parts, of which `rank` holds part `index`
        of `heads` heads: its own share, or (fewer KV heads than ranks) the one head its query heads read."""
        parts = min(tp_size, self.num_kv_heads)
        return parts, rank * parts // tp_size, self.num_kv_heads // parts

    def rotary_order(self) -> list[int] | None:
        """Where RoPE turns part of each head: the checkpoint's channel each of our head's channels holds, such that
        our kernels' pairs (j, j + head_dim / 2) are the checkpoint's rotary pairs (i, i + rotary_dim / 2) first and
        its pass-through channels, paired with each other (turned by angle 0), after: [rotary first half, pass
        first half, rotary second half, pass second half]. q and k are both reordered (their rows in the weights and
        in adapters' B), so every score q . k is the checkpoint's. None: RoPE over the whole head."""
        if self.rotary_dim is None:
            return None
        rotary = self.rotary_dim // 2
        passing = (self.head_dim - self.rotary_dim) // 2
        return [*range(rotary), *range(self.rotary_dim, self.rotary_dim + passing),
                *range(rotary, self.rotary_dim), *range(self.rotary_dim + passing, self.head_dim)]

    def qk_row_order(self, num_q_rows: int, num_k_rows: int, num_rows: int) -> list[int] | None:
        """The order of a tensor's rows that are q heads (the first num_q_rows), then k heads (num_k_rows), then
        others (v): each head's by rotary_order, the others as they are. None: no reordering."""
        order = self.rotary_order()
        if order is None:
            return None
        head = self.head_dim
        return [start + h * head + c for start, count in ((0, num_q_rows), (num_q_rows, num_k_rows))
                for h in range(count // head) for c in order] + list(range(num_q_rows + num_k_rows, num_rows))

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it sees the whole context."""
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_hf(json.loads(path.read_text()))

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        refuse_unread(hf)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
            return gemma(cls, hf, rope)
        if arch in MOE_ARCHITECTURES:
            return mixture_of_experts(cls, hf)
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type          # Phi-3's first name for it
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) \
            if arch == "Phi3ForCausalLM" else 1.0      # (transformers' other families here turn every channel)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rotary_dim = int(head_dim * rotary) if rotary != 1.0 else None
        if rotary_dim is not None and (rotary_dim % 2 or not 0 < rotary_dim < head_dim or head_dim % 2):
            raise ValueError(f"partial_rotary_factor {rotary}: {rotary_dim} rotary channels of a head of {head_dim} "
                             "(an even count below it is needed)")
        eos = hf.get("eos_token_id")
        use_window = hf.get("use_sliding_window", arch in ("MistralForCausalLM", "Phi3ForCausalLM"))
        if rope_type in ("yarn", "longrope") and "original_max_position_embeddings" in hf:     # (Phi-3: beside it)
            rope.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope | {"rope_type": rope_type} if rope_type != "default" else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(arch in QKV_BIAS and hf.get("qkv_bias", True)) or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            fused_projections=arch == "Phi3ForCausalLM",
            sliding_window=hf.get("sliding_window") if use_window else None,
            layer_windows=layer_windows(hf, hf.get("sliding_window") if use_window else None),
            hidden_act=ACTIVATIONS[hf.get("hidden_act") or "silu"],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            rotary_dim=rotary_dim,
        )



def gemma(cls, hf: dict, rope: dict) -> "ModelConfig":
    """Gemma 2 and Gemma 3's text model: Llama's fields (from_hf) and their own: sliding-window layers beside global
    ones (layer_types: every other layer for Gemma 2, five to one for Gemma 3), norms after attention and MLP,
    weights used as 1 + w, GELU-tanh, embeddings times sqrt(hidden), query_pre_attn_scalar. Gemma 2: the attention
    scores and the final logits soft-capped, one RoPE for every layer. Gemma 3: a RoPE base of their own for the
    sliding-window layers (rope_local_base_freq, or rope_parameters by layer type), Q and K head norms as Qwen3's."""
    arch = hf["architectures"][0]
    if arch == "Gemma2ForCausalLM":
        rope = rope if "full_attention" not in rope else rope["full_attention"]
        rope = {"full_attention": rope, "sliding_attention": rope}
    else:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(name) is not None:
                raise ValueError(f"{name} {hf[name]} is not supported on Gemma 3 (Gemma 2's soft-capping)")
    full, local = (rope.get("full_attention"), rope.get("sliding_attention")) if "full_attention" in rope else (
        rope | {"rope_theta": rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))},
        {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"sliding-window layers' rope_type {local['rope_type']!r} is not supported (default only)")
    pattern = hf.get("sliding_window_pattern", 2 if arch == "Gemma2ForCausalLM" else 6)
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(hf["num_hidden_layers"])]
    base = cls.from_hf(hf | {"architectures": ["LlamaForCausalLM"], "rope_parameters": full, "rope_scaling": None,
                             "use_sliding_window": False, "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
    return replace(base, architecture=arch, qk_norm=arch == "Gemma3ForCausalLM", sandwich_norms=True, norm_offset=1.0,
                   layer_windows=tuple(hf.get("sliding_window") if kind == "sliding_attention" else None
                                       for kind in layer_types),
                   local_rope_theta=float(local.get("rope_theta", 10_000.0)) if local is not full else None,
                   hidden_act=ACTIVATIONS[hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"],
                   embedding_scale=hf["hidden_size"] ** 0.5,
                   attention_scale=hf.get("query_pre_attn_scalar", hf.get("head_dim", 256)) ** -0.5,
                   attn_logit_softcap=hf.get("attn_logit_softcapping"),
                   final_logit_softcap=hf.get("final_logit_softcapping"))

def mixture_of_experts(cls, hf: dict) -> "ModelConfig":
    """Qwen3-MoE, Qwen2-MoE and Mixtral: Qwen3's, Qwen2's and Mistral's attention (from_hf) with a mixture of
    experts for the MLP: a router (softmax over the experts in fp32, the top k kept), and the k experts' gated MLPs
    summed by their weights. Qwen's layers are mixtures where `mlp_only_layers` and `decoder_sparse_step` say so,
    the others dense; Qwen2-MoE adds a gated shared expert to each mixture. Mixtral renormalizes the top k weights
    always, Qwen where norm_topk_prob says so."""
    arch = hf["architectures"][0]
    num_layers = hf["num_hidden_layers"]
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if arch == "MixtralForCausalLM":
        moe_layers, expert_size, renormalize = (True,) * num_layers, hf["intermediate_size"], True
    else:
        dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
        moe_layers = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        expert_size, renormalize = hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False))
    shared = arch == "Qwen2MoeForCausalLM" and bool(hf.get("shared_expert_intermediate_size"))
    dense_size = hf["intermediate_size"]
    if shared:
        if not all(moe_layers) and hf["shared_expert_intermediate_size"] != dense_size:
            raise ValueError(f"Qwen2-MoE with dense layers (mlp_only_layers, decoder_sparse_step) of intermediate_size "
                             f"{dense_size} beside shared experts of {hf['shared_expert_intermediate_size']} is not "
                             "supported (one dense MLP width per model)")
        dense_size = hf["shared_expert_intermediate_size"]
    if not num_experts or not any(moe_layers):
        raise ValueError(f"{arch} with no mixture-of-experts layer (num_experts {num_experts})")
    like = {"Qwen3MoeForCausalLM": "Qwen3ForCausalLM", "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
            "MixtralForCausalLM": "MistralForCausalLM"}[arch]
    base = cls.from_hf(hf | {"architectures": [like], "intermediate_size": dense_size})
    return replace(base, architecture=arch, num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                   moe_intermediate_size=expert_size, norm_topk_prob=renormalize, moe_layers=moe_layers,
                   shared_expert=shared)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    key_files = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            key_files |= {key: path for key in f.keys()}
    return key_files


class CheckpointReader:
    """A model directory's tensors by name, over its safetensors files (each opened once), as safetensors slices
    (get_shape, and indexing that reads only what it selects); a quantized checkpoint's weight (WeightStorage) as a
    DequantizedSlice of the fp32 values it encodes, or, for the formats named in `keep`, as a PackedSlice of the
    weight kept as stored: "int4", a 4-bit GPTQ or AWQ weight whose groups are runs of 32s of input channels;
    "fp8", an FP8 weight whose scales are one a tensor, a row, or a block of whole groups of 32s."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.key_files = checkpoint_files(self.model_dir)
        config = self.model_dir / "config.json"
        self.storage = weight_storage(json.loads(config.read_text())) if config.is_file() else None
        self.handles: dict[Path, object] = {}
        self.keep: tuple[str, ...] = ()

    def __contains__(self, key: str) -> bool:
        return key in self.key_files or self._is_packed(key)

    def get_slice(self, key: str):
        if self._is_packed(key):
            return self._packed(key)
        raw = self._file(key).get_slice(key)
        if not raw.get_dtype().startswith("F8"):
            return raw
        if self.storage is None or self.storage.method != "fp8" or raw.get_dtype() != "F8_E4M3":
            raise ValueError(f"checkpoint tensor {key} is {raw.get_dtype()} without a quantization_config that "
                             "says how to read it")
        from kernels.quant import dequantize_fp8, fp8_weight  # (torch on first use: the OpenAI API reads configs only)
        scale = self._tensor(key.removesuffix("weight") + self.storage.scale_suffix)
        if "fp8" in self.keep and len(raw.get_shape()) == 2:
            try:
                kept = fp8_weight(raw[:], scale, self.storage.block)
            except ValueError as err:
                raise ValueError(f"checkpoint tensor {key}: {err}") from None
            if kept is not None:
                return PackedSlice(key, kept)
        return DequantizedSlice(key, raw.get_shape(), lambda: dequantize_fp8(raw[:], scale, self.storage.block))

    def read_keys(self, keys) -> set[str]:
        """The checkpoint keys read with these: a quantized weight's scales, zeros, groups (and an FP8 weight's static
        input scale) besides."""
        keys = set(keys)
        if self.storage is None:
            return keys
        parts = ("qweight", "qzeros", "scales", "g_idx") if self.storage.packed else (self.storage.scale_suffix,
                                                                                        "input_scale")
        quantized = [key for key in keys if key.endswith(".weight") and key in self and (
            self.storage.packed or self._file(key).get_slice(key).get_dtype().startswith("F8"))]
        besides = {key.removesuffix("weight") + part for key in quantized for part in parts}
        return keys | (besides & self.key_files.keys())

    def close(self) -> None:
        self.handles.clear()

    def _is_packed(self, key: str) -> bool:
        """Whether GPTQ's or AWQ's packed weight stands in place of `key` (X.weight)."""
        return (self.storage is not None and self.storage.packed and key.endswith(".weight")
                and key not in self.key_files and key.removesuffix("weight") + "qweight" in self.key_files)

    def _packed(self, key: str) -> "DequantizedSlice | PackedSlice":
        base = key.removesuffix("weight")
        import torch

        from kernels.quant import dequantize_awq, dequantize_gptq, int4_from_awq, int4_from_gptq
        storage = self.storage
        qweight, scales = self._file(base + "qweight").get_slice(base + "qweight"), self._tensor(base + "scales")
        in_dim, out_dim = qweight.get_shape()
        if storage.method == "gptq":
            in_dim = in_dim * 32 // storage.bits
            g_idx = self._tensor(base + "g_idx") if base + "g_idx" in self.key_files else \
                torch.arange(in_dim) // (storage.group_size if storage.group_size > 0 else in_dim)
            kept = "int4" in self.keep and storage.bits == 4 and int4_from_gptq(
                qweight[:], self._tensor(base + "qzeros"), scales, g_idx, storage.zero_offset)

            def values():
                return dequantize_gptq(qweight[:], self._tensor(base + "qzeros"), scales, g_idx, storage.bits,
                                       storage.zero_offset)
        else:
            out_dim = out_dim * 32 // storage.bits
            group_size = storage.group_size if storage.group_size > 0 else in_dim
            kept = "int4" in self.keep and int4_from_awq(qweight[:], self._tensor(base + "qzeros"), scales, group_size)

            def values():
                return dequantize_awq(qweight[:], self._tensor(base + "qzeros"), scales, group_size)
        if kept:
            if list(kept.shape) != [out_dim, in_dim]:
                raise ValueError(f"checkpoint tensor {key}: packed as {list(kept.shape)}, its scales say "
                                 f"{[out_dim, in_dim]}")
            return PackedSlice(key, kept)
        return DequantizedSlice(key, [out_dim, in_dim], values)

    def _tensor(self, key: str):
        return self._file(key).get_tensor(key)

    def _file(self, key: str):
        if key not in self.key_files:
            raise KeyError(f"checkpoint in {self.model_dir} has no tensor {key}")
        path = self.key_files[key]
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt")
        return self.handles[path]


class DequantizedSlice:
    """A quantized weight read as a safetensors slice is: get_shape() and indexing, over the fp32 values it encodes
    (`values()`: kernels/quant's dequantize_*), computed once, when first indexed."""

    def __init__(self, key: str, shape: list[int], values: Callable[[], object]):
        self.key, self.shape, self.values = key, shape, values
        self.dequantized = None

    def get_shape(self) -> list[int]:
        return self.shape

    def __getitem__(self, index):
        if self.dequantized is None:
            try:
                self.dequantized = self.values()
            except ValueError as err:
                raise ValueError(f"checkpoint tensor {self.key}: {err}") from None
        return self.dequantized[index]


class PackedSlice:
    """A weight kept as stored (kernels.quant.GroupedWeight: INT4, FP8) read as a safetensors slice is:
    get_shape(), and indexing by output rows (`[lo:hi]`), input channels (`[:, lo:hi]`: whole groups, or else the
    fp32 values of the slice, as a DequantizedSlice gives them) or whole (`[:]`)."""

    def __init__(self, key: str, weight):
        self.key, self.weight = key, weight

    def get_shape(self) -> list[int]:
        return list(self.weight.shape)

    def __getitem__(self, index):
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        if not (isinstance(rows, slice) and isinstance(columns, slice) and rows.step is None and columns.step is None
                and (rows == slice(None) or columns == slice(None))):
            raise ValueError(f"checkpoint tensor {self.key}: a packed weight is sliced by rows or by columns, "
                             f"not by {index}")
        if rows != slice(None):
            return self.weight.output_rows(rows)
        if columns == slice(None):
            return self.weight
        lo, hi = columns.start or 0, self.weight.shape[1] if columns.stop is None else columns.stop
        try:
            return self.weight.input_slice(lo, hi)
        except ValueError:                                  # (a share that cuts a group)
            import torch
            return self.weight.dequantize(torch.float32)[:, lo:hi]
