"""e4m3 (float8_e4m3fn) by bit moves in Triton, the same on every GPU (sm_80 has no FP8 conversions) and in the
interpreter (whose fp32 -> fp8 conversion misrounds values whose mantissa rounds up into the next power of two):
the FP8 weights' GEMM and the FP8 KV cache read with e4m3_to_fp16, the cache writes with fp32_to_e4m3."""
import triton
import triton.language as tl

E4M3_FP16_GAP = 256.0       # e4m3_to_fp16's values are the e4m3 values / 2^8 (exponent biases 7 and 15)


@triton.jit
def e4m3_to_fp16(bits):
    """e4m3 bytes (an integer tensor, 0..255) -> fp16 values, each the e4m3 value / E4M3_FP16_GAP, exactly
    (subnormals too): the sign to bit 15, exponent and mantissa to bits 13..7 of an fp16."""
    bits = bits.to(tl.int32)
    return (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp32_to_e4m3(x):
    """fp32 values within [-448, 448] -> their e4m3 bytes (int32, 0..255), rounded to nearest, ties to even:
    below 2^-6 (subnormals) the code is |x| * 2^9 rounded (by adding and taking away 2^23), above it the fp32
    bits rounded to 3 mantissa bits and the exponent rebiased (127 -> 7)."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    m_bits = magnitude.to(tl.int32, bitcast=True)
    normal = ((m_bits + 0x7FFFF + ((m_bits >> 20) & 1)) >> 20) - (120 << 3)
    return tl.where(magnitude < 0.015625, subnormal, normal) | ((bits >> 24) & 0x80)
