"""The start-up check of running a step ahead (overlap_steps) on the engine's device: a few probe requests with the
steps in turn, then one ahead; any difference in their tokens turns overlap off (`overlap_steps` among the
runner's fallbacks, with why), as the graphs' checks do for the graphs."""
import torch

from backend.core.request import SamplingParams
from backend.device import is_device_fault

PROBE_PROMPT_LENS = (5, 21, 40)               # prompts in one chunk and beside decodes
PROBE_NEW_TOKENS = 8


def check_overlap(engine) -> str | None:
    """Run the probes both ways on `engine` (started, idle); None if the tokens agree (or the engine is too small to
    hold them), else what differed. The engine's counters are as they were before."""
    vocab, blocks = engine.model_config.vocab_size, engine.blocks
    room = min(blocks.num_blocks * blocks.block_size // len(PROBE_PROMPT_LENS),
               engine.model_config.max_position_embeddings) - PROBE_NEW_TOKENS     # each probe fits beside the others
    if room < 1 or engine.config.max_queue_size < len(PROBE_PROMPT_LENS):
        return None                                # a cache or queue too small for probes: not checked
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(min(3, vocab - 1), vocab, (min(n, room),), generator=generator).tolist()
               for n in PROBE_PROMPT_LENS]
    counters = _counters(engine)
    tokens = {}
    try:
        engine.overlap = False
        tokens[False] = _generate(engine, prompts)
        engine.overlap = True
        tokens[True] = _generate(engine, prompts)
    except Exception as exc:
        if not engine.overlap or is_device_fault(exc):
            raise                                  # the engine itself fails, not the overlap
        _abort_all(engine)
        return f"overlap_steps: a probe failed one step ahead ({type(exc).__name__}: {exc}); steps run in turn"
    finally:
        _restore(engine, counters)
    if tokens[True] != tokens[False]:
        return (f"overlap_steps: probe tokens differ from the steps in turn ({tokens[True]} != {tokens[False]}); "
                "steps run in turn")
    return None


def _generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy and seeded-sampled probes to completion; their tokens by probe."""
    ids = [engine.add_request(prompt, SamplingParams(max_new_tokens=PROBE_NEW_TOKENS, ignore_end_id=True,
                                                     temperature=0.0 if i % 2 == 0 else 0.8, seed=i))
           for i, prompt in enumerate(prompts)]
    outputs = {request_id: [] for request_id in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.error:
                raise RuntimeError(out.error)
            outputs[out.request_id] += out.new_token_ids
    return [outputs[request_id] for request_id in ids]


def _abort_all(engine) -> None:
    for request_id in list(engine.seqs):
        engine.abort(request_id)
    engine.in_flight = None


def _counters(engine) -> dict:
    return {"num_steps": engine.num_steps, "num_generated_tokens": engine.num_generated_tokens,
            "last_step": engine.last_step, "last_step_kind": engine.last_step_kind,
            "lookups": engine.blocks.num_lookups, "hits": engine.blocks.num_hits,
            "num_preemptions": engine.scheduler.num_preemptions}


def _restore(engine, counters: dict) -> None:
    engine.num_steps, engine.num_generated_tokens = counters["num_steps"], counters["num_generated_tokens"]
    engine.last_step, engine.last_step_kind = counters["last_step"], counters["last_step_kind"]
    engine.blocks.num_lookups, engine.blocks.num_hits = counters["lookups"], counters["hits"]
    engine.scheduler.num_preemptions = counters["num_preemptions"]
