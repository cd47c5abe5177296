"""Weight-only INT8 weights, as the GEMMs read them: each output channel's values rounded to int8 against one fp32
scale, its largest magnitude / 127 (symmetric, no zero point: TensorRT-LLM's int8 weight-only, vLLM's W8A16 by
channel). Activations stay in the model's dtype; each backend's linear dequantizes as it reads. And the values that
FP8, GPTQ and AWQ checkpoints' weights encode (dequantize_fp8, dequantize_gptq, dequantize_awq). And the INT8 KV
cache's values (quantize_kv, dequantize_kv)."""
from dataclasses import dataclass

import torch

PANEL = 16                  # output columns per panel of the compiled CPU GEMM (kernels/cpu/linear.cpp)


@dataclass
class Int8Weight:
    data: torch.Tensor      # [out, in] int8, or panels [out / PANEL, in, PANEL] (prepared for the compiled CPU GEMM)
    scale: torch.Tensor     # [out] fp32: w[n, k] ~= data[n, k] * scale[n]

    @property
    def shape(self) -> torch.Size:
        if self.data.dim() == 3:
            return torch.Size((self.data.shape[0] * PANEL, self.data.shape[1]))
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in dtype."""
        data = self.data if self.data.dim() == 2 else self.data.transpose(1, 2).reshape(self.shape)
        return (data.float() * self.scale[:, None]).to(dtype)

    def panels(self) -> "Int8Weight":
        """The same weight in column panels: data.view(out / 16, 16, in).transpose(1, 2)."""
        out_dim, in_dim = self.shape
        return Int8Weight(self.data.view(out_dim // PANEL, PANEL, in_dim).transpose(1, 2).contiguous(), self.scale)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Semantics: scale = |weight|.amax(dim=1) / 127 (rows of zeros: scale 1); data = round(weight / scale) in int8,
    computed in fp32. weight [out, in] -> Int8Weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(data, scale)


KV_INT8_MAX = 127


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Semantics: floor(x * (1 / scale) + 0.5), clamped to [-127, 127], computed in fp32 (1 / scale rounded to fp32
    once): x [..] (K or V as the model computed them) -> its INT8 cache values [..] int8. TensorRT-LLM's
    kv_cache_scaling_factor: what the cache holds times `scale` is the value."""
    inv = torch.tensor(1 / scale, dtype=torch.float32, device=x.device)
    return torch.floor(x.float() * inv + 0.5).clamp_(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)


def dequantize_kv(values: torch.Tensor, scale: float) -> torch.Tensor:
    """Semantics: values * scale in fp32 (an INT8 cache's values [..] -> the K or V they stand for)."""
    return values.float() * torch.tensor(scale, dtype=torch.float32, device=values.device)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Semantics: weight.float() * scale, the scale one for the tensor ([] or [1]), one a row ([rows, 1]), or one a
    block of block[0] x block[1] ([ceil(rows / block[0]), ceil(cols / block[1])], the last ones partial): an FP8
    checkpoint's weight [rows, cols] (float8_e4m3fn) as the fp32 values it encodes."""
    if weight.dim() != 2:
        raise ValueError(f"a weight of shape {list(weight.shape)}: 2-D FP8 weights only")
    w, scale = weight.float(), scale.float()
    rows, cols = w.shape
    if scale.numel() == 1:
        return w * scale.reshape(())
    if tuple(scale.shape) == (rows, 1):
        return w * scale
    if block is not None and tuple(scale.shape) == (-(-rows // block[0]), -(-cols // block[1])):
        return w * scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    raise ValueError(f"a scale of shape {list(scale.shape)} for a weight of shape {[rows, cols]}"
                     + (f" in blocks of {list(block)}" if block else "") + " (one per tensor, row or block)")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # AutoAWQ's order of the 8 nibbles of an int32 (nibble i: column
                                              # 8m + AWQ_ORDER[i])


def unpack_int(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Semantics: each int32 of packed [..., M] holds 32 / bits unsigned values, value i in bits [bits * i,
    bits * (i + 1)), for position order[i] of its run (default i): -> [..., M * 32 / bits] int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)     # [..., M, per_word]
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, zero_offset: int) -> torch.Tensor:
    """Semantics: q = qweight's values along its rows ([in / (32 / bits), out] -> [in, out]), zeros = qzeros'
    along its columns + zero_offset (1 in GPTQ's first format, which stores zero - 1); w[n, k] =
    scales[g_idx[k], n] * (q[k, n] - zeros[g_idx[k], n]): a GPTQ checkpoint's weight [out, in] in fp32 (g_idx:
    each input channel's group, in act order or not)."""
    q = unpack_int(qweight.T.contiguous(), bits).T                              # [in, out]
    zeros = unpack_int(qzeros, bits) + zero_offset                              # [groups, out]
    g = g_idx.long()
    return (scales.float()[g] * (q - zeros[g]).float()).T.contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """Semantics: q = qweight's values along its columns in AWQ_ORDER ([in, out / 8] -> [in, out]), zeros the
    same of qzeros [groups, out / 8]; w[n, k] = scales[k // group_size, n] * (q[k, n] - zeros[k // group_size, n]):
    an AWQ (GEMM layout) checkpoint's weight [out, in] in fp32."""
    q, zeros = unpack_int(qweight, 4, AWQ_ORDER), unpack_int(qzeros, 4, AWQ_ORDER)
    g = torch.arange(q.shape[0]) // group_size
    return (scales.float()[g] * (q - zeros[g]).float()).T.contiguous()
