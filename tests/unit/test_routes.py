"""Routing replay's data (data/routes.py): the embedded engine's routes against transformers' own
router outputs, the batch's routes through packing and micro-batch selection, SGLang's encoding."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout.embedded import EmbeddedEngine

EOS = 2


@pytest.fixture(scope="module")
def moe_engine():
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_hf import qwen3_moe_config, randomize

    cfg = qwen3_moe_config(vocab=96)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed=3)  # well-separated router scores: no near-ties between the two computations
    return EmbeddedEngine(model, eos_token_ids=[EOS])


PROMPTS = [[5, 9, 11, 40], [7, 3], [60, 61, 62, 63, 64, 65]]


def test_embedded_engine_returns_the_experts_transformers_routes_each_token_to(moe_engine):
    outs = moe_engine.generate(PROMPTS,
                               SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=4, return_routes=True))
    model = moe_engine.model
    moe_layers = [i for i in range(4) if i != 2]  # qwen3_moe_config: layer 2 is dense
    for o in outs:
        prompt = PROMPTS[o.prompt_index]
        seq = prompt + o.token_ids
        assert o.routes.dtype == torch.uint8 and o.routes.shape == (len(seq) - 1, len(moe_layers), 2)
        # Reference: one teacher-forced forward of every token the engine ran (all but the last),
        # transformers' own router logits (output_router_logits), top-2 of their softmax.
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]]), output_router_logits=True).router_logits
        assert len(logits) == len(moe_layers)
        want = torch.stack([torch.topk(torch.softmax(x.float(), -1), 2, dim=-1).indices for x in logits], dim=1)
        assert torch.equal(o.routes.long().sort(-1).values, want.sort(-1).values)
    assert torch.equal(outs[0].routes[: len(PROMPTS[0])], outs[1].routes[: len(PROMPTS[0])])  # one prefill per prompt
    plain = moe_engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=3, seed=4))
    assert plain[0].routes is None and moe_engine.recorder.calls == []  # not asked: nothing recorded


def test_a_dense_engine_refuses_to_return_routes():
    from tests.helpers.tiny_hf import qwen2_config

    engine = EmbeddedEngine.from_hf_config(qwen2_config(tied=False, vocab=96))
    with pytest.raises(ValueError, match="no mixture-of-experts routers"):
        engine.generate([[4, 5]], SamplingParams(max_new_tokens=2, return_routes=True))


def test_batch_routes_sit_at_their_tokens_and_follow_micro_batches():
    from vapo_megatron.data.batch import RolloutBatch, pack_sequences
    from vapo_megatron.data.routes import pack_routes, routed_positions

    prompts, responses = [[1, 2, 3], [4, 5], [6]], [[7, 8], [9, 10, 11, 12], [13]]
    rows = [torch.randint(0, 8, (len(p) + len(r) - 1, 3, 2), dtype=torch.uint8) for p, r in zip(prompts, responses)]
    tokens, pl, rl = pack_sequences(prompts, responses)
    routes = pack_routes(rows, tokens.shape[1], 2)
    assert routes.shape == (3, 6, 3, 2) and routes.dtype == torch.uint8
    for b, r in enumerate(rows):
        assert torch.equal(routes[b, : len(r)], r)
        assert (routes[b, len(r):] == torch.tensor([0, 1], dtype=torch.uint8)).all()  # placeholders, never routed
    batch = RolloutBatch(tokens=tokens, prompt_lens=pl, response_lens=rl, rewards=torch.zeros(3),
                         correct=torch.zeros(3, dtype=torch.bool), group_ids=torch.arange(3), routes=routes)
    part = batch.select([2, 0])  # trimmed to its longest sequence (5 tokens)
    assert part.routes.shape == (2, 5, 3, 2) and torch.equal(part.routes[1, :4], rows[0])
    # The response tokens the engine routed: P .. P + R - 2.
    assert routed_positions(pl, rl, 6).tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("experts,k,ep", [(4, 2, 2), (6, 4, 3), (128, 8, 8)])
def test_positions_without_a_route_spread_over_the_experts_and_the_ep_ranks(experts, k, ep):
    """Issue 55 item 4: a micro-batch's routes as its routers take them (replay_routes, megatron's
    sequence-major token order): the engine's where it routed, and where it did not (the last
    token, padding) k distinct experts per token, spread so that every EP rank (E / EP contiguous
    experts each) gets its share of the padding; experts 0..k-1 sent all of it to EP rank 0."""
    from vapo_megatron.data.routes import id_dtype, replay_routes

    b, width, layers = 4, 40, 3
    seq_lens = torch.tensor([9, 40, 3, 17])
    gen = torch.Generator().manual_seed(0)
    routes = torch.randint(0, experts, (b, 40, layers, k), generator=gen).to(id_dtype(experts))
    out = replay_routes(routes, seq_lens, width, experts)
    assert out.shape == (layers, width * b, k) and out.dtype == routes.dtype and out.is_contiguous()
    tokens = out.view(layers, width, b, k)  # token s * b + i
    unrouted = []
    for i in range(b):
        n = int(seq_lens[i]) - 1  # the engine routed positions 0 .. n - 1
        assert torch.equal(tokens[:, :n, i], routes[i, :n].transpose(0, 1))
        unrouted.append(tokens[:, n:, i])
    pad = torch.cat(unrouted, dim=1).long()  # [L, padded tokens, k]
    assert all(len(set(row.tolist())) == k for row in pad.reshape(-1, k))  # k distinct experts each
    per_rank = torch.bincount((pad // (experts // ep)).flatten(), minlength=ep).float()
    assert per_rank.min() / per_rank.max() > 0.8, per_rank  # before: everything on rank 0
    # Under sequence parallelism a TP rank takes its positions' tokens, the same ids.
    half = replay_routes(routes, seq_lens, width, experts, part=(20, 20))
    assert torch.equal(half, tokens[:, 20:].reshape(layers, -1, k))


def test_sglang_routes_decode_what_sglang_encodes():
    import numpy as np

    from tests.helpers.sglang_doubles import decode_routes, encode_routes
    from vapo_megatron.data.routes import sglang_routes

    ids = torch.randint(0, 128, (5, 3, 8), dtype=torch.int32)
    encoded = encode_routes(ids)  # SGLang's detokenizer, from its source
    assert np.array_equal(decode_routes(encoded), ids.flatten().numpy())  # and SGLang's own decoder reads it
    got = sglang_routes(encoded, rows=5, layers=3, k=8, num_experts=128, where="x")
    assert got.dtype == torch.uint8 and torch.equal(got.long(), ids.long())
    with pytest.raises(RuntimeError, match=r"x: SGLang returned 120 routed-expert ids, expected 6 tokens x 3 MoE"):
        sglang_routes(encoded, rows=6, layers=3, k=8, num_experts=128, where="x")
    with pytest.raises(RuntimeError, match=r"outside 0..99"):
        sglang_routes(encoded, rows=5, layers=3, k=8, num_experts=100, where="x")
