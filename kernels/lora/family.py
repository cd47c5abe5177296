"""The one owner of a kernel family's LoRA choices: how adapters lie in the device slots (backend/lora/slots.py),
which dtype they are kept in, and what each step's metadata holds (the padded grid, or the Triton work list, for
eager and graph steps alike). backend/ asks it and never branches on the family."""
from dataclasses import dataclass, replace

import torch

from kernels.lora.launch import block_m_for, max_work_items
from kernels.lora.segments import LoraSegments

GRAPH_BLOCK_M = 16                            # the shortest work item: a graph's work list is sized for it


@dataclass(frozen=True, slots=True)
class LoraFamily:
    rank_major_a: bool                        # A stored as A^T [in_dim, cap]: the torch path's batched matmuls
                                              # read plain row-major operands (the compiled CPU shrink and the
                                              # Triton one read along contiguous input rows)
    fused_a_once: bool                        # a fused qkv adapter (module 0) as one band over every qkv column,
                                              # its A stored and read once (else split into q, k, v bands)
    work_list: bool                           # steps carry the Triton kernels' work list (else the padded grid
                                              # where it pays)
    reads_narrow: bool                        # reads fp16 adapters as they are beside an fp32 model
    overlap: bool = False                     # graph steps run LoRA beside the base GEMMs (TritonLoraExecutor;
                                              # the start-up self-check turns it off where it fails)
    fold: bool = False                        # and leave each projection's product for the op after its GEMM to
                                              # add (add + RMSNorm, SiLU-and-mul, RoPE): no merge launch

    @classmethod
    def of(cls, backend: str, device: torch.device | str, overlap: bool = True, fold: bool = True) -> "LoraFamily":
        """The choices of a resolved kernel backend ("torch", "cpu", "triton") on `device`; overlap and fold as
        the engine's config asks (the Triton family's only)."""
        triton = backend == "triton"
        return cls(rank_major_a=torch.device(device).type == "cpu" and backend != "cpu", fused_a_once=triton,
                   work_list=triton, reads_narrow=backend in ("cpu", "triton"), overlap=triton and overlap,
                   fold=triton and overlap and fold)

    def in_turn(self) -> "LoraFamily":
        """The same family with graph steps' LoRA after each base GEMM (no overlap, nothing folded)."""
        return replace(self, overlap=False, fold=False)

    def merged(self) -> "LoraFamily":
        """The same family with graph steps' LoRA beside each GEMM, merged after it (nothing folded)."""
        return replace(self, fold=False)

    def adapter_dtype(self, name: str, model_dtype: torch.dtype) -> torch.dtype:
        """"auto" is the model's dtype, except that a float32 model keeps its adapters in float16 where the kernels
        read them as they are: TensorRT-LLM clients send lora_weights as FP16, so nothing sent is lost, and a decode
        step reads half the adapter bytes. (Adapters sent in FP32 are rounded to FP16 then; "float32" keeps them
        whole.)"""
        if name == "auto":
            return torch.float16 if model_dtype == torch.float32 and self.reads_narrow else model_dtype
        return getattr(torch, name)

    def segments(self, token_slots: list[int], dtype: torch.dtype) -> LoraSegments:
        """An eager step's segments (each token's adapter slot, -1 for none), with what its kernels read."""
        return LoraSegments.from_token_slots(token_slots, block_m_for(len(token_slots), dtype) if self.work_list
                                             else 0)

    @staticmethod
    def graph_buffers(num_segments: int, max_tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
        """A graph's fixed segment buffers, work list (as long as any bucket's) and token slots, as padding: every
        segment empty, no adapter, every item idle."""
        num_items = max_work_items(max_tokens, num_segments, GRAPH_BLOCK_M)
        return {"lora_starts": torch.zeros(num_segments + 1, dtype=torch.int32, device=device),
                "lora_slots": torch.full((num_segments,), -1, dtype=torch.int32, device=device),
                "lora_work": torch.tensor([-1, 0, 0], dtype=torch.int32).repeat(num_items, 1).to(device),
                "lora_token_slots": torch.full((max_tokens,), -1, dtype=torch.int32, device=device)}

    @staticmethod
    def graph_segments(token_slots: list[int], num_tokens: int, num_segments: int,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A graph step's segments (padding rows -1) padded to num_segments (empty ones at the end), its work list
        to the graph's length (idle items at the end) and its token slots, as host tensors for `graph_buffers`."""
        block_m = block_m_for(num_tokens, dtype)
        padded = token_slots + [-1] * (num_tokens - len(token_slots))
        segments = LoraSegments.from_token_slots(padded, block_m, max_work_items(num_tokens, num_segments, block_m))
        num_empty = num_segments - len(segments.slots_list)
        assert num_empty >= 0, "more LoRA segments than a graph can have"
        return {"lora_starts": torch.cat([segments.starts, torch.full((num_empty,), num_tokens, dtype=torch.int32)]),
                "lora_slots": torch.cat([segments.slots, torch.full((num_empty,), -1, dtype=torch.int32)]),
                "lora_work": segments.work, "lora_token_slots": torch.tensor(padded, dtype=torch.int32)}

    def graph_view(self, buffers: dict[str, torch.Tensor], num_tokens: int, dtype: torch.dtype) -> LoraSegments:
        """A graph's segments read from its buffers on the device (their host lists are unknown at capture), kernel
        grids for num_tokens rows in any segment; LoRA beside the base GEMMs where the family overlaps, and its
        product left for the next op where the family folds."""
        num_segments = buffers["lora_slots"].shape[0]
        block_m = block_m_for(num_tokens, dtype)
        work = buffers["lora_work"][:max_work_items(num_tokens, num_segments, block_m)]
        return LoraSegments(buffers["lora_starts"], buffers["lora_slots"], [0] * (num_segments + 1),
                            [-1] * num_segments, num_tokens, work=work, block_m=block_m, overlap=self.overlap,
                            token_slots=buffers["lora_token_slots"][:num_tokens] if self.fold else None)
