"""The embedded transformers engine: sampling against naive references, in-place weight loads."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from vapo_megatron.rollout.base import Continuation, SamplingParams
from vapo_megatron.rollout.buckets import group_into_buckets
from vapo_megatron.rollout.embedded import EmbeddedEngine, filter_logits

EOS = 3


def tiny_config(tie=True):
    return Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS, tie_word_embeddings=tie,
    )


def random_prompts(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (k,), generator=g)]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return EmbeddedEngine.from_hf_config(tiny_config())


def naive_logprobs(model, prompt, response, temperature):
    """One full forward without cache or padding: log_softmax(logits / T) of each response token."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [lp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]


def test_sampled_logprobs_match_a_full_forward(engine):
    prompts = random_prompts(6)
    p = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=5)
    outs = engine.generate(prompts, p)
    assert [o.prompt_index for o in outs] == [i for i in range(6) for _ in range(3)]
    for o in outs:
        ref = naive_logprobs(engine.model, prompts[o.prompt_index], o.token_ids, 0.7)
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(ref), atol=1e-5)
        assert len(o.token_ids) == 10 or (o.finish_reason == "stop" and o.token_ids[-1] == EOS)


def test_greedy_equals_naive_argmax_loop(engine):
    prompts = random_prompts(5, seed=1)
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    for o in outs:
        seq = list(prompts[o.prompt_index])
        ref = []
        for _ in range(8):
            with torch.no_grad():
                tok = int(engine.model(torch.tensor([seq])).logits[0, -1].argmax())
            ref.append(tok)
            seq.append(tok)
            if tok == EOS:
                break
        assert o.token_ids == ref


def test_reproducible_and_independent_of_batching(engine):
    prompts = random_prompts(8, seed=2)
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=11)
    full = engine.generate(prompts, p)
    engine.max_batch_size = 4  # one prompt per chunk now
    try:
        chunked = engine.generate(prompts, p)
    finally:
        engine.max_batch_size = 1024
    assert [o.token_ids for o in full] == [o.token_ids for o in chunked]
    other = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=12))
    assert [o.token_ids for o in full] != [o.token_ids for o in other]
    # the n samples of a prompt differ from each other
    assert len({tuple(o.token_ids) for o in full[:4]}) > 1


def test_stop_token_ids_end_a_sample(engine):
    prompts = random_prompts(4, seed=3)
    free = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=0))
    stop_id = free[0].token_ids[2]  # a token the first sample is known to produce at step 3
    outs = engine.generate(prompts,
                           SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=0, stop_token_ids=(stop_id,)))
    for f, o in zip(free, outs):
        stops = [k for k, t in enumerate(f.token_ids) if t in (stop_id, EOS)]
        if stops:
            assert o.finish_reason == "stop" and o.token_ids == f.token_ids[: stops[0] + 1]
        else:
            assert o.finish_reason == "length" and o.token_ids == f.token_ids
    assert outs[0].token_ids == free[0].token_ids[:3]


@pytest.mark.parametrize("temperature", [0.9, 0.0])
def test_a_response_grown_in_pieces_is_the_response_generated_in_one_go(engine, temperature):
    """Partial rollout (issue 47): a carried-over response continued by prefilling prompt + response
    so far, in pieces of 1 to 5 tokens, batched with other responses at other lengths, is the
    one-go response of its seed: the same tokens and finish reason, and log-probs equal to a full
    forward's (the prefill computes in other shapes than the decode, so to float tolerance)."""
    prompts = random_prompts(6, seed=4)
    p = SamplingParams(n=2, temperature=temperature, top_k=40, max_new_tokens=14, seed=21, stop_token_ids=(9,))
    whole = engine.generate(prompts, p)
    grown = [[] for _ in whole]
    logps = [[] for _ in whole]
    finish = [None] * len(whole)
    for piece in range(99):
        open_rows = [b for b, f in enumerate(finish) if f is None]
        if not open_rows:
            break
        reqs = [Continuation(prompts[b // 2], grown[b], p.sample_seed(b // 2, b % 2),
                             min(1 + (b + piece) % 5, p.max_new_tokens - len(grown[b]))) for b in open_rows]
        for b, o in zip(open_rows, engine.extend(reqs, p)):
            assert len(o.token_ids) <= reqs[open_rows.index(b)].max_new_tokens
            grown[b] += o.token_ids
            logps[b] += o.logprobs
            if o.finish_reason == "stop" or len(grown[b]) == p.max_new_tokens:
                finish[b] = o.finish_reason
    assert grown == [o.token_ids for o in whole] and finish == [o.finish_reason for o in whole]
    assert any(0 < len(o.token_ids) < p.max_new_tokens for o in whole) or temperature == 0  # some stopped early
    for b, o in enumerate(whole):
        if temperature > 0:
            ref = naive_logprobs(engine.model, prompts[b // 2], o.token_ids, temperature)
            assert torch.allclose(torch.tensor(logps[b]), torch.tensor(ref), atol=1e-5)


def test_sampling_frequencies_follow_filtered_softmax():
    # Independent reference, by hand: keep the top k, renormalize, then keep the smallest
    # prefix (by probability) whose mass reaches top_p (SGLang's order: top-k, then top-p).
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.8, top_k=4, top_p=0.8)
    probs = torch.softmax(logits[0] / 0.8, -1)
    top4 = probs.argsort(descending=True)[:4].tolist()
    renorm = probs[top4] / probs[top4].sum()
    keep = torch.zeros(6, dtype=torch.bool)
    mass = 0.0
    for i, q in zip(top4, renorm.tolist()):
        if mass >= 0.8:
            break
        keep[i] = True
        mass += q
    assert 1 < int(keep.sum()) < 4  # both filters matter for these numbers
    ref = torch.where(keep, probs, torch.zeros(6))
    ref = ref / ref.sum()
    gens = [torch.Generator().manual_seed(s) for s in range(20000)]
    tok, logp = EmbeddedEngine._sample(logits.expand(20000, 6), gens, p)
    freq = torch.bincount(tok, minlength=6).float() / 20000
    assert torch.allclose(freq, ref, atol=0.015), (freq, ref)
    assert torch.allclose(logp, torch.log(probs)[tok], atol=1e-6)
    assert filter_logits(logits / 0.8, 4, 0.8).isinf().tolist() == [[not k for k in keep.tolist()]]


def test_weights_load_in_place_and_match_the_source_model():
    torch.manual_seed(1)
    eng = EmbeddedEngine.from_hf_config(tiny_config(tie=False))
    source = AutoModelForCausalLM.from_config(tiny_config(tie=False))
    before = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    eng.begin_weight_update()
    for bucket in group_into_buckets(source.state_dict().items(), 4096):
        eng.load_bucket(bucket)
    eng.end_weight_update(version=7)
    assert eng.weight_version == 7
    assert before == {n: p.data_ptr() for n, p in eng.model.named_parameters()}  # same storage
    ids = torch.tensor([random_prompts(1)[0]])
    with torch.no_grad():
        assert torch.equal(eng.model(ids).logits, source(ids).logits)


def test_tied_embeddings_accept_either_name_and_bad_names_are_named():
    eng = EmbeddedEngine.from_hf_config(tiny_config(tie=True))
    w = torch.randn(96, 32)
    eng.begin_weight_update()
    eng.load_bucket([("lm_head.weight", w)])
    assert torch.equal(eng.model.model.embed_tokens.weight, w)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.qkv_proj.weight"):
        eng.load_bucket([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.load_bucket([("model.norm.weight", torch.zeros(5))])
    with pytest.raises(RuntimeError, match="parameters unset"):
        eng.end_weight_update(version=1)
