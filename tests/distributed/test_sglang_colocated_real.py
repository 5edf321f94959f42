"""The colocated SGLang path against sglang 0.5.23 itself, on the CPU: real `sglang.Engine`s (SGLang's
CPU engine, its scheduler and detokenizer processes, Qwen3-MoE model class with its FusedMoE, weight
loaders, sampler and radix cache), started by the project's own SGLangEngine.colocated in the
trainer's ranks. TEST DOUBLE: only sgl_kernel's CPU build (tests/doubles/sglang/sgl_kernel, names
SGLang's CPU path imports; tests/helpers/sglang_world.py). Release/resume of GPU memory is not run
(SGLang's CPU engine holds no GPU memory and its release synchronizes CUDA): test_sglang_colocated.py's
stand-in keeps it.

One run of 2 gloo ranks, rollout.sglang.tp=1 (SGLang's CPU engine runs TP=1 only: docs/what_ran_where.md),
so each rank owns one engine, started once for every check and every layout:
  - at trainer TP=2, three weight syncs of the trainer's weights through the project's payloads
    (stream_weights), each followed by generation of the same prompts: the engines' log-probs of what
    they sampled equal the trainer's own (Megatron's forward, log_softmax at temperature 1) in float32;
    the prompts repeat across syncs, so a stale prefix cache would show;
  - the project's sampling settings: greedy (temperature 0), top_k=1 and a tiny top_p are greedy;
    max_new_tokens bounds the answer; a stop token ends it and is kept;
  - partial rollout: a response continued in rounds (extend) is the greedy response, with the
    log-probs of the new tokens only;
  - vapo-check --ranks' checks (nodecheck/multi_rank.py check_on_engine) on these engines: its own
    actor at trainer TP=2 with sequence parallelism, one sync, every engine's answers gathered on both
    ranks, sglang_sync PASS and routed_experts SKIP (SGLang's CPU engine captures no routes), alike
    on both ranks; then the engines synced with one wrong shard (rank 1's part of the output layer)
    and sglang_sync is FAIL;
  - the same engines then colocated with the trainer at PP=2 (each stage's engine gets the other
    stage's layers) and at EP=2 (each EP rank's engine gets the other rank's experts): two syncs
    each, log-probs equal. SGLangEngine.colocated builds each layout's engine groups as for a
    start, handed the running Engine instead of starting one (its `start` argument).
Qwen3-MoE with every layer MoE (SGLang builds no dense layer: config/preflight.py), its own lm_head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks
from tests.helpers.ports import free_port
from tests.helpers.tiny_hf import qwen3_moe_config, randomize

PROMPTS = [[5, 9, 13], [7, 7, 30, 2], [21, 3, 8, 1, 44], [11, 12]]
SYNCS = 3
LAYOUTS = {"PP=2": dict(tp=1, pp=2), "EP=2": dict(tp=1, pp=1, ep=2)}  # after TP=2, on the same engines
NEW = 6  # tokens per answer: prompts + answers stay inside the tiny model's 64 positions


def trainer_logprobs(chunks, vocab, seqs, temperature=1.0):
    """[log p(token) per answer token] for each (prompt, answer) in `seqs`: Megatron's own forward
    (collective over TP; every rank passes the same seqs)."""
    from tests.helpers.megatron_ref import megatron_forward

    out = []
    for prompt, answer in seqs:
        ids = torch.tensor([list(prompt) + list(answer)])
        logits = megatron_forward(chunks, ids, critic=False, vocab=vocab)[0].double() / temperature
        lp = torch.log_softmax(logits, -1)
        out.append([float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(answer)])
    return out


def _greedy(chunks, vocab, prompt, n):
    from tests.helpers.megatron_ref import megatron_forward

    seq = list(prompt)
    for _ in range(n):
        seq.append(int(megatron_forward(chunks, torch.tensor([seq]), critic=False, vocab=vocab)[0, -1].argmax()))
    return seq[len(prompt):]


def _save_moe(path, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(mlp_only_layers=()), dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path)


def _everyone(x: list) -> list:
    """Every rank's list, concatenated in rank order (collective)."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return [y for part in got for y in part]


def _stage_logprobs(chunks, vocab, seqs):
    """trainer_logprobs on the last pipeline stage; the other stages run the same forwards (their
    pipeline sends) and get None."""
    from tests.helpers.megatron_ref import megatron_forward
    from vapo_megatron.mcore import parallel

    if parallel.is_last_stage():
        return trainer_logprobs(chunks, vocab, seqs)
    for prompt, answer in seqs:
        megatron_forward(chunks, torch.tensor([list(prompt) + list(answer)]), critic=False, vocab=vocab)
    return None


def _relayout(layout: dict) -> None:
    """Megatron's parallel state again, at `layout`, on a fresh rendezvous port (rank 0's)."""
    import os

    import torch.distributed as dist

    from vapo_megatron.mcore import parallel

    box = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    parallel.destroy()
    os.environ["MASTER_PORT"] = str(box[0])
    parallel.init_distributed(**layout)


def _colocated_again(hf_dir: Path, running, layout: dict) -> list:
    """The trainer rebuilt at `layout` and this rank's running Engine colocated with it by
    SGLangEngine.colocated (the Engine handed over where it would start one); two random updates,
    each synced and sampled: [(engines' log-probs, trainer's or None)] per sync."""
    import torch.distributed as dist

    from model_providers import family_for, read_hf_config
    from tests.helpers.megatron_ref import random_update
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.base import SamplingParams
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights.hf_read import load_hf_weights

    _relayout(layout)
    hf_cfg = read_hf_config(hf_dir)
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)

    def handover(cfg):
        assert cfg.tp_size == 1 and cfg.device == "cpu" and cfg.load_format == "dummy", cfg
        return running

    engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=1, mem_fraction=0.5, dtype="float32", seed=0,
                                    start=handover)
    mine = PROMPTS[dist.get_rank()::2]
    out = []
    for step in range(2):
        random_update(chunks)
        stream_weights(chunks, family_for(hf_cfg), hf_cfg, engine, version=step + 1, bucket_bytes=8_000)
        outs = engine.generate(mine, SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW, seed=step))
        seqs = _everyone([(mine[o.prompt_index], o.token_ids) for o in outs])
        out.append((_everyone([o.logprobs for o in outs]), _stage_logprobs(chunks, hf_cfg["vocab_size"], seqs)))
    return out


def _node_check(hf_dir: Path, engine) -> dict:
    """vapo-check --ranks' checks on the running engines, then the engines given a wrong weight: its lines."""
    from vapo_megatron.mcore import parallel
    from vapo_megatron.nodecheck import multi_rank

    lines = multi_rank.check_on_engine(hf_dir, engine, name="moe", dtype=torch.float32)
    chunks, hf_cfg = multi_rank.build_actor(hf_dir, torch.float32)
    (output,) = [p for n, p in chunks[0].named_parameters() if n == "output_layer.weight"]
    plant = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)) * (parallel.tp_rank() == 1)
    with torch.no_grad():
        output.add_(plant)
        multi_rank.sync(chunks, hf_cfg, engine, version=9)  # the engines get rank 1's shard wrong
        output.sub_(plant)
    wrong = multi_rank.compare_logprobs(chunks, hf_cfg, multi_rank.sample(engine, hf_cfg, routes=False), name="moe",
                                        dtype=torch.float32)
    return {"lines": lines, "wrong": wrong}


def _run(hf_dir: Path):
    from tests.helpers.sglang_world import enter_sglang_world

    enter_sglang_world()  # before sglang is imported in this rank: SGLang's CPU switch, the sgl_kernel double

    from model_providers import family_for, read_hf_config
    from tests.helpers.megatron_ref import random_update
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.base import Continuation, SamplingParams
    from vapo_megatron.rollout.sglang_engine import SGLangEngine
    from vapo_megatron.rollout.weight_sync import stream_weights
    from vapo_megatron.weights.hf_read import load_hf_weights

    parallel.init_distributed(2, 1)
    hf_cfg = read_hf_config(hf_dir)
    vocab = hf_cfg["vocab_size"]
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=False)
    load_hf_weights(chunks, family_for(hf_cfg), hf_cfg, hf_dir)
    # The production start (start_engine: SGLang's CPU engine, load_format="dummy", random weights until
    # the first sync) with the KV cache capped at 4,096 tokens (rollout.sglang.max_total_tokens): SGLang
    # sizes it as a share of the host's memory and refuses a share smaller than what the memory it sees
    # free fell by while it loaded, which other processes on a shared machine decide (seen at 0.01).
    engine = SGLangEngine.colocated(model_path=str(hf_dir), tp_size=1, mem_fraction=0.5, dtype="float32", seed=0,
                                    max_total_tokens=4096)
    mine = PROMPTS[parallel.tp_rank()::2]  # each rank's engine generates its own share
    everyone = _everyone

    res = {"syncs": []}
    for step in range(SYNCS):
        if step:
            random_update(chunks)
        stream_weights(chunks, family_for(hf_cfg), hf_cfg, engine, version=step + 1, bucket_bytes=8_000)
        outs = engine.generate(mine, SamplingParams(n=2, temperature=1.0, max_new_tokens=NEW, seed=7 + step))
        seqs = everyone([(mine[o.prompt_index], o.token_ids) for o in outs])
        got = everyone([o.logprobs for o in outs])
        res["syncs"].append({"engine": got, "trainer": trainer_logprobs(chunks, vocab, seqs),
                             "versions": everyone([o.weight_version for o in outs]),
                             "reasons": everyone([o.finish_reason for o in outs])})

    greedy = [_greedy(chunks, vocab, p, NEW) for p in PROMPTS]
    settings = {
        "temperature 0": SamplingParams(temperature=0.0, max_new_tokens=NEW),
        "top_k 1": SamplingParams(temperature=1.0, top_k=1, max_new_tokens=NEW),
        "top_p 1e-6": SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=NEW),
        "max_new_tokens 2": SamplingParams(temperature=0.0, max_new_tokens=2),
    }
    res["settings"] = {k: everyone([(o.token_ids, o.finish_reason) for o in engine.generate(mine, p)])
                       for k, p in settings.items()}
    stops = [g[2] for g in greedy[parallel.tp_rank()::2]]  # each prompt's third greedy token as its stop
    res["stop"] = everyone([(o.token_ids, o.finish_reason) for p, s in zip(mine, stops)
                            for o in engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=NEW,
                                                                         stop_token_ids=(s,)))])
    # Partial rollout: grown 2 + 2 + 2 tokens from an empty response, greedy.
    grown = [[] for _ in mine]
    rounds = []
    for _ in range(3):
        outs = engine.extend([Continuation(prompt_ids=p, response_ids=r, seed=3, max_new_tokens=2)
                              for p, r in zip(mine, grown)], SamplingParams(temperature=0.0, max_new_tokens=NEW))
        rounds.append([(o.token_ids, len(o.logprobs)) for o in outs])
        grown = [r + o.token_ids for r, o in zip(grown, outs)]
    res["grown"] = everyone(grown)
    res["rounds"] = everyone(rounds)
    res["greedy"] = greedy
    res["order"] = everyone(mine)
    res["node_check"] = _node_check(hf_dir, engine)  # it syncs other weights: after every check of the test's own
    res["layouts"] = {name: _colocated_again(hf_dir, engine.engine, layout) for name, layout in LAYOUTS.items()}
    engine.shutdown()  # a forked rank runs no atexit handler: the Engine's own would never run
    return res


def test_colocated_real_engines_sync_sample_and_continue(tmp_path):
    _save_moe(tmp_path / "hf", seed=5)
    (run, last) = run_ranks(2, _run, tmp_path / "hf", timeout=900)
    for step, s in enumerate(run["syncs"]):
        assert s["versions"] == [step + 1] * len(s["versions"])
        assert all(r in ("stop", "length") for r in s["reasons"])
        for eng, ref in zip(s["engine"], s["trainer"]):
            assert len(eng) == len(ref) > 0
            assert max(abs(a - b) for a, b in zip(eng, ref)) < 1e-4, (step, eng, ref)
    greedy = dict(zip(map(tuple, PROMPTS), run["greedy"]))
    want = [greedy[tuple(p)] for p in run["order"]]
    for name in ("temperature 0", "top_k 1", "top_p 1e-6"):
        assert [t for t, _ in run["settings"][name]] == want, name
        assert [r for _, r in run["settings"][name]] == ["length"] * len(want), name
    assert run["settings"]["max_new_tokens 2"] == [(g[:2], "length") for g in want]
    # The stop token (the third greedy token) ends the answer where it first comes, and stays in it.
    assert run["stop"] == [(g[:g.index(g[2]) + 1], "stop") for g in want]
    assert run["grown"] == want
    assert all(n_lp == len(t) == 2 for r in run["rounds"] for t, n_lp in r)
    for rank in (run, last):  # vapo-check --ranks' verdicts, alike on both ranks
        lines, wrong = rank["node_check"]["lines"], rank["node_check"]["wrong"]
        assert [(n, s) for n, s, _ in lines] == [("sglang_sync:moe", "PASS"), ("routed_experts:moe", "SKIP")], lines
        assert "2 SGLang engine(s) at TP=1" in lines[0][2] and "registers pinned host memory" in lines[1][2], lines
        assert wrong[1] == "FAIL" and "max |engine - trainer log-prob|" in wrong[2], wrong
    for name in LAYOUTS:  # rank 1 is a last stage at PP=2 and at EP=2
        assert len(last["layouts"][name]) == 2, name
        for engine, trainer in last["layouts"][name]:
            assert len(engine) == len(trainer) == len(PROMPTS), name
            for eng, ref in zip(engine, trainer):
                assert len(eng) == len(ref) > 0
                assert max(abs(a - b) for a, b in zip(eng, ref)) < 1e-4, (name, eng, ref)
