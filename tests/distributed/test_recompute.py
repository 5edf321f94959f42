"""model.recompute_activations: full activation recomputation changes memory, not results.

Actor and critic at TP=2 (two gloo ranks), built from the project's model providers twice from the
same weights, with and without recomputation: the loss and every gradient must be the same."""

from __future__ import annotations

import torch

from model_providers.presets import preset
from tests.helpers.dist_utils import run_ranks


def _loss_and_grads_both() -> dict:
    from vapo_megatron.mcore import parallel

    parallel.init_distributed(2, 1, seed=7)
    return {"actor": _loss_and_grads(critic=False), "critic": _loss_and_grads(critic=True)}


def _loss_and_grads(*, critic: bool) -> dict:
    from vapo_megatron.mcore.models import build_actor, build_critic

    hf_cfg = preset("tiny-qwen2")
    build = build_critic if critic else build_actor
    plain = build(hf_cfg, params_dtype=torch.float32)
    recomputing = build(hf_cfg, params_dtype=torch.float32, recompute=True)
    assert plain.config.recompute_granularity is None and recomputing.config.recompute_granularity == "full"
    recomputing.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(0)  # the same batch on both TP ranks
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 16), generator=gen)
    pos = torch.arange(16).expand(2, 16)
    weight = torch.randn(2, 16, generator=gen)
    out = {}
    for name, model in (("plain", plain), ("recompute", recomputing)):
        model.train()
        y = model(ids, pos, None)  # critic: values [B, T]; actor: vocab-parallel logits [B, T, V/TP]
        loss = (y.float() * (weight if critic else weight[..., None])).sum()
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def test_recompute_gives_the_same_loss_and_gradients_for_actor_and_critic():
    for rank in run_ranks(2, _loss_and_grads_both):
        for model in ("actor", "critic"):
            (loss_a, grads_a), (loss_b, grads_b) = rank[model]["plain"], rank[model]["recompute"]
            assert torch.equal(loss_a, loss_b), model
            assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
            for name in grads_a:
                assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), f"{model}: {name}"
