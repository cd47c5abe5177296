"""Sampling: seeds reproduce, filters restrict, penalties and bans change logits as specified."""
import pytest
import torch

from backend import LLMEngine
from backend.core.request import SamplingParams, Sequence
from backend.core.sampler import Sampler, apply_bans, apply_penalties, first_max, prepare, sample
from tests.helpers import DEVICES, random_prompts


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)


@pytest.fixture(scope="module")
def prompts(engine):
    return random_prompts([4, 13, 21], engine.model_config.vocab_size, seed=5)


def test_same_seed_same_output_different_seed_different_output(engine, prompts):
    kw = dict(max_new_tokens=16, temperature=1.5)
    first = engine.generate(prompts, seed=1234, **kw)
    assert engine.generate(prompts, seed=1234, **kw) == first
    assert engine.generate(prompts, seed=99, **kw) != first


def test_top_k_one_equals_greedy(engine, prompts):
    greedy = engine.generate(prompts, max_new_tokens=10)
    assert engine.generate(prompts, max_new_tokens=10, temperature=2.0, top_k=1, seed=3) == greedy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows,vocab", [(1, 49152), (32, 49152), (5, 32000), (3, 5000), (2, 1500), (4, 2048)])
def test_first_max_is_argmax_with_its_ties_nans_and_bans(device, num_rows, vocab):
    g = torch.Generator().manual_seed(vocab + num_rows)
    logits = torch.randn(num_rows, vocab, generator=g)
    few_values = torch.randint(0, 3, (num_rows, vocab), generator=g).float()        # ties in every chunk
    assert torch.equal(first_max(logits.to(device)), logits.argmax(-1).to(device))
    assert torch.equal(first_max(few_values.to(device)), few_values.argmax(-1).to(device))
    edges = torch.full((4, vocab), float("-inf"))                                    # everything banned but one
    edges[0, vocab - 1] = 0.0                                                       # the last column
    edges[1, [vocab // 3, vocab - 2]] = 7.0                                         # a tie across chunks
    edges[2, [vocab // 2, vocab - 1]] = float("nan")                                # NaN counts as the max
    edges[3, 0] = float("inf")
    assert first_max(edges.to(device)).tolist() == [vocab - 1, vocab // 3, vocab // 2, 0]
    for values in (edges, few_values):                   # sample's own greedy pick (on CUDA one argmax kernel)
        greedy = prepare([Sequence(i, [0], SamplingParams()) for i in range(values.shape[0])], vocab)
        tokens, log_probs, _ = sample(values.to(device), greedy)
        assert torch.equal(tokens, first_max(values.to(device))) and log_probs is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_only_pick_allowed_tokens(device):
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]], device=device)
    picks_k, picks_p = set(), set()
    for seed in range(60):
        seq_k = Sequence(0, [0], SamplingParams(temperature=5.0, top_k=2, seed=seed))
        seq_p = Sequence(0, [0], SamplingParams(temperature=1.0, top_p=0.5, seed=seed))
        picks_k.add(Sampler().sample(logits.clone(), [seq_k])[0][0])
        picks_p.add(Sampler().sample(logits.clone(), [seq_p])[0][0])
    assert picks_k == {1, 2}
    assert picks_p == {1, 2}                              # p(1) = 0.42 < 0.5, so the second token is kept too


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_samples_the_same_alone_or_in_a_mixed_batch(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(temperature=1.3, top_p=0.6, seed=2),
              SamplingParams(), SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=3)]
    batch = Sampler().sample(logits.clone(), [Sequence(i, [0], p) for i, p in enumerate(params)])[0]
    alone = [Sampler().sample(logits[i:i + 1].clone(), [Sequence(i, [0], p)])[0][0] for i, p in enumerate(params)]
    assert batch == alone
    assert batch[2] == int(logits[2].argmax())


@pytest.mark.parametrize("device", DEVICES)
def test_each_rows_penalties_bans_and_bias_act_on_that_row_alone_in_a_mixed_batch(device):
    vocab = 50
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    bias = torch.zeros(vocab)
    bias[7] = 100.0
    params = [SamplingParams(), SamplingParams(repetition_penalty=3.0), SamplingParams(end_id=9, min_tokens=4,
                                                                                      bad_words=[[3, 4]]),
              SamplingParams(embedding_bias=bias.numpy()), SamplingParams(temperature=0.8, seed=4,
                                                                          presence_penalty=1.0)]
    logits[1, 2], logits[1, 10] = 5.0, 4.0                      # seen token 2 loses to 10 under the penalty
    logits[2, 9], logits[2, 4], logits[2, 11] = 50.0, 40.0, 30.0   # end_id 9 and bad word [3, 4] banned: 11
    seqs = [Sequence(i, [1, 2, 3], p) for i, p in enumerate(params)]
    for seq in seqs:
        seq.output_ids = [5, 3]
    batch = Sampler().sample(logits.clone(), seqs)[0]
    alone = [Sampler().sample(logits[i:i + 1].clone(), [seq])[0][0] for i, seq in enumerate(seqs)]
    assert batch == alone
    assert batch[:4] == [int(logits[0].argmax()), 10, 11, 7]
    assert prepare(seqs[:1] * 3, vocab).t == {}                   # plain greedy rows: nothing to upload


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = Sequence(0, [0, 1], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    seq.output_ids = [2, 2]
    apply_penalties(logits, prepare([seq], 4))
    # repetition over prompt + output: 0 -> 2/2, 1 -> -2*2, 2 -> 1/2; presence/frequency over output: 2 -= .5+.5
    assert torch.allclose(logits, torch.tensor([[1.0, -4.0, -0.5, 0.5]]))


def test_min_tokens_bans_end_id_and_bad_words_ban_their_last_token():
    logits = torch.zeros(1, 6)
    seq = Sequence(0, [4, 3], SamplingParams(end_id=5, min_tokens=2, bad_words=[[1], [4, 3, 2], [0, 0]]))
    apply_bans(logits, prepare([seq], 6))
    assert logits[0].tolist() == [0.0, float("-inf"), float("-inf"), 0.0, 0.0, float("-inf")]


def test_end_id_stop_words_and_min_tokens_end_generation(engine, prompts):
    [free] = engine.generate(prompts[:1], max_new_tokens=12)
    end_id = free[3]
    first = free.index(end_id)
    [stopped] = engine.generate(prompts[:1], max_new_tokens=12, end_id=end_id)
    assert stopped == free[:first + 1]
    [worded] = engine.generate(prompts[:1], max_new_tokens=12, stop_words=[free[4:6]])
    assert worded[-2:] == free[4:6] and len(worded) <= 6
    [long] = engine.generate(prompts[:1], max_new_tokens=12, end_id=end_id, min_tokens=first + 2)
    assert len(long) >= first + 2 and end_id not in long[:first + 2]


def test_log_probs_are_the_log_softmax_of_the_chosen_token(engine, prompts):
    request_id = engine.add_request(prompts[1], max_new_tokens=5, return_log_probs=True)
    log_probs = []
    while engine.has_unfinished:
        for out in engine.step():
            log_probs += out.log_probs
    assert len(log_probs) == 5 and all(-30 < lp <= 0 for lp in log_probs)
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    seq = Sequence(request_id, [0], SamplingParams(return_log_probs=True))
    tokens, lps = Sampler().sample(logits.clone(), [seq])
    assert tokens == [2] and lps[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


def test_counter_based_draws_are_uniform_and_depend_on_seed_and_step():
    from backend.core.sampler import uniform
    steps = torch.arange(20000, dtype=torch.int32)
    u = uniform(torch.full_like(steps, 12345), steps)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    assert torch.histc(u.float(), bins=10, min=0, max=1).min() > 1800                # no empty or thin bin
    other = uniform(torch.full_like(steps, 12346), steps)
    assert (u == other).float().mean() < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_keeps_only_tokens_near_the_most_likely(device):
    """min_p 0.3: tokens under 0.3 x the top token's probability (after temperature) are never drawn; greedy rows
    ignore it."""
    probs = torch.tensor([0.5, 0.2, 0.14, 0.1, 0.06])              # 0.3 x 0.5 = 0.15: the first two stay
    logits = probs.log()[None].repeat(64, 1).to(device)
    seqs = [Sequence(i, [0], SamplingParams(temperature=1.0, min_p=0.3, seed=i)) for i in range(64)]
    picks = set(Sampler().sample(logits.clone(), seqs)[0])
    assert picks == {0, 1}
    seqs = [Sequence(i, [0], SamplingParams(temperature=1.0, seed=i)) for i in range(64)]
    assert set(Sampler().sample(logits.clone(), seqs)[0]) - {0, 1}          # without it the others come too
