"""vapo-plan --search (issue 57): the layouts it lists are ones the trainer accepts, sized and timed
exactly as vapo-plan sizes and times one config.

References, each independent of the search's own arithmetic:
  - megatron's per-stage builds on the meta device (sizing/shards.py, what vapo-plan builds for one config) for the
    counts the search puts together from a few builds (sizing/layer_counts.py);
  - vapo-plan's memory check and step time for the layout given as a config (make_plan with those builds, the command
    itself) for the search's fits, peaks and seconds;
  - the trainer's start-up checks (config/preflight.py startup_problems, with a real HF directory) for the top layouts;
  - a naive loop over every TP, PP, VPP and EP that layout_problems accepts, for the search's candidates: none missed.
The searches run in spawned processes (megatron's fake process group and cpu_compat must not leak
into pytest); models are tiny or small (Qwen2.5-0.5B on 12 GiB GPUs, where memory decides).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import torch

from tests.helpers.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parents[2]
CONFIG_32B = str(ROOT / "configs" / "qwen2.5_32b_vapo.yaml")
CONFIG_MOE = str(ROOT / "configs" / "qwen3_30b_a3b_vapo.yaml")
CONFIG_DAPO = str(ROOT / "configs" / "qwen2.5_32b_dapo.yaml")
# Qwen2.5-0.5B (tied embeddings, 24 layers, 14 heads, 2 KV heads) on 2 nodes x 4 GPUs of 12 GiB: only some layouts fit.
SMALL = ["rollout.sglang.mem_fraction=0.5", "rollout.prompts_per_step=64", "data.max_prompt_tokens=1024",
         "rollout.max_new_tokens=3072", "trainer.micro_batch_tokens=8192"]
SMALL_ARGS = ["--config", CONFIG_32B, "--nodes", "2", "--gpus-per-node", "4", "--preset", "qwen2.5-0.5b",
              "--gpu", "h100", "--gpu-memory-gib", "12"]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from vapo_megatron.plan import main

    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = main(argv)
    return rc, o.getvalue(), e.getvalue()


def _folded(shards: list, pp: int) -> list[tuple]:
    """shards.py's positions, one per stage: every TP rank of a stage the same counts, `unique` summed."""
    out = []
    for r in range(pp):
        stage = [s for s in shards if s.pp_rank == r]
        same = {(s.actor_params, s.critic_params, s.actor_expert, s.critic_expert, s.inflight_microbatches)
                for s in stage}
        assert len(same) == 1, same
        a, c, ae, ce, inflight = same.pop()
        out.append((a, c, sum(s.actor_unique for s in stage), sum(s.critic_unique for s in stage), inflight, ae, ce))
    return out


def _tuples(shards: list) -> list[tuple]:
    return [(s.actor_params, s.critic_params, s.actor_unique, s.critic_unique, s.inflight_microbatches, s.actor_expert,
             s.critic_expert) for s in shards]


# ---- the counts the search puts together = megatron's per-stage builds ---------------------------------

COUNT_CASES = [  # (preset, world, tp, pp, vpp, ep)
    ("tiny-qwen2", 4, 2, 2, None, 1),
    ("tiny-qwen2-tied", 2, 1, 1, None, 1),  # PP=1: the tied LM head shares the embedding's weight
    ("tiny-qwen2-tied", 4, 1, 2, 2, 1),  # PP>1: megatron allocates it on the last stage
    ("tiny-qwen3-moe", 8, 2, 2, None, 2),  # experts over EP, layer 2 dense
    ("tiny-qwen3-moe", 8, 1, 2, 2, 2),
]


def _counts_and_plans():
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    from model_providers.presets import preset
    from vapo_megatron.sizing.layer_counts import layout_shards
    from vapo_megatron.sizing.shards import shard_sizes

    counts = []
    for name, world, tp, pp, vpp, ep in COUNT_CASES:
        hf = {**preset(name), "_source": name}
        built = shard_sizes(hf, hf, world_size=world, tp=tp, pp=pp, vpp=vpp, params_dtype=torch.bfloat16, ep=ep,
                            sequence_parallel=tp > 1)
        put = layout_shards(hf, hf, tp=tp, pp=pp, vpp=vpp, ep=ep, params_dtype=torch.bfloat16, sequence_parallel=True)
        counts.append((_folded(built, pp), _tuples(put)))
    return counts, _plans()


def _plans():
    """The search on Qwen2.5-0.5B, and vapo-plan's own check and step time for some of its layouts."""
    from model_providers.presets import preset
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.plan import make_plan
    from vapo_megatron.sizing.search import Assumptions, evaluate, overrides, records, search
    from vapo_megatron.sizing.search_report import format_search
    from vapo_megatron.sizing.step_config import plan_setup
    from vapo_megatron.sizing.step_time import estimate

    hf = {**preset("qwen2.5-0.5b"), "_source": "preset"}
    cfg = parse_config(CONFIG_32B, SMALL)[0]
    a = Assumptions(gpu=GPUS["h100"], gpus_per_node=4, gpu_memory_gib=12.0)
    result = search(cfg, hf, hf, world=8, a=a)
    # Layouts of every kind: the search's three fastest and its slowest, and the three that came closest to fitting.
    chosen = [r.cfg for r in [*result.rows[:3], result.rows[-1], *result.closest]]
    cache: dict = {}
    # And two of them under algo.estimator=grpo (the DAPO config: no critic; make_plan's with_critic).
    chosen += [parse_config(CONFIG_DAPO, SMALL + ["reward.overlong_buffer=1024", *overrides(c)])[0]
               for c in (chosen[0], chosen[-1])]
    comparisons = []
    for c in chosen:
        row = evaluate(c, hf, hf, world=8, a=a, shards_cache=cache)
        plan = make_plan(c, hf, hf, world_size=8, gpu_memory_gib=12.0)  # shards built per stage, as vapo-plan does
        step = None
        if not plan.problems:
            step = estimate(a.gpu, plan_setup(c, plan, hf, hf, gpus_per_node=4, gpu=a.gpu)).step_s
        comparisons.append({
            "overrides": overrides(c),
            "search": (row.fits, row.training_peak, row.rollout_peak, row.plan.kv_tokens, row.problems,
                       row.estimate.step_s if row.estimate else None),
            "vapo-plan": (not plan.problems, max(m.training for m in plan.ranks), max(m.rollout for m in plan.ranks),
                          plan.kv_tokens, plan.problems, step)})
    top = records(result, 3)
    table = format_search(result, cfg, top=3, model_source="preset", nodes=2, config_path=CONFIG_32B,
                          rerun="vapo-plan ...")
    cli = [_cli(SMALL_ARGS + ["--search", "--json", "--top", "3"] + SMALL),
           (0, table, ""),
           _cli(SMALL_ARGS + SMALL + list(top[0]["overrides"])),
           _cli(SMALL_ARGS[:-4] + ["--search"] + SMALL),  # no --gpu
           _cli(SMALL_ARGS + ["--json"] + SMALL),  # --json without --search
           _cli(SMALL_ARGS + ["--search", "rollout.engine=embedded"] + SMALL)]
    return {"records": top, "comparisons": comparisons, "cli": cli, "tried": result.tried, "fit": len(result.rows),
            "too_big": result.too_big}


def test_search_counts_memory_and_time_are_vapo_plans():
    ((counts, out),) = run_ranks(1, _counts_and_plans)
    for (built, put), case in zip(counts, COUNT_CASES):
        assert put == built, case

    # The search's memory check and step time, layout by layout, equal vapo-plan's with megatron's
    # per-stage builds: the same fits, the same peaks to the byte, the same seconds.
    comparisons = out["comparisons"]
    assert sum(c["vapo-plan"][0] for c in comparisons) >= 5 and sum(not c["vapo-plan"][0] for c in comparisons) >= 3
    for c in comparisons:
        assert c["search"] == c["vapo-plan"], c["overrides"]
    assert out["fit"] >= 10 and out["too_big"] >= 10, out  # memory decides here

    # --json: the top layouts, ranked, then the config's own (refused on 8 GPUs: TP*PP=32).
    rc, text, err = out["cli"][0]
    assert rc == 0, err
    recs = json.loads(text)
    assert recs[:3] == json.loads(json.dumps(out["records"][:3]))
    assert [r["rank"] for r in recs[:3]] == [1, 2, 3] and all(r["fits"] and not r["config"] for r in recs[:3])
    assert [r["step_s"] for r in recs[:3]] == sorted(r["step_s"] for r in recs[:3])
    for r in recs[:3]:
        assert {"tp", "pp", "vpp", "ep", "dp", "engine_tp", "recompute", "offload", "fits", "peak_gib", "headroom_gib",
                "step_s", "phases_s", "tokens_per_s_per_gpu", "run_gpu_hours", "overrides"} <= set(r)
        assert r["dp"] == 8 // (r["tp"] * r["pp"]) and abs(sum(r["phases_s"].values()) - r["step_s"]) < 0.01
    own = recs[-1]
    assert own["config"] and not own["fits"] and own["rank"] is None and own["dp"] is None
    assert own["problems"][0].startswith("parallel.tp * parallel.pp = 8 * 4 = 32 does not divide the world size 8")

    # The table (format_search on the same search) agrees, with the config's layout and the fastest's full overrides.
    rc, table, _ = out["cli"][1]
    assert rc == 0
    assert "one layout for actor and critic: the trainer builds both on the same ranks" in table
    assert f"layouts: {out['tried']:,} tried" in table and f"{out['fit']:,} fit" in table
    assert "a model until a GPU run checks it" in table
    assert ("the config's layout (" + CONFIG_32B + ": TP=8 PP=4 VPP=- engine TP=8" in table
            and "refused: parallel.tp" in table)
    assert "why the fastest is faster than the rank-3 layout" in table
    best = recs[0]
    assert "the fastest as vapo-plan sees one config, its memory and step time in full: vapo-plan ... " \
        + " ".join(best["overrides"]) in table

    # That command: vapo-plan on the fastest layout as one config prints the search's peaks and step time.
    rc, one, err = out["cli"][2]
    assert rc == 0, one + err
    assert (f"fits: training peak {best['training_peak_gib']:.1f} GiB" in one
            and f"rollout peak {best['rollout_peak_gib']:.1f} GiB, of 12.0 GiB" in one), one
    (step,) = [line for line in one.splitlines() if line.startswith("  step ")]
    assert abs(float(step.split()[1]) - best["step_s"]) < 0.05, step

    # Bad use: one line each, exit 2, nothing searched.
    for (rc, text, err), says in zip(out["cli"][3:], (
            "--search ranks layouts by modelled step time: give the GPU with --gpu", "--json needs --search",
            "this config's rollout.engine=embedded (set rollout.engine=sglang)")):
        assert rc == 2 and text == "" and says in err, err


# ---- the top layouts pass the trainer's own start-up checks and build ------------------------------------

def _top_layouts_accepted(tmp: str):
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    from transformers import AutoModelForCausalLM

    from model_providers import read_hf_config
    from tests.helpers.tiny_hf import qwen2_config, qwen3_moe_config, save_tiny_tokenizer
    from vapo_megatron.config import parse_config
    from vapo_megatron.config.preflight import startup_problems
    from vapo_megatron.sizing.layer_counts import layout_shards
    from vapo_megatron.sizing.shards import shard_sizes

    root = Path(tmp)
    (root / "train.jsonl").write_text('{"prompt": "w1 w2", "answer": "w3"}\n')
    out = []
    # A tied dense Qwen2 with the 32B config, a Qwen3-MoE with experts in every layer with the 30B-A3B
    # one (SGLang's Qwen3-MoE builds no dense layer: preflight refuses those); 4 layers, 2 KV heads each.
    for name, hf_config, config in (("qwen2", qwen2_config(tied=True), CONFIG_32B),
                                    ("moe", qwen3_moe_config(mlp_only_layers=()), CONFIG_MOE)):
        AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(root / name)
        save_tiny_tokenizer(root / name)
        base = [f"model.hf_path={root / name}", f"data.train_files=[{root / 'train.jsonl'}]", "data.eval_files=[]",
                f"trainer.run_dir={root / 'run'}", "data.max_prompt_tokens=16", "rollout.max_new_tokens=32",
                "trainer.micro_batch_tokens=48", "rollout.prompts_per_step=32", "rollout.n_samples=2",
                "algo.mini_batches=2", "parallel.tp=2", "parallel.pp=2", "rollout.sglang.tp=2"]  # TP=8 or 4: 2 KV heads
        rc, text, err = _cli(["--config", config, "--nodes", "2", "--gpus-per-node", "4", "--gpu", "h100", "--search",
                              "--json", "--top", "4", *base])
        assert rc == 0, err
        hf = read_hf_config(str(root / name))
        for rec in json.loads(text):
            if not rec["fits"]:
                continue
            cfg = parse_config(config, base + rec["overrides"])[0]
            p = cfg.parallel
            built = shard_sizes(hf, hf, world_size=8, tp=p.tp, pp=p.pp, vpp=p.vpp, params_dtype=torch.bfloat16,
                                ep=p.ep, sequence_parallel=p.sequence_parallel)  # every stage built, as vapo-plan does
            put = layout_shards(hf, hf, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, params_dtype=torch.bfloat16,
                                sequence_parallel=p.sequence_parallel)
            out.append((name, rec, startup_problems(cfg, 8), _folded(built, p.pp) == _tuples(put)))
    return out


def test_top_layouts_pass_the_trainers_checks_and_build(tmp_path):
    (checked,) = run_ranks(1, _top_layouts_accepted, str(tmp_path))
    for name in ("qwen2", "moe"):  # the top four and the config's own (TP=2 PP=2), each
        assert (sum(n == name for n, _, _, _ in checked) == 5
                and any(rec["config"] for n, rec, _, _ in checked if n == name))
    assert any(rec["ep"] > 1 for _, rec, _, _ in checked) and any(rec["vpp"] for _, rec, _, _ in checked)
    for name, rec, problems, same_counts in checked:
        assert problems == [], (name, rec["overrides"], problems)
        assert same_counts, (name, rec["overrides"])


# ---- no accepted layout is missed -------------------------------------------------------------------------

def test_candidates_are_every_layout_the_checks_accept():
    """A naive loop over every TP (in one node), PP, VPP and EP against layout_problems and the EP-in-node
    rule gives the same (TP, PP, VPP, EP) as the search's candidates that layout_problems accepts."""
    from model_providers.presets import preset
    from vapo_megatron.config import parse_config
    from vapo_megatron.config.layout import layout_problems
    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.report import ep_group_nodes
    from vapo_megatron.sizing.search import Assumptions, candidates

    for name, config, world, node in (("qwen2.5-32b", CONFIG_32B, 64, 8), ("qwen3-30b-a3b", CONFIG_MOE, 32, 8),
                                      ("tiny-qwen3-moe", CONFIG_MOE, 12, 4)):
        hf = {**preset(name), "_source": name}
        cfg = parse_config(config, [])[0]
        a = Assumptions(gpu=GPUS["h100"], gpus_per_node=node, gpu_memory_gib=80.0)
        searched = {(c.parallel.tp, c.parallel.pp, c.parallel.vpp, c.parallel.ep)
                    for c in candidates(cfg, hf, world=world, a=a) if not layout_problems(
                        world, c.parallel.tp, c.parallel.pp, c.parallel.vpp, model=hf, ep=c.parallel.ep)}
        naive = set()
        for tp in (t for t in range(1, node + 1) if node % t == 0):  # a TP group inside one node
            for pp in range(1, world + 1):
                if world % (tp * pp):
                    continue
                for vpp in [None, *range(2, hf["num_hidden_layers"] + 1)]:  # VPP=1 is the plain schedule (null)
                    for ep in range(1, world // (tp * pp) + 1):
                        if not layout_problems(world, tp, pp, vpp, model=hf, ep=ep) and ep_group_nodes(
                                tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, gpus_per_node=node) == 1:
                            naive.add((tp, pp, vpp, ep))
        assert searched == naive, (name, sorted(naive - searched), sorted(searched - naive))
        assert len(naive) >= 10


# ---- the top layouts run the trainer's step ------------------------------------------------------------

def _search_tiny(tmp: str, actor_dir: str, critic_dir: str, moe: bool) -> list[dict]:
    """vapo-plan --search's fitting layouts, best first, for the tiny model at 1 node x 4 GPUs."""
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    (Path(tmp) / "train.jsonl").write_text('{"prompt": "w1 w2", "answer": "w3"}\n')
    base = [f"model.hf_path={actor_dir}", f"model.critic_hf_path={critic_dir}", f"data.train_files=[{tmp}/train.jsonl]",
            "data.eval_files=[]", f"trainer.run_dir={tmp}/run", "data.max_prompt_tokens=4", "rollout.max_new_tokens=20",
            "trainer.micro_batch_tokens=24", "rollout.prompts_per_step=8", "rollout.n_samples=2", "algo.mini_batches=2",
            "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "rollout.sglang.tp=1"]
    rc, text, err = _cli(["--config", CONFIG_MOE if moe else CONFIG_32B, "--nodes", "1", "--gpus-per-node", "4",
                          "--gpu", "h100", "--search", "--json", "--top", "8", *base])
    assert rc == 0, err + text[-3000:]
    return [r for r in json.loads(text) if r["fits"]]


def test_the_top_layouts_run_the_trainers_step_on_uneven_data(tmp_path):
    """For tiny dense and MoE models, the search's two best distinct layouts at 4 GPUs run the trainer's forwards and
    updates on data uneven across DP ranks (tests/helpers/micro_batch_step.py, several micro-batches per rank), equal to
    a single-process run: none ranked first crashes or hangs at the first schedule call (issue 63: VPP layouts did)."""
    from tests.helpers.micro_batch_step import gathered, models, same, step

    ran = []
    for moe in (False, True):
        actor, critic = models(tmp_path / ("moe" if moe else "dense"), moe=moe)
        (top,) = run_ranks(1, _search_tiny, str(tmp_path), actor, critic, moe)
        ref = gathered(run_ranks(1, step, actor, critic, 1, 1, None, 1, moe))
        layouts = list(dict.fromkeys((r["tp"], r["pp"], r["vpp"], r["ep"], r["sequence_parallel"]) for r in top))
        for tp, pp, vpp, ep, sp in layouts[:2]:  # the two best distinct layouts
            same(gathered(run_ranks(4, step, actor, critic, tp, pp, vpp, ep, moe, sp, timeout=300)), ref)
            ran.append((moe, (tp, pp, vpp, ep, sp)))
    assert len(ran) == 4, ran


# ---- no layout accepted: why, by rule, and the closest (issue 63) -------------------------------------------

def _nothing_accepted():
    """The 32B config on 8 nodes x 7 GPUs (56: no TP x PP x DP of it runs the config's batch), as a table
    and as --json, every candidate's settings, and vapo-plan's verdict on each closest layout given as
    overrides; then the small model on 1 GiB GPUs (the checks accept layouts, memory refuses them all)."""
    from vapo_megatron.config.quiet import quiet_startup

    quiet_startup()
    from model_providers.presets import preset
    from vapo_megatron.config import parse_config
    from vapo_megatron.sizing.hardware import GPUS
    from vapo_megatron.sizing.search import Assumptions, candidates

    args = ["--config", CONFIG_32B, "--nodes", "8", "--gpus-per-node", "7", "--preset", "qwen2.5-32b", "--gpu", "h100"]
    table = _cli(args + ["--search"])
    as_json = _cli(args + ["--search", "--json"])
    a = Assumptions(gpu=GPUS["h100"], gpus_per_node=7, gpu_memory_gib=80.0)
    layouts = [(c.parallel.tp, c.parallel.pp, c.rollout.sglang.tp) for c in candidates(
        parse_config(CONFIG_32B, [])[0], {**preset("qwen2.5-32b"), "_source": "p"}, world=56, a=a)]
    closest = table[1].split("the closest refused")[1].splitlines()[1:] if "the closest refused" in table[1] else []
    verdicts = []
    for line in closest:  # TP=2 PP=4 VPP=- engine TP=1, recompute on, offload on, micro_batch_tokens=N: refused: ...
        m = re.match(r"  TP=(\d+) PP=(\d+) VPP=(\S+) engine TP=(\d+), recompute (on|off), offload (on|off), "
                     r"micro_batch_tokens=(\d+): refused: (.*)$", line)
        tp, pp, vpp, etp, rc, off, mbt, said = m.groups()
        given = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={'null' if vpp == '-' else vpp}",
                 f"parallel.sequence_parallel={str(int(tp) > 1).lower()}", f"rollout.sglang.tp={etp}",
                 f"model.recompute_activations={str(rc == 'on').lower()}",
                 f"trainer.offload_during_rollout={str(off == 'on').lower()}", f"trainer.micro_batch_tokens={mbt}"]
        verdicts.append((said, _cli(args + given)))
    memory = _cli(SMALL_ARGS[:-1] + ["1", "--search"] + SMALL)
    return table, as_json, layouts, verdicts, memory


def test_no_layout_accepted_says_why_by_rule_and_names_the_closest():
    table, as_json, layouts, verdicts, memory = run_ranks(1, _nothing_accepted)[0]
    rc, text, err = table
    assert rc == 2, (rc, text[-2000:], err)  # docs/slurm.md: a setting no layout can fix is bad input
    assert f"layouts: {len(layouts)} tried, {len(layouts)} refused" in text
    assert "no layout passes the checks: each of the" in text

    # Each rule's count against the layouts' own arithmetic (56 GPUs, 512 prompts, 16 mini-batches,
    # 64 layers, 40 heads), not against the check messages: the rule with other numbers groups together.
    def count(rule: str) -> int:
        (line,) = [ln for ln in text.splitlines() if re.match(r"\s+[\d,]+  " + re.escape(rule), ln)]
        return int(line.split()[0].replace(",", ""))

    dp = [56 // (tp * pp) for tp, pp, _ in layouts]
    assert count("rollout.prompts_per_step=512 must be divisible by data-parallel size * algo.mini_batches "
                 "= {7,14,28,56} * 16 = {112,224,448,896}") == sum(512 % (d * 16) != 0 for d in dp) > 0
    assert count("parallel.pp={7,14,28,56} does not divide num_hidden_layers=64") == sum(
        64 % pp != 0 for _, pp, _ in layouts) > 0
    assert count("parallel.tp=7 does not divide num_attention_heads=40") == sum(tp == 7 for tp, _, _ in layouts) > 0
    assert count("rollout.sglang.tp=7 does not divide num_attention_heads=40") == sum(
        e == 7 for _, _, e in layouts) > 0

    # The three closest, each with every problem vapo-plan finds for that layout given as overrides
    # (one config: exit 2, the same lines), and three different obstacles named among them.
    assert len(verdicts) == 3, text[-3000:]
    for said, (rc1, out1, err1) in verdicts:
        assert rc1 == 2 and out1 == "", (said, err1)
        for problem in said.split("; "):
            assert problem in err1, (problem, err1)
    assert len({said.split(" ")[0].split("=")[0] for said, _ in verdicts}) == 3, verdicts

    # --json: stdout stays the records (the config's own, refused), the reasons go to stderr, exit 2.
    rc, out, err = as_json
    assert rc == 2 and [r["config"] for r in json.loads(out)] == [True], err
    assert "vapo-plan: no layout passes the checks" in err and "vapo-plan: the closest refused" in err

    # Memory refuses every layout the checks accept: exit 1, the three closest to fitting, and the checks'
    # refusals (TP*PP=32 among them: the config's own) counted by rule.
    rc, text, err = memory
    assert rc == 1, err
    lines = text.split("no layout fits; the closest")[1].splitlines()
    assert len([ln for ln in lines[1:4] if "does not fit on rank" in ln]) == 3, text[-3000:]
    assert "refused by the checks:" in text and "no layout passes the checks" not in text
