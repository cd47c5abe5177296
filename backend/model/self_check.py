"""The start-up self-check of the Triton kernels on the serving device (`kernel_self_check`), before the model
reports ready: each op family once at the served model's shapes against the torch reference on the same device.
A family whose kernel fails to compile, raises at launch or disagrees beyond its dtype's tolerance is served by the
torch reference instead (`apply_fallbacks`), and the failure is logged with its shapes and its max error; `strict`
refuses to start. The graphs' check lives in backend/model/graph_check.py.

    attention: a decode step (contexts of 1 token, three pages and a half, 70 tokens), and the same beside a prompt
               chunk of 37 tokens after 20 cached ones, over the configured page size, GQA group and head dim, at
               every split count (on a GPU: every variant eager steps compile, warmed before the first request);
               with kv_cache_dtype int8 or fp8, over such a cache too
    lora:      every projection of layer 0 with three adapters (max_lora_rank, a quarter of it with DoRA
               magnitudes, and a half of it with a fused qkv module: its A once), on every module, and base rows,
               for 8 tokens (a decode step) and 100 (a prompt chunk), each split-K as planned
    lora_overlap: the decode step's projections through the LoRA executor's linear with LoRA beside the GEMM (graph
               steps run it so: a side stream, the fp32 delta, the merge); where it fails, graphs run LoRA after
               each GEMM
    lora_fold: the same through its linear_deferred, its delta added as the op after the GEMM adds it; where it
               fails, graphs merge each product after its GEMM
    fused:     add_rms_norm, silu_and_mul, rotary_and_cache (the cache writes compared too; with kv_cache_dtype
               int8 or fp8, into such a cache as well, as attention reads one then)
    moe:       a mixture's experts (fused_moe) at the served expert count, top k and widths, for a decode step's rows
               and a prompt chunk's (16- and 64-row blocks), some experts idle; bare and with adapters on the
               experts (two slots at max_lora_rank, base rows beside); a router's LoRA (slot_lora)
    gemm:      with weight_dtype int8, int4 or fp8, its GEMM (linear) at every dense projection's shape, for 16 rows
               and 100 (lm_head_dtype's at the LM head's), the weight prepared as served (FP8 on sm_89+: e4m3 dots);
               where it fails, the torch reference dequantizes each weight per GEMM and LoRA runs after it
"""
import logging
from copy import copy
from dataclasses import dataclass, replace

import torch

from backend.device import on
from backend.lora.format import LoraAdapter, module_shape
from backend.lora.slots import DeviceSlots, proj_shape
from backend.model.checkpoint import ModelConfig
from kernels import reference
from kernels.dispatch import KernelBackend
from kernels.metadata import AttentionMetadata, ExpertLora
from kernels.quant import FP8_MAX, KV_CACHE_TYPES, KV_INT8_MAX, quantize_kv, quantize_weight

FAMILIES = {"attention": ("paged_attention",), "lora": ("lora_executor",), "lora_overlap": (), "lora_fold": (),
            "fused": ("add_rms_norm", "silu_and_mul", "rotary_and_cache"), "moe": ("fused_moe", "slot_lora"),
            "gemm": ("linear",)}
SPLITS = (1, 2, 4, 8, 16)                    # every split count kernels/paged_attention.num_kv_splits can choose
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 8e-2}   # of |error| / (1 + |reference|)
log = logging.getLogger(__name__)


@dataclass
class Check:
    family: str
    what: str                                 # the case and its shapes
    error: str | None = None                  # None: passed; else the exception or the max error


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()


def compare(family: str, what: str, run, dtype: torch.dtype) -> Check:
    """run() -> [(kernel's result, reference's)]: a Check that names the case and, if it failed, why."""
    try:
        pairs = run()
        worst = max(max_error(got, want) for got, want in pairs)
    except Exception as err:                   # a compile or launch failure is a result too
        return Check(family, what, f"{type(err).__name__}: {str(err)[:300]}")
    if not worst <= TOLERANCE[dtype]:          # NaN fails too
        return Check(family, what, f"max error {worst:.3g} > {TOLERANCE[dtype]:g}")
    return Check(family, what)


def attention_checks(ops, cfg: ModelConfig, dtype, device, block_size: int,
                     kv_cache_dtype: str = "auto") -> list[Check]:
    """A decode step and a step with a prompt chunk (the two tile shapes), each at every split count a step can
    choose (kv_cache_dtype int8, fp8: over such a cache too): on a GPU this also compiles every variant eager steps
    will use, before the first request."""
    g = torch.Generator().manual_seed(0)
    cases = {"decode": ([1, 3 * block_size + block_size // 2, 70], [1, 1, 1]),
             "prompt chunk": ([1, 3 * block_size + block_size // 2, 70, 57], [1, 1, 1, 37])}
    checks = []
    for case, (seq_lens, query_lens) in cases.items():
        q, k_cache, v_cache, meta = attention_inputs(cfg, dtype, device, block_size, seq_lens, query_lens, g)
        scale = cfg.head_dim ** -0.5
        cap = cfg.attn_logit_softcap
        caches = {"": (k_cache, v_cache, None)}
        if kv_cache_dtype != "auto":
            cache_dtype = KV_CACHE_TYPES[kv_cache_dtype]
            largest = KV_INT8_MAX if cache_dtype == torch.int8 else FP8_MAX
            scales = tuple(c.float().abs().max().item() / largest for c in (k_cache, v_cache))
            caches[f", {kv_cache_dtype} cache"] = (quantize_kv(k_cache, scales[0], cache_dtype),
                                                   quantize_kv(v_cache, scales[1], cache_dtype), scales)
        for tag, (k, v, kv_scales) in caches.items():
            want = reference.paged_attention(q.float(), k if kv_scales else k.float(), v if kv_scales else v.float(),
                                             meta, scale, softcap=cap, kv_scales=kv_scales)
            what = (f"{case}: contexts {seq_lens}, queries {query_lens}, page {block_size}, {cfg.num_heads} heads "
                    f"on {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, {dtype}"
                    + (f", softcap {cap}" if cap else "") + tag)
            for splits in (None,) + SPLITS:
                run = lambda: [(ops.paged_attention(q, k, v, meta, scale, softcap=cap, num_splits=splits,  # noqa
                                                    kv_scales=kv_scales), want)]
                checks.append(compare("attention", what + (f", {splits} splits" if splits else ""), run, dtype))
    return checks


def attention_inputs(cfg: ModelConfig, dtype, device, block_size: int, seq_lens: list[int], query_lens: list[int],
                     g: torch.Generator):
    """Random queries and caches, each sequence's pages scattered through the pool."""
    blocks = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    order = torch.randperm(sum(blocks), generator=g).tolist()
    for s, n in enumerate(blocks):
        table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (cfg.num_kv_heads, sum(blocks), block_size, cfg.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(2))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], cfg.num_heads, cfg.head_dim, generator=g).to(device, dtype)
    ints = lambda values: torch.tensor(values, dtype=torch.int32, device=device)   # noqa: E731
    meta = AttentionMetadata(ints(starts), ints(seq_lens), table.to(device), ints([]), starts, seq_lens,
                             max(query_lens), max(seq_lens))
    return q, k_cache, v_cache, meta


def random_adapter(cfg: ModelConfig, rank: int, dtype, g: torch.Generator, fused_qkv: bool = False,
                   dora: bool = False) -> LoraAdapter:
    """Layer 0 of an adapter on every module the model has: q, k, v apart, or (fused_qkv) one attn_qkv module;
    with DoRA magnitudes (0.5-1.5) when asked."""
    weights, magnitudes = {}, {}
    for module_id in ((0,) if fused_qkv else (1, 2, 3)) + ((4, 5, 6, 7) if cfg.any_dense_mlp else (4,)):
        in_dim, out_dim = module_shape(cfg, module_id)
        weights[(0, module_id)] = ((torch.randn(rank, in_dim, generator=g) * in_dim ** -0.5).to(dtype),
                                   (torch.randn(out_dim, rank, generator=g) * rank ** -0.5).to(dtype))
        if dora:
            magnitudes[(0, module_id)] = (0.5 + torch.rand(out_dim, generator=g)).to(dtype)
    return LoraAdapter(weights, magnitudes=magnitudes)


def lora_checks(ops, cfg: ModelConfig, dtype, lora_dtype, device, max_rank: int) -> list[Check]:
    """Every projection adapters reach, with three adapters (max_lora_rank; a quarter of it, DoRA; half of it with a
    fused qkv module) beside base rows, for a decode step and a prompt chunk."""
    g = torch.Generator().manual_seed(1)
    slots = DeviceSlots(replace(cfg, num_layers=1), 3, max_rank, lora_dtype, device, ops.lora)
    ranks = [max_rank, max(1, max_rank // 4), max(1, max_rank // 2)]
    for slot, rank in enumerate(ranks):
        slots.load(slot, random_adapter(cfg, rank, lora_dtype, g, fused_qkv=slot == 2, dora=slot == 1))
    slots.copies.wait([0, 1, 2])
    checks = []
    for token_slots in ([-1, -1, 0, 0, 0, 1, 1, 2], [-1] * 10 + [0] * 40 + [1] * 30 + [2] * 20):
        segments = ops.lora.segments(token_slots, dtype)
        segments.use({name: t.to(device) for name, t in segments.tensors.items()})
        for proj in slots.adapts:
            in_dim, out_dim = proj_shape(cfg, proj)
            x = torch.randn(len(token_slots), in_dim, generator=g).to(device, dtype)
            base = torch.randn(len(token_slots), out_dim, generator=g).to(device, dtype)

            def run(x=x, base=base, proj=proj):
                got, want = base.clone(), base.float()
                ops.lora_for(segments, slots).apply(x, slots.projections[0][proj], got)
                reference.lora_apply(x.float(), float_projection(slots, proj), segments, want)
                return [(got, want)]
            what = (f"{proj} {in_dim}->{out_dim}, ranks {ranks} (the second DoRA, the last a fused qkv), "
                    f"{len(token_slots)} tokens, {dtype} on {lora_dtype} adapters")
            checks.append(compare("lora", what, run, dtype))
            if ops.lora.overlap and len(token_slots) < 16:
                checks.append(compare("lora_overlap", f"{what}, beside the base GEMM",
                                      overlap_check(ops, slots, proj, token_slots, x, out_dim, False), dtype))
            if ops.lora.fold and len(token_slots) < 16:
                checks.append(compare("lora_fold", f"{what}, beside the base GEMM, left for the next op",
                                      overlap_check(ops, slots, proj, token_slots, x, out_dim, True), dtype))
    return checks


def overlap_check(ops, slots: DeviceSlots, proj: str, token_slots: list[int], x: torch.Tensor, out_dim: int,
                  fold: bool):
    """The LoRA executor's linear with LoRA beside the GEMM (a side stream, the fp32 delta, the merge) against the
    reference; fold: its linear_deferred's output with its delta added instead."""
    def run():
        segments = ops.lora.segments(token_slots, x.dtype)
        segments.use({name: t.to(x.device) for name, t in segments.tensors.items()})
        segments.overlap = True
        g = torch.Generator(device=x.device).manual_seed(3)                  # made on the device: 8B's in ms
        weight = torch.randn(out_dim, x.shape[1], generator=g, device=x.device).to(x.dtype) * x.shape[1] ** -0.5
        want = reference.linear(x.float(), weight.float(), None)
        reference.lora_apply(x.float(), float_projection(slots, proj), segments, want)
        if not fold:
            return [(ops.lora_for(segments, slots).linear(x, weight, None, 0, proj), want)]
        segments.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=x.device)
        out, delta = ops.lora_for(segments, slots).linear_deferred(x, weight, None, 0, proj)
        return [(reference.add_lora_delta(out, delta), want)]
    return run


def float_projection(slots: DeviceSlots, proj: str):
    """Layer 0's projection with its slots in fp32, for the reference."""
    p = copy(slots.projections[0][proj])
    p.bands = [copy(band) for band in p.bands]
    for band in p.bands:
        band.a, band.b = band.a.float(), band.b.float()
    return p


def fused_checks(ops, cfg: ModelConfig, dtype, device, block_size: int, kv_cache_dtype: str = "auto") -> list[Check]:
    g = torch.Generator().manual_seed(2)
    n, hidden, inter, d = 13, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)      # noqa: E731
    x, residual, weight, gate_up = rand(n, hidden), rand(n, hidden), rand(hidden), rand(n, 2 * inter)

    def norm():
        got, got_sum = ops.add_rms_norm(x, residual.clone(), weight, cfg.rms_norm_eps)
        want, want_sum = reference.add_rms_norm(x.float(), residual.float(), weight.float(), cfg.rms_norm_eps)
        return [(got, want), (got_sum, want_sum)]

    def rotary(kv_scales=None):
        """kv_scales: into an INT8 or FP8 cache, compared with the reference's quantization of the kernel's own
        rounding of K and V, a step of it (an FP8 code's, in order of value) weighing half the tolerance (a rounding
        tie may go either way)."""
        q, k, v = rand(n, cfg.num_heads, d), rand(n, cfg.num_kv_heads, d), rand(n, cfg.num_kv_heads, d)
        positions = torch.randint(0, 4096, (n,), generator=g, dtype=torch.int32).to(device)
        cos_sin = torch.randn(4096, d, generator=g).to(device)
        slot_mapping = torch.randperm(2 * block_size, generator=g)[:n].to(device, torch.int32)
        slot_mapping[0] = -1                                      # a graph's padding row: the kernel writes nothing
        shape = (cfg.num_kv_heads, 2, block_size, d)
        cache_dtype = dtype if kv_scales is None else KV_CACHE_TYPES[kv_cache_dtype]
        caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
        want_caches = [torch.zeros(shape, device=device, dtype=caches[0].dtype if kv_scales else torch.float32)
                       for _ in range(2)]
        got = ops.rotary_and_cache(q, k, v, positions, cos_sin, *caches, slot_mapping, kv_scales=kv_scales)
        want_q, want_k = reference.rotary(q[1:].float(), k[1:].float(), positions[1:], cos_sin)
        if kv_scales is None:
            reference.write_kv_cache(want_k, v[1:].float(), *want_caches, slot_mapping[1:])
            return [(got[1:], want_q), (caches[0], want_caches[0]), (caches[1], want_caches[1])]
        reference.write_kv_cache(want_k.to(dtype), v[1:], *want_caches, slot_mapping[1:], kv_scales)
        step = TOLERANCE[dtype] / 2
        return [(got[1:], want_q)] + [(code_order(c) * step, code_order(w) * step) for c, w in zip(caches, want_caches)]

    tag = f"{n} tokens, hidden {hidden}, intermediate {inter}, {dtype}"
    checks = [compare("fused", f"add_rms_norm {tag}", norm, dtype),
              compare("fused", f"silu_and_mul {tag}", lambda: [(ops.silu_and_mul(gate_up),
                                                                reference.silu_and_mul(gate_up.float()))], dtype),
              compare("fused", f"rotary_and_cache {tag}, head dim {d}", rotary, dtype)]
    if kv_cache_dtype != "auto":
        checks.append(compare("fused", f"rotary_and_cache {tag}, head dim {d}, {kv_cache_dtype} cache",
                              lambda: rotary((0.05, 0.03)), dtype))
    return checks


def code_order(values: torch.Tensor) -> torch.Tensor:
    """A quantized cache's values as fp32 numbers one apart between neighbours: INT8's as they are, FP8's e4m3 bits
    as +-(bits & 0x7F) (e4m3's codes rise with their magnitudes)."""
    if values.dtype == torch.int8:
        return values.float()
    return (values & 0x7F).float() * (1 - 2 * (values >> 7).float())


def moe_checks(ops, cfg: ModelConfig, dtype, lora_dtype, device, max_rank: int) -> list[Check]:
    """fused_moe at the served experts' shapes (this rank's share), bare and with adapters on the experts (two slots
    at max_lora_rank, base rows beside), and slot_lora (the router's LoRA); none where the model has no mixture."""
    if not cfg.num_experts:
        return []
    g = torch.Generator().manual_seed(3)
    num, hidden, inter, top_k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    rand = lambda *shape, to=dtype: (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device, to)  # noqa: E731
    w_gate_up, w_down = rand(num, 2 * inter, hidden), rand(num, hidden, inter)
    slots, r = 2, max_rank
    lora_stacks = (rand(slots * num, 2 * r, hidden, to=lora_dtype), rand(2, slots * num, inter, r, to=lora_dtype),
                   rand(slots * num, r, inter, to=lora_dtype), rand(slots * num, hidden, r, to=lora_dtype))

    def run(num_tokens: int, adapted: bool):
        x = rand(num_tokens, hidden) * hidden ** 0.5
        scores = torch.randn(num_tokens, num, generator=g)
        scores[:, num // 2:] -= 100.0                         # half the experts idle
        weights, ids = torch.topk(scores.softmax(-1), min(top_k, num // 2 or 1), dim=-1)
        weights, ids = weights.to(device), ids.to(device)
        token_slots = (torch.arange(num_tokens, dtype=torch.int32) % (slots + 1) - 1).to(device)   # -1, 0, 1, ...
        lora = ExpertLora(token_slots.repeat_interleave(ids.shape[1]), *lora_stacks, slots) if adapted else None
        float_lora = lora and ExpertLora(lora.row_slots, *(t.float() for t in lora_stacks), slots)
        pairs = [(ops.fused_moe(x, w_gate_up, w_down, weights, ids, lora),
                  reference.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids, float_lora))]
        if adapted:
            a, b = rand(slots, r, hidden, to=lora_dtype), rand(slots, num, r, to=lora_dtype)   # a router's LoRA
            out = rand(num_tokens, num)
            want = out.float()
            reference.slot_lora(x.float(), a.float(), b.float(), token_slots, want)
            ops.slot_lora(x, a, b, token_slots, out)
            pairs.append((out, want))
        return pairs

    tag = f"{num} experts, top {top_k}, hidden {hidden}, intermediate {inter}, {dtype}"
    return [compare("moe", f"fused_moe {n} tokens{' with adapters' if adapted else ''}, {tag}",
                    lambda n=n, adapted=adapted: run(n, adapted), dtype)
            for n in (8, 100) for adapted in (False, True)]


LM_HEAD_CHECK_COLUMNS = 4096   # of the vocabulary: the LM head's GEMM differs from a projection's only in columns


def gemm_checks(ops, cfg: ModelConfig, dtype, device, weight_dtype: str, lm_head_dtype: str = "auto") -> list[Check]:
    """The weight-only GEMM of weight_dtype (ops.linear over kernels.quant's Int8Weight, Int4Weight or Fp8Weight) at
    each dense projection's shape, and lm_head_dtype's at the LM head's (its first LM_HEAD_CHECK_COLUMNS), for a
    decode step's 16 rows and a prompt chunk's 100."""
    g = torch.Generator().manual_seed(3)
    shapes = []
    if weight_dtype != "auto":
        projs = ("qkv", "o", "gate_up", "down") if cfg.any_dense_mlp else ("qkv", "o")
        shapes += [(proj, *proj_shape(cfg, proj), weight_dtype) for proj in projs]
    if lm_head_dtype != "auto":
        shapes.append(("lm_head", cfg.hidden_size, min(cfg.vocab_size, LM_HEAD_CHECK_COLUMNS), lm_head_dtype))
    checks = []
    for proj, in_dim, out_dim, kind in shapes:
        weight = quantize_weight(torch.randn(out_dim, in_dim, generator=g) * in_dim ** -0.5, kind).to(device)
        weight = ops.prepare_weight("lm_head" if proj == "lm_head" else f"layers.0.{proj}_proj", weight)
        dots = ", e4m3 dots" if getattr(weight, "fp8_activations", False) else ""
        for num_rows in (16, 100):
            x = torch.randn(num_rows, in_dim, generator=g).to(device, dtype)

            def run(x=x, weight=weight):
                return [(ops.linear(x, weight, None), reference.linear(x.float(), weight, None))]
            what = f"{kind} {proj} {in_dim}->{out_dim}, {num_rows} rows, {dtype}{dots}"
            checks.append(compare("gemm", what, run, dtype))
    return checks


def check_kernels(ops, cfg: ModelConfig, dtype, lora_dtype, device, block_size: int,
                  max_rank: int, weight_dtype: str = "auto", kv_cache_dtype: str = "auto",
                  lm_head_dtype: str = "auto") -> list[Check]:
    """Every op family of the Triton kernels once, at the served shapes (cfg: this rank's share)."""
    with torch.inference_mode():
        return (attention_checks(ops, cfg, dtype, device, block_size, kv_cache_dtype) +
                lora_checks(ops, cfg, dtype, lora_dtype, device, max_rank) +
                fused_checks(ops, cfg, dtype, device, block_size, kv_cache_dtype) +
                moe_checks(ops, cfg, dtype, lora_dtype, device, max_rank) +
                gemm_checks(ops, cfg, dtype, device, weight_dtype, lm_head_dtype))


def apply_fallbacks(ops: KernelBackend, families: set[str]) -> None:
    """Serve these op families with the torch reference instead of the Triton kernels."""
    ops.fall_back({name for family in families for name in FAMILIES[family]})
    if "lora_fold" in families:                        # each product merged after its GEMM
        ops.lora = ops.lora.merged()
    if families & {"lora", "lora_overlap", "gemm"}:
        ops.lora = ops.lora.in_turn()


def check_kernels_or_fall_back(runner, config) -> dict[str, str]:
    """The runner's Triton op families checked at its shapes; each that fails is served by the torch reference from
    now on (strict: refuses to start). Returns the families that fell back, with why."""
    with on(runner.device):
        checks = check_kernels(runner.ops, runner.shard_config, runner.dtype, runner.lora_dtype, runner.device,
                               runner.block_size, config.lora.max_lora_rank, config.weight_dtype,
                               config.kv_cache_dtype, config.lm_head_dtype)
    fallbacks: dict[str, str] = {}
    for check in checks:
        if check.error is None:
            continue
        if config.kernel_self_check == "strict":
            raise RuntimeError(f"kernel_self_check strict: the {check.family} kernel failed on {runner.device} "
                               f"({check.what}): {check.error}")
        fallbacks.setdefault(check.family, f"{check.what}: {check.error}")
    for family, why in fallbacks.items():
        log.warning("kernel self-check on %s: the Triton %s kernel failed (%s); serving %s with the torch "
                    "reference", runner.device, family, why, family)
    apply_fallbacks(runner.ops, set(fallbacks))
    log.info("kernel self-check on %s: %d of %d cases passed", runner.device,
             sum(c.error is None for c in checks), len(checks))
    return fallbacks
