"""The device tier's memory: every slot's adapter, per layer and projection, ready for shrink/expand.

Per layer and projection (qkv, o, gate_up, down) a slot holds one band of max_rank rank rows per module
(qkv: q, k, v; gate_up: gate, up):
    A [cap, in_dim]: module m's A in rows [m * max_rank, m * max_rank + rank_m)
    B [out_dim, cap]: module m's B in its output columns and its band's rank columns (zeros elsewhere)
so one shrink and one expand serve every slot at once, each at that slot's own rank (per band on CPU, per
projection on GPU: `Projection`), and an expand reads only its module's columns: the zeros between modules are
never touched. On CPU B is stored rank-major
(B^T [cap, out_dim]) and exposed transposed, so expands run along contiguous output rows; on GPU it is stored as
shown, for the Triton kernels' coalesced loads. The kernel family (kernels/lora/family.py) decides the rest: A
rank-major or not, and a fused qkv module (TRT-LLM module 0) split into q, k and v bands sharing its A, or
(`fused_a_once`) one band over every qkv column, its A stored (and read) once: each slot's band bounds are its own
(`Projection.slot_bounds`), and the q band's B holds the k and v rows too.

A mixture's expert modules (13-17) have slots of their own beside these (backend/lora/expert_slots.py); a mixture
with no dense MLP on any layer (Mixtral, Qwen3-30B-A3B) gives gate_up and down no rank rows (`adapts`): 0.34 GB
a slot at rank 64 on Mixtral-8x7B that no adapter could fill (modules 5-7 are refused there).

What each slot holds is recorded in host tensors (`host_ranks`, `host_dora`, `fused`): on CPU they are the very
tensors the kernels read, on GPU the kernels read device copies written with each load.
"""
from dataclasses import dataclass
from itertools import groupby

import torch

from backend.device import SideCopies, on, pin
from backend.lora.expert_slots import ExpertSlots
from backend.lora.format import EXPERT_MODULE_NAMES, LoraAdapter, module_columns
from backend.model.checkpoint import ModelConfig
from kernels.lora.family import LoraFamily

PROJS = ("qkv", "o", "gate_up", "down")
BANDS = {"qkv": (1, 2, 3), "o": (4,), "gate_up": (5, 7), "down": (6,)}     # TRT-LLM module ids, in band order
BAND_OF_MODULE = {module: (proj, band) for proj, modules in BANDS.items() for band, module in enumerate(modules)}
MAX_BANDS = max(len(modules) for modules in BANDS.values())
FUSED_QKV = 0


def proj_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}[proj]


def _zeros(num_layers: int, num_slots: int, rows: int, cols: int, dtype: torch.dtype, device,
           column_major: bool) -> torch.Tensor:
    """[num_layers, num_slots, rows, cols], stored column-major per slot when asked (see the module docstring)."""
    if column_major:
        return torch.zeros(num_layers, num_slots, cols, rows, dtype=dtype, device=device).transpose(2, 3)
    return torch.zeros(num_layers, num_slots, rows, cols, dtype=dtype, device=device)


def _follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    """t starts where prev ends in one buffer, both contiguous and of one shape."""
    return (t.shape == prev.shape and t.is_contiguous() and prev.is_contiguous()
            and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and t.storage_offset() == prev.storage_offset() + prev.numel())


def _blocks(pieces: list[tuple[int, torch.Tensor]]) -> list[tuple[slice, torch.Tensor]]:
    """(layer, matrix) pieces in layer order, merged where consecutive layers' matrices lie back to back (a packed
    adapter's, backend/lora/format.py): (layers, [num_layers, ...] block) pairs, one copy each."""
    runs: list[list[torch.Tensor]] = []
    first_layers: list[int] = []
    for layer, t in pieces:
        if runs and layer == first_layers[-1] + len(runs[-1]) and _follows(runs[-1][-1], t):
            runs[-1].append(t)
        else:
            runs.append([t])
            first_layers.append(layer)
    return [(slice(first, first + len(run)),
             run[0].as_strided((len(run), *run[0].shape), (run[0].numel(), *run[0].stride()), run[0].storage_offset()))
            for first, run in zip(first_layers, runs)]


@dataclass(slots=True)
class Band:
    """One module's slice of every slot, as the LoRA ops take it."""
    a: torch.Tensor                           # [num_slots, max_rank, in_dim]
    b: torch.Tensor                           # [num_slots, band_out_dim, max_rank]
    ranks: torch.Tensor                       # [num_slots] int32, on the device
    host_ranks: torch.Tensor                  # the same on the host
    columns: tuple[int, int]                  # the output columns [start, end) of the projection it writes
    m: torch.Tensor | None = None             # [num_slots, band_out_dim]: DoRA magnitudes (1 where not DoRA)
    host_dora: torch.Tensor | None = None     # [num_slots] int32 on the host: a DoRA module in this band


@dataclass(slots=True)
class Projection:
    """Every band of one layer's projection, for kernels that take them in one launch (kernels/lora/)."""
    a: torch.Tensor                           # [num_slots, num_bands * max_rank, in_dim]
    b: torch.Tensor                           # [num_slots, out_dim, num_bands * max_rank]
    ranks: torch.Tensor                       # [num_bands, num_slots] int32
    bounds: torch.Tensor                      # [num_bands + 1] int32: band i writes columns [bounds[i], bounds[i + 1])
    slot_bounds: torch.Tensor                 # [num_slots, num_bands + 1] int32: the same, per slot (a fused qkv
                                              # adapter's band 0 spans every column)
    max_rank: int
    widths: list[int]                         # each band's number of columns
    bands: list[Band]
    m: torch.Tensor | None = None             # [num_slots, out_dim]: DoRA magnitudes, 1 where a slot has none
    dora: torch.Tensor | None = None          # [num_bands, num_slots] int32: the band has a DoRA module in the slot

    @property
    def num_bands(self) -> int:
        return len(self.bands)


class DeviceSlots:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device="cpu",
                 family: LoraFamily | None = None):
        """family: how the kernels read the slots (default: the torch reference's on `device`)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.family = family or LoraFamily.of("torch", self.device)
        self.fused_a_once = self.family.fused_a_once
        self.copies = SideCopies(self.device)
        self.band_columns = {proj: [module_columns(cfg, module) for module in BANDS[proj]] for proj in PROJS}
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.adapts = tuple(proj for proj in PROJS if proj in ("qkv", "o") or cfg.any_dense_mlp)
        self.a_stacks: dict[str, torch.Tensor] = {}                # [num_layers, num_slots, cap, in_dim]
        self.b_stacks: dict[str, torch.Tensor] = {}                # [num_layers, num_slots, out_dim, cap]
        for proj in PROJS:
            in_dim, out_dim = proj_shape(cfg, proj)
            cap = len(BANDS[proj]) * max_rank if proj in self.adapts else 0
            self.a_stacks[proj] = _zeros(cfg.num_layers, num_slots, cap, in_dim, dtype, device,
                                         self.family.rank_major_a)
            self.b_stacks[proj] = _zeros(cfg.num_layers, num_slots, out_dim, cap, dtype, device,
                                         self.device.type == "cpu")
        self.a = [{proj: self.a_stacks[proj][layer] for proj in PROJS} for layer in range(cfg.num_layers)]
        self.b = [{proj: self.b_stacks[proj][layer] for proj in PROJS} for layer in range(cfg.num_layers)]
        shape = (cfg.num_layers, len(PROJS), MAX_BANDS, num_slots)
        self.host_ranks = torch.zeros(shape, dtype=torch.int32)                # [layer, proj, band, slot]
        self.host_dora = torch.zeros(shape, dtype=torch.int32)                 # the same: a DoRA module there
        self.fused = torch.zeros(cfg.num_layers, num_slots, dtype=torch.bool)  # a fused qkv adapter, one band
        self.ranks, self.dora = (self.host_ranks, self.host_dora) if self.device.type == "cpu" else (
            torch.zeros(shape, dtype=torch.int32, device=device), torch.zeros(shape, dtype=torch.int32, device=device))
        self.m_stacks = {proj: torch.ones(cfg.num_layers, num_slots, proj_shape(cfg, proj)[1], dtype=dtype,
                                          device=device) for proj in PROJS}    # DoRA magnitudes; 1: none
        self.slot_bounds = {proj: torch.tensor([self._bounds(proj, False)], dtype=torch.int32).repeat(
            cfg.num_layers, num_slots, 1).to(device) for proj in PROJS}       # [num_layers, num_slots, bands + 1]
        self.projections: list[dict[str, Projection]] = [{proj: self._projection(layer, proj) for proj in PROJS}
                                                         for layer in range(cfg.num_layers)]
        self.experts = ExpertSlots(cfg, num_slots, max_rank, dtype, device) if cfg.num_experts else None

    def _bounds(self, proj: str, fused: bool) -> list[int]:
        """A slot's band bounds: each band its module's columns, or (a fused qkv adapter) band 0 all of them."""
        columns = self.band_columns[proj]
        if fused:
            return [0] + [columns[-1][1]] * len(columns)
        return [start for start, _ in columns] + [columns[-1][1]]

    def _projection(self, layer: int, proj: str) -> Projection:
        p, r = PROJS.index(proj), self.max_rank
        columns = list(self.band_columns[proj])
        assert all(end == start for (_, end), (start, _) in zip(columns, columns[1:])), "bands must be contiguous"
        a, b = self.a[layer][proj], self.b[layer][proj]
        spans = columns
        if proj == "qkv" and self.fused_a_once:              # band 0 may hold a fused adapter's k and v rows too
            spans = [(0, columns[-1][1])] + columns[1:]
        m = self.m_stacks[proj][layer]
        bands = [Band(a[:, i * r:(i + 1) * r], b[:, slice(*cols), i * r:(i + 1) * r], self.ranks[layer, p, i],
                      self.host_ranks[layer, p, i], cols, m[:, slice(*cols)], self.host_dora[layer, p, i])
                 for i, cols in enumerate(spans)]
        bounds = torch.tensor(self._bounds(proj, False), dtype=torch.int32)
        return Projection(a, b, self.ranks[layer, p, :len(columns)], bounds.to(self.device),
                          self.slot_bounds[proj][layer], r, [end - start for start, end in columns], bands, m,
                          self.dora[layer, p, :len(columns)])

    @property
    def num_bytes_per_slot(self) -> int:
        return sum(t[0].nbytes for layer in self.a + self.b for t in layer.values()) + (
            self.experts.num_bytes_per_slot if self.experts is not None else 0)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot, replacing whatever was there. A slot is zero wherever no adapter row lies,
        so only the rank rows the old adapter used past the new one's ranks are cleared. A module's matrices over
        consecutive layers go in one copy where they lie back to back (a packed adapter: 14 copies for an
        all-modules adapter, not 2 per layer and module). On CUDA the copies run on a side stream;
        `copies.wait([slot])` orders a step after them."""
        bands: dict[tuple[str, int, bool], list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        ranks = [[[0] * MAX_BANDS for _ in PROJS] for _ in range(self.cfg.num_layers)]     # [layer][proj][band]
        dora = [[[0] * MAX_BANDS for _ in PROJS] for _ in range(self.cfg.num_layers)]
        fused = [False] * self.cfg.num_layers
        for (layer, module_id), (a, b) in sorted(adapter.weights.items()):
            if module_id in EXPERT_MODULE_NAMES:                           # (self.experts' own)
                continue
            whole = module_id == FUSED_QKV and self.fused_a_once          # one band over every qkv column
            fused[layer] = fused[layer] or whole
            m = adapter.magnitudes.get((layer, module_id))
            for (module, b_part), m_part in zip(self._split_fused(module_id, b), self._split_fused(
                    module_id, m[:, None] if m is not None else b[:, :1])):
                proj, band = BAND_OF_MODULE[module]
                bands.setdefault((proj, band, whole), []).append((layer, a, b_part, m_part[1][:, 0]
                                                                  if m is not None else None))
                ranks[layer][PROJS.index(proj)][band] = a.shape[0]
                dora[layer][PROJS.index(proj)][band] = int(m is not None)
        ranks, dora, fused = (torch.tensor(ranks, dtype=torch.int32), torch.tensor(dora, dtype=torch.int32),
                              torch.tensor(fused))
        with on(self.device), self.copies.copying():
            self._replace_magnitudes(slot, dora)
            if not torch.equal(fused, self.fused[:, slot]):                # the qkv band bounds change
                bounds = torch.tensor([self._bounds("qkv", bool(whole)) for whole in fused], dtype=torch.int32)
                self.slot_bounds["qkv"][:, slot].copy_(pin(bounds, self.device), non_blocking=True)
            self._replace_ranks(slot, ranks, fused)
            for (proj, band, whole), pieces in bands.items():
                start = band * self.max_rank
                columns = slice(0, self.band_columns[proj][-1][1]) if whole else slice(*self.band_columns[proj][band])
                for layers, a in _blocks([(layer, a) for layer, a, _, _ in pieces]):
                    self.a_stacks[proj][layers, slot, start:start + a.shape[1]].copy_(a, non_blocking=True)
                for layers, b in _blocks([(layer, b) for layer, _, b, _ in pieces]):
                    self.b_stacks[proj][layers, slot, columns, start:start + b.shape[2]].copy_(b, non_blocking=True)
                for layers, m in _blocks([(layer, m) for layer, _, _, m in pieces if m is not None]):
                    self.m_stacks[proj][layers, slot, columns].copy_(m, non_blocking=True)
            if self.ranks is not self.host_ranks:
                self.ranks[..., slot].copy_(pin(ranks, self.device), non_blocking=True)
                self.dora[..., slot].copy_(pin(dora, self.device), non_blocking=True)
            if self.experts is not None:
                self.experts.load(slot, adapter)
        self.copies.done(slot)

    def _replace_magnitudes(self, slot: int, new_dora: torch.Tensor) -> None:
        """Magnitudes back to 1 where the old adapter had DoRA modules (the new adapter's are copied after), then
        the new flags."""
        old = self.host_dora[..., slot].any(dim=2)                            # [layer, proj]
        for layer, p in old.nonzero().tolist():
            self.m_stacks[PROJS[p]][layer, slot].fill_(1)
        self.host_dora[..., slot] = new_dora

    def _replace_ranks(self, slot: int, new_ranks: torch.Tensor, new_fused: torch.Tensor) -> None:
        """Zero each band's rank rows [new rank, old rank) of a slot (what the old adapter left past the new one;
        one zero_ per run of layers alike), and all of band 0 where a fused qkv adapter leaves (its k and v rows lie
        outside band 0's columns), then record the new ranks."""
        q_band, qkv = slice(0, self.max_rank), PROJS.index("qkv")
        old_ranks = self.host_ranks[..., slot].clone()                        # [layer, proj, band]
        for layer in self.fused[:, slot].nonzero().flatten().tolist():
            self.a_stacks["qkv"][layer, slot, q_band].zero_()
            self.b_stacks["qkv"][layer, slot, :, q_band].zero_()
            old_ranks[layer, qkv, 0] = 0
        self.fused[:, slot] = new_fused
        for p, proj in enumerate(PROJS):
            for band, columns in enumerate(self.band_columns[proj]):
                changes = zip(new_ranks[:, p, band].tolist(), old_ranks[:, p, band].tolist())
                first = 0
                for (new, old), run in groupby(changes):
                    num_layers = len(list(run))
                    if old > new:
                        layers = slice(first, first + num_layers)
                        rows = slice(band * self.max_rank + new, band * self.max_rank + old)
                        self.a_stacks[proj][layers, slot, rows].zero_()
                        self.b_stacks[proj][layers, slot, slice(*columns), rows].zero_()
                    first += num_layers
        self.host_ranks[..., slot] = new_ranks

    def _split_fused(self, module_id: int, b: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        if module_id != FUSED_QKV or self.fused_a_once:
            return [(1 if module_id == FUSED_QKV else module_id, b)]
        q, kv = self.cfg.q_size, self.cfg.kv_size
        return [(1, b[:q]), (2, b[q:q + kv]), (3, b[q + kv:])]
