"""A pytest plugin (`-p tests.kernels.avx2_build`): the compiled CPU kernels built and loaded for AVX2 (x86-64-v3:
AVX2, FMA, F16C) instead of -march=native, before any test module loads them."""
from kernels import cpu_ext

cpu_ext.target(cpu_ext.AVX2)
