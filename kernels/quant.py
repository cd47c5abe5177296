"""Weight-only INT8, INT4 and FP8 weights, as the GEMMs read them. INT8: each output channel's values rounded to
int8 against one fp32 scale, its largest magnitude / 127 (symmetric, no zero point: TensorRT-LLM's int8
weight-only, vLLM's W8A16 by channel). INT4: groups of 128 input channels (64 or 32 where the width asks) of each
output channel on a scale and a zero point, values 0..15 (asymmetric, as GPTQ and AWQ store them). FP8: e4m3 values
on a scale per group of input channels (one group a row at load; an FP8 checkpoint's blocks). Activations stay in
the model's dtype; each backend's linear dequantizes as it reads. And the values that FP8, GPTQ and AWQ checkpoints'
weights encode (dequantize_fp8, dequantize_gptq, dequantize_awq), or the weights kept as stored (fp8_weight,
int4_from_gptq, int4_from_awq). And the INT8 and FP8 KV caches' values (quantize_kv, dequantize_kv)."""
from dataclasses import dataclass, replace

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

    def to(self, device) -> "Int8Weight":
        return Int8Weight(self.data.to(device), self.scale.to(device))

    def input_slice(self, lo: int, hi: int) -> "Int8Weight":
        """Input channels lo:hi (a row-parallel rank's share), on the scales of the whole rows."""
        return Int8Weight(self.data[:, lo:hi].contiguous(), self.scale)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Semantics: scale = |weight|.amax(dim=1) / 127 (rows of zeros: scale 1); data = round(weight / scale) in int8,
    computed in fp32. weight [out, in] -> Int8Weight."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(data, scale)


PANEL_NIBBLES = [*range(0, PANEL, 2), *range(1, PANEL, 2)]   # the column of an INT4 panel in nibble n of a k's
                                                            # 64-bit word: 2n, then 2(n - 8) + 1 (cpu/linear.cpp)
INT4_GROUP_SIZES = (128, 64, 32)    # input channels a group of an INT4 weight: the first of these its width takes


def int4_group_size(in_dim: int) -> int:
    """The group size quantize_int4 picks for in_dim input channels."""
    for size in INT4_GROUP_SIZES:
        if in_dim % size == 0:
            return size
    raise ValueError(f"{in_dim} input channels: INT4 weights group them by {', '.join(map(str, INT4_GROUP_SIZES))}")


class GroupedWeight:
    """What Int4Weight and Fp8Weight share: values with a scale (and INT4's zero point) per group of group_size
    input channels of each output channel, those laid [in / group_size, out] (GROUPED: their names), values
    VALUES_PER_BYTE a byte along the input channels, data [out, in / VALUES_PER_BYTE] or in the compiled CPU GEMM's
    panels [out / PANEL, in, PANEL / VALUES_PER_BYTE]. input_order (INT4 from a GPTQ checkpoint in act order): the
    input channels as stored, sorted by group, so that each group is a run: stored channel j is x's channel
    input_order[j], and the GEMMs read x in that order (in_stored_order)."""
    GROUPED: tuple[str, ...] = ("scale",)
    VALUES_PER_BYTE = 1
    input_order: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        if self.data.dim() == 3:
            return torch.Size((self.data.shape[0] * PANEL, self.data.shape[1]))
        return torch.Size((self.data.shape[0], self.data.shape[1] * self.VALUES_PER_BYTE))

    @property
    def nbytes(self) -> int:
        order = 0 if self.input_order is None else self.input_order.nbytes
        return self.data.nbytes + sum(getattr(self, name).nbytes for name in self.GROUPED) + order

    def _grouped(self, fn) -> dict:
        return {name: fn(getattr(self, name)) for name in self.GROUPED}

    def to(self, device):
        moved = replace(self, data=self.data.to(device), **self._grouped(lambda t: t.to(device)))
        if self.input_order is not None:
            moved.input_order = self.input_order.to(device)
        return moved

    def in_stored_order(self, x: torch.Tensor):
        """x [rows, in] with its channels in the order the weight stores them, and the weight over them (the same
        values, input_order None): what a GEMM that reads groups as runs takes."""
        if self.input_order is None:
            return x, self
        return x.index_select(1, self.input_order), replace(self, input_order=None)

    def same_input_order(self, other) -> bool:
        if self.input_order is None or other.input_order is None:
            return self.input_order is other.input_order
        return torch.equal(self.input_order, other.input_order)

    def output_rows(self, rows):
        """Output channels `rows` (a slice or an index list): a column-parallel rank's share, or a reordering."""
        return replace(self, data=self.data[rows].contiguous(), **self._grouped(lambda t: t[:, rows].contiguous()))

    @classmethod
    def cat(cls, parts: list):
        """The output channels of parts one after another (a fused projection's)."""
        if len({part.group_size for part in parts}) > 1:
            raise ValueError(f"parts grouped by {sorted({part.group_size for part in parts})} input channels")
        if not all(parts[0].same_input_order(part) for part in parts):
            raise ValueError("parts whose input channels are stored in different orders")
        return replace(parts[0], data=torch.cat([p.data for p in parts]),
                       **{name: torch.cat([getattr(p, name) for p in parts], dim=1) for name in cls.GROUPED})

    def input_slice(self, lo: int, hi: int):
        """Input channels lo:hi (a row-parallel rank's share): whole groups, or any part of one group a row."""
        in_dim, g, per_byte = self.shape[1], self.group_size, self.VALUES_PER_BYTE
        if self.input_order is not None:
            raise ValueError(f"input channels {lo}:{hi} of a weight stored in act order are no run of groups")
        data = self.data[:, lo // per_byte:hi // per_byte].contiguous()
        if g == in_dim and lo % per_byte == 0 and hi % per_byte == 0:
            return replace(self, data=data, group_size=hi - lo)
        if lo % g or hi % g:
            raise ValueError(f"input channels {lo}:{hi} cut groups of {g}")
        return replace(self, data=data, **self._grouped(lambda t: t[lo // g:hi // g].contiguous()))

    def _expanded(self, name: str) -> torch.Tensor:
        """A grouped tensor as [out, in] fp32."""
        return getattr(self, name).T.float().repeat_interleave(self.group_size, dim=1)


@dataclass
class Int4Weight(GroupedWeight):
    """w[n, k] = (q[n, k] - zero[k // group_size, n]) * scale[k // group_size, n], q in 0..15."""
    data: torch.Tensor      # [out, in / 2] uint8: q[n, 2j] in data[n, j]'s low nibble, q[n, 2j + 1] in its high;
                            # or panels [out / PANEL, in, PANEL / 2] (the compiled CPU GEMM's): each k of a panel
                            # one 64-bit word, its nibble n (bits 4n..4n+3) column PANEL_NIBBLES[n]
    scale: torch.Tensor     # [in / group_size, out] fp32
    zero: torch.Tensor      # [in / group_size, out] uint8, 0..16 (GPTQ's first format reads a stored 15 as 16)
    group_size: int
    input_order: torch.Tensor | None = None   # [in] int64 (GroupedWeight), or None: stored in x's order
    GROUPED = ("scale", "zero")
    VALUES_PER_BYTE = 2

    def __post_init__(self):
        if self.group_size % 32 or self.shape[1] % self.group_size:
            raise ValueError(f"INT4 groups of {self.group_size} input channels over {self.shape[1]}: groups are "
                             "multiples of 32 that divide the input channels")

    def values(self) -> torch.Tensor:
        """q [out, in] uint8."""
        nibbles = torch.stack((self.data & 15, self.data >> 4), dim=-1).flatten(-2)
        if self.data.dim() == 2:
            return nibbles.reshape(self.shape)
        columns = torch.empty_like(nibbles)
        columns[..., PANEL_NIBBLES] = nibbles
        return columns.transpose(1, 2).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in dtype (x's order of input channels), computed in fp32."""
        w = (self.values().float() - self._expanded("zero")) * self._expanded("scale")
        if self.input_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w.to(dtype)

    def panels(self) -> "Int4Weight":
        """The same weight in column panels (PANEL columns, each k's 16 values in 8 bytes)."""
        out_dim, in_dim = self.shape
        q = self.values().view(out_dim // PANEL, PANEL, in_dim).transpose(1, 2)[..., PANEL_NIBBLES]  # [P, in, 16]
        return replace(self, data=(q[..., 0::2] | (q[..., 1::2] << 4)).contiguous())


FP8_MAX = 448.0             # e4m3's largest finite value


@dataclass
class Fp8Weight(GroupedWeight):
    """w[n, k] = e4m3(data[n, k]) * scale[k // group_size, n]: one group a row (group_size = in: a scale per output
    channel, or per tensor), or groups of 128 (an FP8 checkpoint's blocks, each block's scale repeated over its
    rows)."""
    data: torch.Tensor      # [out, in] uint8 (float8_e4m3fn's bits), or panels [out / PANEL, in, PANEL]
    scale: torch.Tensor     # [in / group_size, out] fp32
    group_size: int
    fp8_activations: bool = False   # x quantized a row at a time (quantize_fp8(x)) for e4m3 x e4m3 dots: set by
                                    # the Triton path's prepare_weight on GPUs with FP8 tensor cores (sm_89+)

    def __post_init__(self):
        in_dim = self.shape[1]
        if in_dim % self.group_size or (self.group_size != in_dim and self.group_size % 32):
            raise ValueError(f"FP8 groups of {self.group_size} input channels over {in_dim}: one group a row, or "
                             "multiples of 32 that divide the input channels")

    def values(self) -> torch.Tensor:
        """The e4m3 values [out, in] in fp32."""
        data = self.data if self.data.dim() == 2 else self.data.transpose(1, 2).reshape(self.shape)
        return data.contiguous().view(torch.float8_e4m3fn).float()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in dtype, computed in fp32."""
        return (self.values() * self._expanded("scale")).to(dtype)

    def panels(self) -> "Fp8Weight":
        """The same weight in column panels: data.view(out / 16, 16, in).transpose(1, 2)."""
        out_dim, in_dim = self.shape
        return replace(self, data=self.data.view(out_dim // PANEL, PANEL, in_dim).transpose(1, 2).contiguous())


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Semantics: scale = |weight|.amax(dim=1) / 448 (rows of zeros: scale 1); data = (weight / scale) rounded to
    float8_e4m3fn (torch's round to nearest even), computed in fp32. weight [out, in] -> Fp8Weight, one group a row
    (vLLM's FP8 by channel)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return Fp8Weight(data.contiguous(), scale[None, :].contiguous(), w.shape[1])


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> Fp8Weight | None:
    """An FP8 checkpoint's weight [rows, cols] (float8_e4m3fn) and its scale (as dequantize_fp8 takes them) kept in
    e4m3: a scale per tensor or row as one group a row, block scales as groups of block[1] (each block's scale
    repeated over its rows); None where the blocks are not groups Fp8Weight takes (a partial last block of
    columns, or blocks not of 32s)."""
    rows, cols = weight.shape
    scale = scale.float()
    data = weight.view(torch.uint8).contiguous()
    if scale.numel() == 1:
        return Fp8Weight(data, scale.reshape(1, 1).expand(1, rows).contiguous(), cols)
    if tuple(scale.shape) == (rows, 1):
        return Fp8Weight(data, scale.reshape(1, rows).contiguous(), cols)
    if block is None or tuple(scale.shape) != (-(-rows // block[0]), -(-cols // block[1])):
        raise ValueError(f"a scale of shape {list(scale.shape)} for a weight of shape {[rows, cols]}"
                         + (f" in blocks of {list(block)}" if block else "") + " (one per tensor, row or block)")
    if cols % block[1] or block[1] % 32:
        return None
    return Fp8Weight(data, scale.repeat_interleave(block[0], 0)[:rows].T.contiguous(), block[1])


def quantize_int4(weight: torch.Tensor, group_size: int | None = None) -> Int4Weight:
    """Semantics: per group of group_size input channels of a row (default int4_group_size(in)), lo = min(w, 0),
    hi = max(w, 0), scale = (hi - lo) / 15 (1 where that is 0), zero = round(-lo / scale), q = clamp(round(w /
    scale) + zero, 0, 15), computed in fp32 (round-to-nearest, min-max: GPTQ's grid without its error feedback).
    weight [out, in] -> Int4Weight."""
    w = weight.float()
    out_dim, in_dim = w.shape
    group_size = group_size or int4_group_size(in_dim)
    groups = w.view(out_dim, in_dim // group_size, group_size)
    lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))                    # [out, groups]
    zero = torch.round(-lo / scale).clamp_(0, 15)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.view(out_dim, in_dim)
    return Int4Weight((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scale.T.contiguous(),
                      zero.T.to(torch.uint8).contiguous(), group_size)


QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight
QUANTIZED_WEIGHTS = (Int8Weight, Int4Weight, Fp8Weight)


def quantize_weight(weight: torch.Tensor, weight_dtype: str) -> torch.Tensor | QuantizedWeight:
    """weight [out, in] as weight_dtype keeps it: int8 (quantize_int8), int4 (quantize_int4), fp8
    (quantize_fp8), or as it is (auto)."""
    if weight_dtype == "int8":
        return quantize_int8(weight)
    if weight_dtype == "int4":
        return quantize_int4(weight)
    if weight_dtype == "fp8":
        return quantize_fp8(weight)
    return weight


KV_INT8_MAX = 127
KV_CACHE_TYPES = {"int8": torch.int8, "fp8": torch.uint8}   # kv_cache_dtype -> the cache's storage (FP8: e4m3 bits)


def cache_format(cache_dtype: torch.dtype, activation_dtype: torch.dtype, kv_scales) -> int:
    """The Triton kernels' QUANT for a cache of cache_dtype: 0 in the activations' dtype (no kv_scales), 1 INT8,
    2 FP8 (with kv_scales)."""
    formats = {torch.int8: 1, torch.uint8: 2}
    if kv_scales is None:
        assert cache_dtype == activation_dtype, f"a {cache_dtype} cache without scales beside {activation_dtype}"
        return 0
    assert cache_dtype in formats, f"scales beside a {cache_dtype} cache (int8 or uint8: e4m3 bits)"
    return formats[cache_dtype]


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Semantics: an INT8 cache (int8): floor(x * (1 / scale) + 0.5), clamped to [-127, 127]; an FP8 cache (uint8:
    e4m3 bits): x * (1 / scale) clamped to [-448, 448], rounded to e4m3 (nearest, ties to even); computed in fp32
    (1 / scale rounded to fp32 once): x [..] (K or V as the model computed them) -> its cache values [..].
    TensorRT-LLM's kv_cache_scaling_factor: what the cache holds times `scale` is the value."""
    inv = torch.tensor(1 / scale, dtype=torch.float32, device=x.device)
    if cache_dtype == torch.uint8:
        return (x.float() * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.floor(x.float() * inv + 0.5).clamp_(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)


def dequantize_kv(values: torch.Tensor, scale: float) -> torch.Tensor:
    """Semantics: values * scale in fp32 (an INT8 or FP8 cache's values [..] -> the K or V they stand for)."""
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
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


def int4_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   zero_offset: int) -> Int4Weight | None:
    """A 4-bit GPTQ checkpoint's weight kept packed, the values dequantize_gptq reads in our layout: in act order
    (g_idx not ascending) its input channels sorted by group, with that order as input_order; None where its
    groups are not of one size Int4Weight takes."""
    in_dim, num_groups = qweight.shape[0] * 8, scales.shape[0]
    if in_dim % num_groups:
        return None
    runs = torch.arange(in_dim) // (in_dim // num_groups)
    order = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[order], runs):
        return None
    q = unpack_int(qweight.T.contiguous(), 4).T                                 # [in, out]
    in_order = torch.equal(order, torch.arange(in_dim))
    return _int4_weight(q if in_order else q[order], unpack_int(qzeros, 4) + zero_offset, scales,
                        in_dim // num_groups, None if in_order else order)


def int4_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> Int4Weight | None:
    """An AWQ (GEMM layout) checkpoint's weight kept packed, the values dequantize_awq reads in our layout; None
    where its group size is not one Int4Weight takes."""
    return _int4_weight(unpack_int(qweight, 4, AWQ_ORDER), unpack_int(qzeros, 4, AWQ_ORDER), scales, group_size)


def _int4_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 input_order: torch.Tensor | None = None) -> Int4Weight | None:
    """q [in, out], zeros and scales [groups, out] -> Int4Weight (None: a group size it does not take)."""
    if group_size % 32 or q.shape[0] % group_size or int(zeros.max()) > 255:
        return None
    q = q.T.to(torch.uint8)                                                     # [out, in]
    return Int4Weight((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scales.float().contiguous(),
                      zeros.to(torch.uint8).contiguous(), group_size, input_order)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """Semantics: q = qweight's values along its columns in AWQ_ORDER ([in, out / 8] -> [in, out]), zeros the
    same of qzeros [groups, out / 8]; w[n, k] = scales[k // group_size, n] * (q[k, n] - zeros[k // group_size, n]):
    an AWQ (GEMM layout) checkpoint's weight [out, in] in fp32."""
    q, zeros = unpack_int(qweight, 4, AWQ_ORDER), unpack_int(qzeros, 4, AWQ_ORDER)
    g = torch.arange(q.shape[0]) // group_size
    return (scales.float()[g] * (q - zeros[g]).float()).T.contiguous()
