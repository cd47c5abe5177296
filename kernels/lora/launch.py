"""How the Triton LoRA kernels (kernels/lora/triton_kernels.py) launch at a step's token count: the work list (one
item per BLOCK_M rows of a segment with an adapter) and each projection's tiles, splits and grids (`LoraLaunch`).
The executor (kernels/lora/executor.py) and the cost plan (bench/lora_plan.py) both use it; nothing here
launches."""
import math
from dataclasses import dataclass

import torch
import triton

TARGET_PROGRAMS = 128                                       # a shrink launch's programs: about one an SM
SPLIT_COLUMNS_PER_ROW = 32                                  # a split's columns per row of its item: its fp32 partial
                                                            # (written, read back) stays <= 1/16 of the A it reads
MAX_PARTIAL_BYTES = 64 << 20                                # the split partials of one launch, fp32
MERGE_VALUES = 16384                                        # a merge program's tiles at most (LoraLaunch.merge_tiles):
                                                            # 1024 columns of a decode item
DECODE_ROWS_PER_ITEM = 4                                    # items this short (decode steps): the expand's rows one
                                                            # by one (expand_tile)


def block_m_for(num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows per work item: 16 for decode steps and short chunks (segments of a few tokens), 64 for long prompt
    chunks of a 16-bit model (fewer re-reads of each A; fp32 tiles that tall would spill)."""
    return 64 if num_tokens > 256 and dtype.itemsize <= 2 else 16


def max_work_items(num_tokens: int, num_segments: int, block_m: int) -> int:
    """The most items num_tokens rows in num_segments segments can make (a graph's fixed work-list length)."""
    return max(1, min(num_tokens, num_segments + num_tokens // block_m))


def work_items(starts: list[int], slots: list[int], block_m: int, num_items: int | None = None) -> torch.Tensor:
    """[num_items, 3] int32 host tensor: [slot, start, end) per block_m rows of each segment with an adapter, then
    idle items ([-1, 0, 0]) up to num_items."""
    items = [(slot, row, min(row + block_m, starts[s + 1])) for s, slot in enumerate(slots) if slot >= 0
             for row in range(starts[s], starts[s + 1], block_m)]
    num_items = max(1, len(items)) if num_items is None else num_items
    assert len(items) <= num_items, f"{len(items)} LoRA work items exceed the {num_items} a graph holds"
    return torch.tensor(items + [(-1, 0, 0)] * (num_items - len(items)), dtype=torch.int32).view(num_items, 3)


@dataclass(frozen=True, slots=True)
class LoraLaunch:
    """One projection's shrink and expand at a step's token count."""
    num_items: int
    num_bands: int
    in_dim: int
    widths: tuple[int, ...]                   # the bands' columns
    max_rank: int
    block_m: int
    block_r: int                              # max_rank, as a power of two
    block_k: int
    split_k: int
    blocks_per_split: int                     # BLOCK_K blocks of the input each split reads
    block_n: int
    tiles: int                                # BLOCK_N tiles an expand program covers (1 as planned; a sweep
                                              # tries more)
    act_bytes: int = 2                        # the activations' element size
    expand_warps: int = 8                     # (expand_tile)
    mma: bool = True                          # the expand's product on tensor cores, BLOCK_M rows at a time (else
                                              # row by row in registers: decode items of a row or a few)

    @property
    def out_dim(self) -> int:
        return sum(self.widths)

    @property
    def block_c(self) -> int:
        return triton.next_power_of_2(self.num_bands * self.block_r)

    @property
    def k_per_split(self) -> int:
        return self.blocks_per_split * self.block_k

    @property
    def shrink_grid(self) -> tuple[int, int]:
        return self.num_items, self.split_k

    @property
    def expand_grid(self) -> tuple[int, int]:
        return self.num_items, sum(triton.cdiv(width, self.block_n * self.tiles) for width in self.widths)

    @property
    def shrink_constexprs(self) -> dict:
        return {"NUM_BANDS": self.num_bands, "BLOCK_M": self.block_m, "BLOCK_R": self.block_r,
                "BLOCK_C": self.block_c, "BLOCK_K": self.block_k}

    @property
    def expand_constexprs(self) -> dict:
        return {"NUM_BANDS": self.num_bands, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "TILES": self.tiles,
                "BLOCK_R": self.block_r, "ALIGNED": self.aligned, "MMA": self.mma}

    @property
    def merge_tiles(self) -> int:
        """BLOCK_N tiles a merge program covers (the product is done; a merge program only streams it back, so
        fewer, wider programs than the expand's): up to MERGE_VALUES of [BLOCK_M, BLOCK_N] tiles, as many as make
        groups that divide every band (a masked group of several tiles held 168-255 registers)."""
        tiles = max(1, MERGE_VALUES // (self.block_m * self.block_n))
        while tiles > 1 and any(width % (tiles * self.block_n) for width in self.widths):
            tiles //= 2
        return tiles

    @property
    def merge_grid(self) -> tuple[int, int]:
        return self.num_items, sum(triton.cdiv(width, self.block_n * self.merge_tiles) for width in self.widths)

    @property
    def merge_constexprs(self) -> dict:
        """lora_merge covers what the expand wrote (each slot's bands with a rank), in groups of its own."""
        group = self.block_n * self.merge_tiles
        return {"NUM_BANDS": self.num_bands, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "TILES": self.merge_tiles, "ALIGNED": all(width % group == 0 for width in self.widths)}

    @property
    def aligned(self) -> bool:
        """Every band a whole number of expand groups (TILES x BLOCK_N columns): no band's group is masked."""
        return all(width % (self.block_n * self.tiles) == 0 for width in self.widths)

    @property
    def shrink_options(self) -> dict:
        """Eight warps, the K loop's loads pipelined three deep (measured best on an H200: bench/lora_sweep.py)."""
        return {"num_warps": 8, "num_stages": 3}

    @property
    def expand_options(self) -> dict:
        return {"num_warps": self.expand_warps, "num_stages": 2}

    @property
    def merge_options(self) -> dict:
        return {"num_warps": 8, "num_stages": 1}


def plan_launch(num_tokens: int, num_items: int, in_dim: int, widths: list[int], max_rank: int,
                block_m: int | None = None, split_k: int | None = None, act_bytes: int = 2) -> LoraLaunch:
    """The configuration a projection runs with: full-rank tiles (BLOCK_R >= max_rank; every band in one shrink
    tile, x read once), the input split so that up to TARGET_PROGRAMS shrink programs each read >=
    SPLIT_COLUMNS_PER_ROW x BLOCK_M columns (or into split_k parts, for tests), and expand programs of one tile of
    columns each (expand_tile). Tiles hold half as many fp32 activations (act_bytes 4: an fp32 model) as 16-bit
    ones, in the same registers. The constants are an H200's best at the 8B shape (bench/lora_sweep.py;
    docs/kernels.md, "LoRA launch rules, as measured on an H200")."""
    block_m = block_m or block_m_for(num_tokens)
    block_r = max(16, triton.next_power_of_2(max_rank))
    block_c = triton.next_power_of_2(len(widths) * block_r)
    block_k = min(128 if act_bytes <= 2 else 64, max(16, (16384 if act_bytes <= 2 else 2048) // block_c),
                  max(16, triton.next_power_of_2(in_dim)))
    num_bands, cap = len(widths), len(widths) * max_rank
    k_blocks = triton.cdiv(in_dim, block_k)
    split_k = split_k or min(triton.cdiv(TARGET_PROGRAMS, num_items),
                             max(1, in_dim // (SPLIT_COLUMNS_PER_ROW * block_m)),
                             max(1, MAX_PARTIAL_BYTES // (num_tokens * cap * 4)))
    blocks_per_split = triton.cdiv(k_blocks, max(1, split_k))
    split_k = triton.cdiv(k_blocks, blocks_per_split)                 # no split left without columns
    decode = block_m == 16 and num_tokens <= DECODE_ROWS_PER_ITEM * num_items
    block_n, warps = expand_tile(widths, block_r, act_bytes, decode)
    return LoraLaunch(num_items, num_bands, in_dim, tuple(widths), max_rank, block_m, block_r, block_k, split_k,
                      blocks_per_split, block_n, 1, act_bytes, warps, mma=not decode)


def expand_tile(widths: list[int], block_r: int, act_bytes: int = 2, decode: bool = False) -> tuple[int, int]:
    """(BLOCK_N, warps) of an expand program, which owns one tile of one band's columns (a band's last tile masked
    where BLOCK_N does not divide its width), at most the largest power of two dividing every width (>= 16: no tile
    past a band's end where one fits). Where items are a few rows (decode: rows one by one, no tensor cores), 128
    columns, or 8192 values of B, on 2-8 warps that hold <= 32 of them a thread (ptxas: 64 registers at rank 64,
    32 of 64 warps resident per SM where the 16-row product held 168 and 12); else 64 columns on eight warps, a
    [BLOCK_N, BLOCK_R] B tile <= 8192 values (16-bit; half of that fp32)."""
    divides = math.gcd(*widths) & -math.gcd(*widths)                 # the largest power of two dividing them
    if decode:
        block_n = min(max(16, divides), 128, max(16, 8192 // block_r))
        return block_n, min(8, max(2, block_n * block_r // 1024))
    return min(max(16, divides), 64, max(16, 8192 // block_r // (2 if act_bytes > 2 else 1))), 8
