"""Log probs against PEFT in fp32, with adapters: the chosen tokens', their top alternatives and the prompt's (ranks
too), on every path (torch, the compiled CPU kernels, the Triton kernels in the interpreter, decode and piecewise
graphs' padded steps, a step ahead, tensor parallel), for prompts longer than a prefill chunk, n = 2, and a prefix
the cache holds; and the bounds that keep them from growing without limit."""
import math

import pytest
import torch

from backend import LLMEngine
from backend.core.request import RequestError
from tests.backend.model.test_graphs import count_graph_steps
from tests.helpers import CPU_BACKENDS, INTERPRETER_MARK, peft_model_with, random_prompts

ATOL = 1e-4
K = 4
TASKS = [1, None, 2, 4, 3]                    # the tiny adapters' ranks 4, 8, 16, 64 (None: the base model)
LENGTHS = [40, 9, 23, 17, 2]                  # 40 and 23 run in several chunks of 16; 2 has one prompt log prob
OPTIONS = [dict(return_prompt_log_probs=True, return_log_probs=True, top_log_probs=K),
           dict(return_log_probs=True),
           dict(return_prompt_log_probs=True, top_log_probs=2),
           dict(return_prompt_log_probs=True),
           dict(return_log_probs=True, top_log_probs=K, num_return_sequences=2, temperature=0.9, seed=5)]
MAX_NEW = 5
PATHS = ["torch", pytest.param("cpu", marks=CPU_BACKENDS[1].marks), pytest.param("triton", marks=INTERPRETER_MARK),
         pytest.param("graphs", marks=INTERPRETER_MARK), "ahead", "tp2"]


@pytest.fixture(scope="module")
def peft(tiny_model_dir, tiny_adapters):
    return peft_model_with(tiny_model_dir, tiny_adapters)


def reference(peft, tokens: list[int], task: int | None) -> torch.Tensor:
    """PEFT's log probs [len(tokens), vocab] at each position, with adapter a{task - 1} (None: the base model)."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        if task is None:
            with peft.disable_adapter():
                logits = peft(input_ids=ids).logits[0]
        else:
            peft.set_adapter(f"a{task - 1}")
            logits = peft(input_ids=ids).logits[0]
    return logits.float().log_softmax(-1)


def make_engine(model_dir, adapters, path: str, **kwargs) -> LLMEngine:
    backend = {"cpu": "cpu", "triton": "triton", "graphs": "triton"}.get(path, "torch")
    engine = LLMEngine(model_dir, dtype="float32", lora_dtype="float32", kernel_backend=backend, max_num_seqs=6,
                       max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20,
                       overlap_steps="true" if path == "ahead" else "false",
                       tensor_parallel_size=2 if path == "tp2" else 1, **kwargs)
    for task, path_ in enumerate(adapters, start=1):
        engine.add_lora_dir(task, path_)
    if path == "graphs":                      # padded steps as the graphs record them, run eagerly (CPU)
        engine.runner.start_graphs(engine.lora_cache, capture=False)
    return engine


def run(engine: LLMEngine, prompts, tasks, options) -> dict:
    """Each request's outputs by sequence: tokens, log probs, top ids and log probs; and its prompt's log probs."""
    ids = [engine.add_request(p, lora=t, max_new_tokens=MAX_NEW, **o) for p, t, o in zip(prompts, tasks, options)]
    got = {i: {"prompt": None} for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.error is None, out.error
            seq = got[out.request_id].setdefault(out.sequence_index, {"tokens": [], "log_probs": [], "top_ids": [],
                                                                      "top_log_probs": []})
            seq["tokens"] += out.new_token_ids
            seq["log_probs"] += out.log_probs
            seq["top_ids"] += out.top_ids
            seq["top_log_probs"] += out.top_log_probs
            if out.prompt_log_probs is not None:
                assert got[out.request_id]["prompt"] is None, "a prompt's log probs come once"
                got[out.request_id]["prompt"] = out.prompt_log_probs
    engine.close()
    return [got[i] for i in ids]


def check(peft, prompt: list[int], task: int | None, option: dict, got: dict) -> None:
    n, k = option.get("num_return_sequences", 1), option.get("top_log_probs", 0)
    num_prompt = len(prompt)
    for index in range(n):
        seq = got[index]
        assert len(seq["tokens"]) == MAX_NEW
        want = reference(peft, prompt + seq["tokens"], task)
        rows = want[num_prompt - 1:-1]                                    # the rows that chose each new token
        chosen = rows.gather(1, torch.tensor(seq["tokens"])[:, None])[:, 0]
        if "temperature" not in option:
            assert seq["tokens"] == rows.argmax(-1).tolist()             # greedy: PEFT's tokens
        if option.get("return_log_probs"):
            torch.testing.assert_close(torch.tensor(seq["log_probs"]), chosen, atol=ATOL, rtol=0)
        else:
            assert seq["log_probs"] == []
        if k:
            top = rows.topk(k)
            assert seq["top_ids"] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(seq["top_log_probs"]), top.values, atol=ATOL, rtol=0)
        else:
            assert seq["top_ids"] == []
    scored = got["prompt"]
    if not option.get("return_prompt_log_probs"):
        assert scored is None
        return
    want = reference(peft, prompt, task)[:-1]                             # position i - 1 scores token i
    targets = torch.tensor(prompt[1:])[:, None]
    chosen = want.gather(1, targets)
    assert scored.log_probs.shape == (num_prompt,) and math.isnan(scored.log_probs[0])
    torch.testing.assert_close(scored.log_probs[1:], chosen[:, 0], atol=ATOL, rtol=0)
    assert scored.ranks.tolist() == [0] + ((want > chosen).sum(-1) + 1).tolist()
    assert scored.top_ids.shape == (num_prompt, k) and scored.top_ids[0].tolist() == [-1] * k
    if k:
        top = want.topk(k)
        assert scored.top_ids[1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(scored.top_log_probs[1:], top.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_log_probs_equal_pefts_on_every_path(tiny_model_dir, tiny_adapters, peft, path):
    engine = make_engine(tiny_model_dir, tiny_adapters, path)
    replays = count_graph_steps(engine.runner.graphs) if path == "graphs" else None
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size, seed=61)
    got = run(engine, prompts, TASKS, OPTIONS)
    assert replays is None or replays, "decode steps went through the graphs' padded steps"
    for prompt, task, option, result in zip(prompts, TASKS, OPTIONS, got):
        check(peft, prompt, task, option, result)


@pytest.mark.parametrize("path", ["torch", "ahead"])
def test_a_prompt_scored_alone_comes_with_the_first_token(tiny_model_dir, tiny_adapters, peft, path):
    """No other log probs and no forks in the batch: the first token still brings the prompt's."""
    engine = make_engine(tiny_model_dir, tiny_adapters, path)
    prompts = random_prompts([19, 6], engine.model_config.vocab_size, seed=63)
    options = [dict(return_prompt_log_probs=True), {}]
    for prompt, task, option, result in zip(prompts, [3, None], options, run(engine, prompts, [3, None], options)):
        check(peft, prompt, task, option, result)


def test_a_prompt_scored_does_not_reuse_a_cached_prefix(tiny_model_dir, tiny_adapters, peft):
    """The cache holds the prompt's blocks (the first request's), which have no logits: the scored request
    computes its prompt again and gives the same numbers."""
    engine = make_engine(tiny_model_dir, tiny_adapters, "torch", enable_kv_cache_reuse=True)
    prompt = random_prompts([50], engine.model_config.vocab_size, seed=62)[0]
    engine.generate([prompt], max_new_tokens=2, lora_task_ids=[2])
    option = dict(return_prompt_log_probs=True, top_log_probs=3)
    request_id = engine.add_request(prompt, lora=2, max_new_tokens=MAX_NEW, **option)
    got, reused = {"prompt": None, 0: {"tokens": [], "log_probs": [], "top_ids": [], "top_log_probs": []}}, []
    while engine.has_unfinished:
        for out in engine.step():
            got[0]["tokens"] += out.new_token_ids
            got[0]["top_ids"] += out.top_ids
            got[0]["top_log_probs"] += out.top_log_probs
            got["prompt"] = out.prompt_log_probs if out.prompt_log_probs is not None else got["prompt"]
            reused.append(out.metrics.num_reused_blocks)
    assert out.request_id == request_id and max(reused) == 0
    engine.generate([prompt], max_new_tokens=1, lora_task_ids=[2])           # a request that does not score: reused
    assert engine.blocks.num_hits > 0
    check(peft, prompt, 2, option, got)


def test_log_probs_past_the_limits_are_refused_by_name(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20,
                       max_top_log_probs=5, max_log_probs_per_request=600)
    with pytest.raises(RequestError) as err:
        engine.add_request([5, 6, 7], max_new_tokens=4, top_log_probs=6)
    assert err.value.field == "num_top_log_probs" and "max_top_log_probs" in err.value.message
    with pytest.raises(RequestError) as err:                          # (5 + 1) x (99 + 4 x 2) = 642 > 600
        engine.add_request(list(range(3, 103)), max_new_tokens=4, top_log_probs=5, return_log_probs=True,
                           return_prompt_log_probs=True, num_return_sequences=2, temperature=1.0)
    assert err.value.field == "num_top_log_probs" and "max_log_probs_per_request 600" in err.value.message
    engine.add_request(list(range(3, 103)), max_new_tokens=1, top_log_probs=5, return_prompt_log_probs=True)  # 600
    with pytest.raises(RequestError, match="runtime_min_p"):
        engine.add_request([5, 6, 7], min_p=1.5)
