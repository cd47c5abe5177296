"""The CPU serving ops: the compiled kernels (kernels/cpu_ext.py) for attention, which reads the paged cache in place
(decode rows one by one, prompt rows in tiles), and the elementwise work of a layer fused into single passes, LoRA
shrink + expand of all a projection's bands in one call (kernels/lora/executor.CpuLoraExecutor); fp32 and quantized
GEMMs over weights in column panels (cpu_ext.panel_linear, and with a LoRA after it cpu_ext.linear_lora, whose GEMM
prefetches the adapter rows), bf16 GEMMs on AMX tiles over weights in pair panels where the CPU has them
(cpu_ext.amx_linear; quantized weights' too from TILE_ROWS rows), other dtypes on weights prepacked for oneDNN; a
mixture of experts as the torch reference runs it (one GEMM pair per expert with tokens), its expert LoRA compiled
(cpu_ext.expert_lora_add: the rows group by group, each row's matrices read in place)."""
import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.cpu_ext import add_rms_norm, rotary_and_cache, silu_and_mul
from kernels.lora.executor import CpuLoraExecutor as lora_executor
from kernels.metadata import AttentionMetadata
from kernels.quant import QUANTIZED_WEIGHTS, GroupedWeight, Int4Weight, Int8Weight, QuantizedWeight
from kernels import reference

__all__ = ["prepare_weight", "linear", "add_rms_norm", "silu_and_mul", "rotary_and_cache", "paged_attention",
           "fused_moe", "slot_lora", "lora_executor"]


PANEL = 16                  # output columns per panel of cpu_ext.pack_linear
TILE_ROWS = 8               # from this many bf16 rows a quantized weight meets the AMX tiles where the CPU has them
                            # (cpu_ext.amx_dequantized_linear, its panels dequantized group by group in the cache):
                            # 3072 x 576 on a 2-core Xeon, INT8 / INT4 / FP8, 32 rows: 141 / 153 / 204 us against
                            # the panel GEMM's 530 / 660 / 744; 4 rows: 113 / 122 / 151 against 90 / 100 / 111.
                            # Without the tiles every row count stays on the panel GEMM: dequantizing for oneDNN
                            # took longer at each one measured (3072 x 576 INT8, 64 / 128 / 1024 rows: 1.87 / 3.04 /
                            # 17.9 ms against 1.03 / 2.06 / 15.1; AMX left out of both)


def _packable(dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 everywhere and bf16 where the CPU has bf16 support (AVX-512 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepare_weight(name: str, w: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """A projection or the LM head in the layout its GEMM reads fastest: fp32 in column panels (whose kernel
    prefetches ahead: a 32-row decode step's GEMMs ~20% faster than oneDNN's, one row ~30%, prompt chunks within
    ~10%), in bf16 panels where every value is a bf16's (a bf16 checkpoint served in fp32: half the bytes, the same
    values, widened as the GEMM loads them; bf16 weights beside dtype auto's fp32 arrive in bf16), bf16 in pair
    panels where the CPU has AMX-BF16 tiles and K is a multiple of 32 (cpu_ext.amx_linear: the 30 layers' GEMMs of
    SmolLM2 in 9.5 ms a decode step against oneDNN's 15.5, 10.7 against 17 at 32 rows, even at 512; Xeon, 2 cores),
    else in bf16 panels too (the panel GEMM's fp32 FMAs: without AMX the 30 layers and the LM head in 5.8 ms a
    decode row against oneDNN's 9.4 on AVX-512 BF16, 164 against 187 ms at 128 rows); INT8, INT4 and FP8 in column
    panels too. Embeddings, norms and biases stay as they are. The loader prepares each weight as it completes
    (load_weights' `prepare`), so that a bf16 checkpoint served in fp32 never lies in memory in fp32 but one weight
    at a time."""
    if not (name.endswith("_proj") or name == "lm_head"):
        return w
    if isinstance(w, QUANTIZED_WEIGHTS):
        return w.panels() if w.shape[0] % PANEL == 0 else w
    if w.dim() != 2 or w.shape[0] % PANEL:
        return torch.ops.mkldnn._reorder_linear_weight(w) if _packable(w.dtype) else w
    if w.dtype == torch.bfloat16:
        return cpu_ext.pack_pairs(w) if w.shape[1] % 32 == 0 and _amx_beside_bf16() else _bf16_panels(w)
    if w.dtype == torch.float32:
        narrow = w.to(torch.bfloat16)
        return _bf16_panels(narrow) if torch.equal(narrow.float(), w) else cpu_ext.pack_linear(w)
    return w


def _amx_beside_bf16() -> bool:
    """AMX tiles, and bf16 activations for them (ATen at AVX-512: backend.device's dtype auto, held at fp32 by
    ATEN_CPU_CAPABILITY=avx2, whose fp32 rows would unpack pair panels at every call)."""
    return cpu_ext.amx_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _bf16_panels(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> the panel GEMM's bf16 panels [N / PANEL, K, PANEL]."""
    return w.view(w.shape[0] // PANEL, PANEL, w.shape[1]).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, weight, bias), weight [out_dim, in_dim] as prepare_weight left it (INT8, INT4, FP8:
    the values it encodes, converted as the panel GEMM reads them; from TILE_ROWS rows of bf16 those values
    rounded into bf16 for the AMX tiles where they run; an INT4 weight in act order reads x's channels gathered
    into its order); bf16 pair panels on AMX tiles for bf16 x, unpacked for other dtypes; a weight of another
    dtype than x's that no panel holds (out_dim not a multiple of PANEL) converted into x's at each call."""
    if isinstance(weight, QUANTIZED_WEIGHTS):
        if isinstance(weight, GroupedWeight):
            x, weight = weight.in_stored_order(x)
        if weight.data.dim() == 2:
            return reference.linear(x, weight, bias)
        if x.dtype == torch.bfloat16 and x.shape[0] >= TILE_ROWS and weight.shape[1] % 32 == 0 \
                and cpu_ext.amx_available():
            return cpu_ext.amx_dequantized_linear(x, weight, None if bias is None else bias.float())
        bias32 = None if bias is None else bias.float()
        if isinstance(weight, Int8Weight):
            return cpu_ext.int8_panel_linear(x, weight.data, weight.scale, bias32)
        if isinstance(weight, Int4Weight):
            return cpu_ext.int4_panel_linear(x, weight.data, weight.scale, weight.zero, weight.group_size, bias32)
        return cpu_ext.fp8_panel_linear(x, weight.data, weight.scale, weight.group_size, bias32)
    if weight.dim() == 4:
        if x.dtype != torch.bfloat16:
            return F.linear(x, cpu_ext.unpack_pairs(weight).to(x.dtype), None if bias is None else bias.to(x.dtype))
        return cpu_ext.amx_linear(x, weight, None if bias is None else bias.float())
    if weight.dim() == 3:
        return cpu_ext.panel_linear(x, weight, None if bias is None else bias.float())
    if weight.is_mkldnn:
        if weight.dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        weight = weight.to_dense()
    return F.linear(x, weight.to(x.dtype), bias)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Semantics: kernels.reference.paged_attention, read in place from the paged cache by cpu_ext.paged_attention:
    a decode row alone, a prompt chunk's rows in tiles of consecutive rows; an INT8 cache's values converted as
    they load, K's scale folded into the scores' and V's applied to the sums."""
    return cpu_ext.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_starts, scale,
                                   sliding_window, softcap, kv_scales)


def add_group_lora(out: torch.Tensor, x: torch.Tensor, rows_per_x: int, row_slots: torch.Tensor,
                   row_experts: torch.Tensor, num_experts: int, a: torch.Tensor, bs: list[torch.Tensor],
                   slot_ranks: torch.Tensor | None = None) -> None:
    """Semantics: kernels.reference.add_group_lora; with widths of 8s by cpu_ext.expert_lora_add (in place, group
    by group, each row's matrices read up to its slot's rank), others by the reference."""
    widths = [x.shape[1], a.shape[1], *(b.shape[1] for b in bs)]
    if any(w % 8 for w in widths) or a.shape[1] % (8 * len(bs)):
        reference.add_group_lora(out, x, rows_per_x, row_slots, row_experts, num_experts, a, bs, slot_ranks)
        return
    if slot_ranks is None:
        slot_ranks = torch.full((a.shape[0] // num_experts,), a.shape[1] // len(bs), dtype=torch.long)
    cpu_ext.expert_lora_add(out, x.contiguous(), rows_per_x, row_slots.int().contiguous(),
                            row_experts.long().contiguous(), num_experts, a, bs, slot_ranks.contiguous())


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, lora=None) -> torch.Tensor:
    """Semantics: kernels.reference.fused_moe."""
    return reference.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, lora, add_group_lora)


def slot_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """Semantics: kernels.reference.slot_lora."""
    reference.slot_lora(x, a, b, token_slots, out, add_group_lora)
