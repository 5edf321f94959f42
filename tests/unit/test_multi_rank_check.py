"""vapo-check --ranks' parts that need no engine (nodecheck/multi_rank.py, ranks_mode.py): the model
it derives from each preset, SGLang's routed experts as SGLang encodes them decoded into the batch
the trainer replays, and the verdicts on hand-built numbers. Its run on real SGLang engines:
tests/distributed/test_sglang_colocated_real.py; its flags: test_check_ranks_arguments.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.sglang_doubles import encode_routes
from vapo_megatron.nodecheck.multi_rank import (
    LOGP_TOL,
    MISMATCH_TOL,
    Sampled,
    answers_batch,
    logprob_verdict,
    route_problems,
    routes_verdict,
    unusable,
)
from vapo_megatron.nodecheck.ranks_mode import HEAD_DIM, ranks_model
from vapo_megatron.rollout.sglang_requests import parse_output

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-qwen3-moe")  # vapo-check's default presets


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_family_preset_splits_over_the_trainer_and_sglangs_tp(tp):
    from model_providers.presets import preset
    from vapo_megatron.config.layout import layout_problems
    from vapo_megatron.data.routes import moe_layers

    for name in FAMILIES:
        hf, cfg = preset(name), ranks_model(name, tp)
        assert layout_problems(tp, tp, 1, None, model={**cfg, "_source": name}) == [], (name, tp)
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        assert heads % tp == 0 and kv % tp == 0 and heads * hf["num_key_value_heads"] == kv * hf["num_attention_heads"]
        assert cfg.get("head_dim", cfg["hidden_size"] // heads) == HEAD_DIM
        if "head_dim" in hf:  # a preset's own odd hidden size stays
            assert cfg["hidden_size"] == hf["hidden_size"]
        for key in ("intermediate_size", "moe_intermediate_size"):
            if key in hf:
                assert cfg[key] % (16 * tp) == 0 and hf[key] <= cfg[key] < hf[key] + 16 * tp
        if "num_experts" in hf:  # SGLang's Qwen3-MoE builds experts in every layer
            assert moe_layers({**cfg, "_source": name}) == list(range(hf["num_hidden_layers"]))
        same = {k for k in hf if k not in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                                          "intermediate_size", "moe_intermediate_size", "mlp_only_layers")}
        assert {k: cfg[k] for k in same} == {k: hf[k] for k in same}, name


def _answer(prompt_len: int, tokens: list[int], routes: torch.Tensor | None) -> dict:
    """One SGLang generate result as tokenizer_manager returns it, routes encoded by SGLang's own detokenizer."""
    meta = {"finish_reason": {"type": "length"},
            "output_token_logprobs": [(-0.5 - 0.1 * i, t, None) for i, t in enumerate(tokens)]}
    if routes is not None:
        meta["routed_experts"] = encode_routes(routes)
    return {"output_ids": tokens, "meta_info": meta}


SHAPE = (2, 2, 4)  # MoE layers, top-k, experts


def _sampled(prompts, answers, routes) -> Sampled:
    outs = [parse_output(_answer(len(p), a, r), i, 1, prompt_len=len(p), routes=SHAPE)
            for i, (p, a, r) in enumerate(zip(prompts, answers, routes))]
    return Sampled(prompts=prompts, tokens=[o.token_ids for o in outs], logprobs=[o.logprobs for o in outs],
                   routes=[o.routes for o in outs], engines=1, errors=[])


def test_sglangs_encoded_routes_become_the_batch_the_trainer_replays():
    prompts, answers = [[5, 6, 7], [8, 9, 10, 11]], [[20, 21, 22], [23, 24]]
    # Rows: every prompt token and every answer token but the last; distinct experts per token and layer.
    routes = [torch.tensor([[[r % 4, (r + 1) % 4], [(r + 2) % 4, (r + 3) % 4]] for r in range(len(p) + len(a) - 1)])
              for p, a in zip(prompts, answers)]
    s = _sampled(prompts, answers, routes)
    assert [torch.equal(got.long(), want) for got, want in zip(s.routes, routes)] == [True, True]
    assert route_problems(s, k=2) == [] and unusable(s) is None
    batch, engine_logp = answers_batch(s, k=2)
    assert batch.routes.shape == (2, 6, 2, 2)
    for b, want in enumerate(routes):
        assert torch.equal(batch.routes[b, : len(want)].long(), want)  # row p: the token at sequence position p
    # The engine's log-prob of answer token j sits where the trainer predicts it: position P - 1 + j.
    assert engine_logp[0, 2:5].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert engine_logp[1, 3:5].tolist() == pytest.approx([-0.5, -0.6])
    assert batch.mask[0].tolist() == [0, 0, 1, 1, 1, 0] and batch.mask[1].tolist() == [0, 0, 0, 1, 1, 0]


def test_routes_sglang_could_not_have_routed_are_named():
    prompts, answers = [[5, 6, 7], [8, 9, 10, 11]], [[20, 21, 22], [23, 24]]
    good = torch.tensor([[[0, 1], [2, 3]]] * 5)
    unwritten = torch.zeros(5, 2, 2, dtype=torch.long)  # a capture buffer never filled reads as expert 0, k times
    s = _sampled(prompts, answers, [good, unwritten])
    assert route_problems(s, k=2) == ["answer 1: 5 tokens with an expert twice in one layer"]
    # A row count that is not the answer's (decoding checks only the size): the check names the answer.
    short = Sampled(prompts=s.prompts, tokens=s.tokens, logprobs=s.logprobs, routes=[good[:4], good], engines=1,
                    errors=[])
    assert route_problems(short, k=2) == ["answer 0: routes (4, 2, 2) for 3 prompt + 3 answer tokens, top-2"]
    # SGLang's own size check when decoding: too few ids for prompt + answer - 1 rows.
    with pytest.raises(RuntimeError, match="expected 5 tokens x 2 MoE layers x top-2"):
        parse_output(_answer(3, [20, 21, 22], good[:4]), 0, 1, prompt_len=3, routes=SHAPE)


def test_answers_that_cannot_be_compared_say_why():
    base = dict(prompts=[[1, 2]], tokens=[[3, 4]], routes=None, engines=2)
    assert unusable(Sampled(**base, logprobs=[[-1.0, -2.0]], errors=[])) is None
    assert unusable(Sampled(**base, logprobs=[[-1.0, -2.0]], errors=["rank 1: RuntimeError: boom"])) == \
        "generate failed: rank 1: RuntimeError: boom"
    assert "without a log-prob per token" in unusable(Sampled(**base, logprobs=[None], errors=[]))
    assert unusable(Sampled(prompts=[[1]], tokens=[[]], logprobs=[[]], routes=None, engines=1, errors=[])) == \
        "the engines returned no answer tokens"


def test_the_verdicts_on_hand_built_numbers():
    mask = torch.tensor([[0.0, 1, 1, 0]])
    trainer = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    tol = LOGP_TOL[torch.bfloat16]
    # off-mask ignored
    assert logprob_verdict(trainer, trainer + torch.tensor([[9.0, 0.05, -0.08, 9.0]]), mask, tol)[0] == "PASS"
    status, figures = logprob_verdict(trainer, trainer + torch.tensor([[0.0, 0.05, 0.3, 0.0]]), mask, tol)
    assert status == "FAIL" and "max |engine - trainer log-prob| 0.3" in figures and "2 answer tokens" in figures
    assert logprob_verdict(trainer, trainer, torch.zeros_like(mask), tol)[0] == "FAIL"  # nothing compared
    assert routes_verdict(0.02, 0.03, 0.2, tol)[0] == "PASS"
    assert routes_verdict(MISMATCH_TOL + 0.01, 0.03, 0.2, tol)[0] == "FAIL"  # the routers disagree with the routes
    assert routes_verdict(0.02, 0.05, 0.04, tol)[0] == "FAIL"  # replay moved the log-probs away from SGLang's
    assert routes_verdict(0.02, 0.2, 0.3, tol)[0] == "FAIL"  # closer, but not within the tolerance


def test_the_model_written_for_each_family_is_the_reshaped_preset_with_peaked_predictions(tmp_path):
    """write_model: the family's own transformers class saves what ranks_model gives (read back as the
    trainer reads it), with weights that give logits of unit scale, so that a wrong weight in the
    engine moves the log-probs sglang_sync compares well past its tolerance."""
    from transformers import AutoModelForCausalLM

    import model_providers
    from vapo_megatron.data.routes import route_shape
    from vapo_megatron.nodecheck.ranks_mode import write_model

    for name in FAMILIES:
        want = ranks_model(name, 2)
        write_model(want, tmp_path / name)
        got = model_providers.read_hf_config(str(tmp_path / name))
        shapes = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                              "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "vocab_size",
                              "num_experts_per_tok", "mlp_only_layers", "tie_word_embeddings") if k in want]
        # (transformers 5 writes rope_theta inside rope_parameters, num_experts as num_local_experts)
        assert {k: got[k] for k in shapes} == {k: want[k] for k in shapes}, name
        assert route_shape(got) == ((4, 2, 4) if "num_experts" in want else None), name
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32)
        ids = torch.randint(3, want["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            spread = float(model(ids).logits.std(-1).mean())
        assert spread > 0.5, (name, spread)  # transformers' own init (std 0.02): ~0.1 here
