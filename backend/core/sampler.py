"""Next-token choice for a whole batch: embedding bias, penalties, bans and grammar masks, then greedy or seeded
temperature / min-p / top-k / top-p, and log probs (the chosen token's and the top alternatives). The host gathers
each step's sampling inputs into small tensors (`prepare`, uploaded with the rest of the step's metadata); the
device does everything else with no data-dependent shapes and no sync (`sample`).

Random draws are counter-based: a row's uniform number is a hash of its request's seed and its output length,
so a seeded request samples the same tokens whatever batch it runs in, on any device.
"""
from dataclasses import dataclass, field

import torch

from backend.core.request import Sequence

MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingPlan:
    """What the step's sampling needs: host facts that pick the code path, and tensors (host, then device)."""
    num_rows: int
    any_sampled: bool
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    num_repetition: int
    num_presence: int
    num_bans: int
    num_biased: int
    num_guided: int
    any_log_probs: bool
    max_top_log_probs: int                    # top alternatives the step returns for every row (the rows' largest k)
    t: dict[str, torch.Tensor] = field(default_factory=dict)
    reusable: bool = False                    # greedy rows with nothing that reads their tokens: the same plan serves
                                              # every step of the same rows

    @property
    def keeps_logits(self) -> bool:
        """Nothing changes the logits before the argmax (no bias, penalty, ban or grammar): the greedy tokens are the
        raw logits' argmax, which a decode graph takes itself."""
        return not (self.num_biased or self.num_repetition or self.num_presence or self.num_bans or self.num_guided)


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), pad, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def prepare(seqs: list[Sequence], vocab_size: int) -> SamplingPlan:
    """Host tensors for one step's rows (one per sequence that samples, in batch order): only those the rows need.
    A batch of plain greedy rows needs none."""
    params = [seq.params for seq in seqs]
    sampled = [p for p in params if not p.greedy]
    extra = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty
             or p.frequency_penalty or p.bad_words or p.min_tokens or p.embedding_bias is not None]
    guided = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
    plan = SamplingPlan(num_rows=len(seqs), any_sampled=bool(sampled), max_top_k=0, any_top_p=False, any_min_p=False,
                        num_repetition=0, num_presence=0, num_bans=0, num_biased=0, num_guided=len(guided),
                        any_log_probs=any(p.any_log_probs or p.beam_width > 1 for p in params),
                        max_top_log_probs=max(p.num_candidates for p in params) if params else 0,
                        reusable=not sampled and not extra and not guided)
    t = plan.t
    if sampled:
        top_k = [p.top_k if 0 < p.top_k < vocab_size and not p.greedy else 0 for p in params]
        plan.max_top_k = max(top_k)
        plan.any_top_p = any(seq.top_p < 1.0 and not seq.params.greedy for seq in seqs)
        t["s_greedy"] = torch.tensor([p.greedy for p in params], dtype=torch.int32)
        t["s_temperature"] = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                          dtype=torch.float32)
        t["s_top_k"] = torch.tensor(top_k, dtype=torch.int32)
        t["s_top_p"] = torch.tensor([seq.top_p for seq in seqs], dtype=torch.float32)
        t["s_seed"] = torch.tensor([seq.seed_key for seq in seqs], dtype=torch.int32)
        plan.any_min_p = any(p.min_p > 0.0 for p in sampled)
        if plan.any_min_p:
            t["s_min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        t["s_step"] = torch.tensor([seq.num_output_tokens for seq in seqs], dtype=torch.int32)
    if extra:
        _prepare_extras(plan, seqs, extra, vocab_size)
    if guided:
        bitmask = torch.zeros(len(guided), -(-vocab_size // 32), dtype=torch.int32)
        for row, i in enumerate(guided):
            seqs[i].matcher.fill_next_token_bitmask(bitmask, row)
        t["s_guided_rows"] = torch.tensor(guided, dtype=torch.int32)
        t["s_bitmask"] = bitmask
    return plan


def _prepare_extras(plan: SamplingPlan, seqs: list[Sequence], rows: list[int], vocab_size: int) -> None:
    """Penalties, bans and embedding bias, for the rows that have any."""
    params, t = [seq.params for seq in seqs], plan.t
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    pres = [i for i in rows if (params[i].presence_penalty or params[i].frequency_penalty) and seqs[i].output_ids]
    ban_rows, ban_tokens = [], []
    for row in rows:
        banned = banned_tokens(seqs[row])
        ban_rows += [row] * len(banned)
        ban_tokens += banned
    biased = [i for i in rows if params[i].embedding_bias is not None]
    plan.num_repetition, plan.num_presence, plan.num_bans, plan.num_biased = (len(rep), len(pres), len(ban_rows),
                                                                              len(biased))
    if rep:
        t["s_rep_rows"] = torch.tensor(rep, dtype=torch.int32)
        t["s_rep_penalty"] = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32)
        t["s_rep_ids"] = _padded([seqs[i].token_ids for i in rep], vocab_size)
    if pres:
        t["s_pres_rows"] = torch.tensor(pres, dtype=torch.int32)
        t["s_presence"] = torch.tensor([params[i].presence_penalty for i in pres], dtype=torch.float32)
        t["s_frequency"] = torch.tensor([params[i].frequency_penalty for i in pres], dtype=torch.float32)
        t["s_pres_ids"] = _padded([seqs[i].output_ids for i in pres], vocab_size)
    if ban_rows:
        t["s_ban_rows"] = torch.tensor(ban_rows, dtype=torch.int32)
        t["s_ban_tokens"] = torch.tensor(ban_tokens, dtype=torch.int32)
    if biased:
        t["s_bias_rows"] = torch.tensor(biased, dtype=torch.int32)
        t["s_bias"] = torch.stack([torch.as_tensor(params[i].embedding_bias, dtype=torch.float32) for i in biased])


def banned_tokens(seq: Sequence) -> list[int]:
    """end_id before min_tokens, and the last token of every bad word whose prefix was just generated."""
    p = seq.params
    banned = [p.end_id] if p.end_id is not None and seq.num_output_tokens < p.min_tokens else []
    tokens = seq.token_ids if p.bad_words else []         # prompt + output, built only where a word needs it
    for word in p.bad_words:
        prefix = word[:-1]
        if not prefix or tokens[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, max_len] ids padded with vocab_size -> [rows, vocab] occurrence counts (fp32)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids.long(), torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, plan: SamplingPlan) -> None:
    """Repetition (over prompt and output, divides positive logits), presence and frequency (over output)."""
    t, vocab = plan.t, logits.shape[1]
    if plan.num_repetition:
        rows = t["s_rep_rows"].long()
        sub, penalty = logits.index_select(0, rows), t["s_rep_penalty"][:, None]
        seen = _token_counts(t["s_rep_ids"], vocab) > 0
        logits.index_copy_(0, rows, torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub))
    if plan.num_presence:
        rows = t["s_pres_rows"].long()
        counts = _token_counts(t["s_pres_ids"], vocab)
        delta = (counts > 0) * t["s_presence"][:, None] + counts * t["s_frequency"][:, None]
        logits.index_copy_(0, rows, logits.index_select(0, rows) - delta)


def apply_bias(logits: torch.Tensor, plan: SamplingPlan) -> None:
    """embedding_bias: each biased row gets its request's [vocab] bias added."""
    if plan.num_biased:
        logits.index_add_(0, plan.t["s_bias_rows"].long(), plan.t["s_bias"])


def apply_bans(logits: torch.Tensor, plan: SamplingPlan) -> None:
    """Banned tokens (end_id before min_tokens, bad words), and under guided decoding every token the grammar
    does not allow next."""
    t = plan.t
    if plan.num_bans:
        rows = t["s_ban_rows"].long()
        logits.index_put_((rows, t["s_ban_tokens"].long()), logits.new_full(rows.shape, float("-inf")))
    if plan.num_guided:
        rows = t["s_guided_rows"].long()
        allowed = guided_tokens(t["s_bitmask"], logits.shape[1])
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def guided_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit t: token t allowed) -> [rows, vocab] bool."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> bits) & 1).reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h < 2^32 in int64, with no intermediate past 2^49."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer: a bijection of 32-bit values that mixes every bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(seed_key: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row (fp64), a function of the row's seed key and step only."""
    h = _fmix32(_fmix32(seed_key.long() & MASK32) ^ (step.long() & MASK32))
    return (h.double() + 0.5) / 2.0 ** 32


def sample_rows(logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p for all rows at once, then inverse-CDF sampling with each row's own
    uniform number. logits: [num_rows, vocab] fp32 -> tokens [num_rows] int64."""
    t = plan.t
    logits = logits / t["s_temperature"][:, None]
    if plan.any_min_p:                            # p < min_p * p_max, as logits: l < l_max + log(min_p)
        floor = logits.amax(-1, keepdim=True) + t["s_min_p"][:, None].log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if plan.max_top_k:
        top_k = t["s_top_k"].long()
        kth = torch.topk(logits, plan.max_top_k).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((logits < kth) & (top_k > 0)[:, None], float("-inf"))
    if plan.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= t["s_top_p"][:, None]      # keep the smallest set reaching top_p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    cdf = logits.softmax(-1).double().cumsum(-1)
    target = uniform(t["s_seed"], t["s_step"]) * cdf[:, -1]
    picks = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return picks.clamp(max=logits.shape[1] - 1)


def first_max(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """logits.argmax(-1), the first maximum of each row (NaN counting as one), in two passes: the max of each chunk
    of columns, then the argmax inside the first chunk holding the row's max. On CPU torch's argmax over a long row
    does not vectorize and amax does (docs/performance.md, "Figures behind the code")."""
    num_rows, vocab = logits.shape
    num_full = vocab // chunk
    if num_full < 2:
        return logits.argmax(-1)
    maxima = logits[:, :num_full * chunk].reshape(num_rows, num_full, chunk).amax(-1)     # [num_rows, num_full]
    if vocab > num_full * chunk:
        maxima = torch.cat([maxima, logits[:, num_full * chunk:].amax(-1, keepdim=True)], dim=1)
    start = maxima.argmax(-1, keepdim=True) * chunk                                        # [num_rows, 1]
    cols = (start + torch.arange(chunk, device=logits.device)).clamp_(max=vocab - 1)       # a short last chunk
    return (start + logits.gather(1, cols).argmax(-1, keepdim=True))[:, 0]                 # repeats its last column


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row [num_rows] int64: one kernel on CUDA, first_max's two passes on CPU."""
    return logits.argmax(-1) if logits.is_cuda else first_max(logits)


Top = tuple[torch.Tensor, torch.Tensor]     # the top alternatives' log probs [rows, k] fp32 and ids [rows, k] int64


def sample(logits: torch.Tensor, plan: SamplingPlan,
           greedy_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, Top | None]:
    """logits: [num_rows, vocab] fp32 on the device (modified in place), plan.t on the same device; greedy_tokens:
    greedy(logits) where the caller has them (a decode graph's), used where the plan keeps the logits as they are.
    Returns tokens [num_rows] int64, their log probs [num_rows] fp32 (None unless some row asked), and the
    plan.max_top_log_probs most likely tokens of each row (None unless some row asked). Log probs are those of the
    distribution after bias, penalties and bans, before temperature, min-p, top-k and top-p."""
    apply_bias(logits, plan)
    apply_penalties(logits, plan)
    apply_bans(logits, plan)
    tokens = greedy_tokens if greedy_tokens is not None and plan.keeps_logits else greedy(logits)
    if plan.any_sampled:
        tokens = torch.where(plan.t["s_greedy"] != 0, tokens, sample_rows(logits, plan))
    if not plan.any_log_probs:
        return tokens, None, None
    log_probs = torch.log_softmax(logits, dim=-1)
    top = None
    if plan.max_top_log_probs:
        values, ids = log_probs.topk(plan.max_top_log_probs)
        top = values, ids
    return tokens, log_probs.gather(1, tokens[:, None])[:, 0], top


class Sampler:
    """Both halves at once, for callers that hold logits and sequences (tests, tools)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        plan = prepare(seqs, logits.shape[1])
        plan.t = {name: t.to(logits.device) for name, t in plan.t.items()}
        tokens, log_probs, _ = sample(logits, plan)
        wanted = [seq.params.return_log_probs for seq in seqs]
        log_probs = [0.0] * len(seqs) if log_probs is None else log_probs.tolist()
        return tokens.tolist(), [lp if w else None for lp, w in zip(log_probs, wanted)]
