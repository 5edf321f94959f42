"""Megatron-side helpers of the tests: a manual pipeline forward (the reference the engines and
the conversions are compared with), the same of a checkpoint, and reproducible parameter noise."""

import json
import zlib

import torch


def megatron_forward(chunks, ids, *, critic: bool, vocab: int):
    """Manual pipeline forward (hidden states sent stage to stage); full logits or values on the
    last stage, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = chunks[0].eval()
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    if not ps.is_pipeline_first_stage():
        x = torch.empty(t, b, model.config.hidden_size)
        dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(x)
    with torch.no_grad():
        out = model(ids, pos, None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    if critic:
        return out
    # vocab-parallel logits [B, T, V_pad / TP] -> full, padding stripped
    shards = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :vocab]


def load_and_forward(ckpt, ids, *, critic: bool):
    """A dist checkpoint (vapo-convert's or the trainer's: its hf/config.json inside) loaded into
    freshly built chunks at the current layout, then megatron_forward."""
    from vapo_megatron.checkpoint import dist_io
    from vapo_megatron.mcore.models import build_chunks

    hf_cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    chunks = build_chunks(hf_cfg, params_dtype=torch.float32, critic=critic)
    dist_io.load_model(ckpt, chunks)
    return megatron_forward(chunks, ids, critic=critic, vocab=hf_cfg["vocab_size"])


def random_update(chunks) -> None:
    """Add noise to every parameter: the same on TP replicas of replicated tensors, different
    per shard for TP-sharded ones, so that the engine can only match through a real gather.
    Seeds are fixed per parameter, so a run is reproducible."""
    from vapo_megatron.mcore import parallel

    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                key = f"{parallel.pp_rank()}/{name}"
                if getattr(p, "shared_embedding", False):
                    # Tied embeddings at PP>1: the last stage's output layer is a copy of the
                    # first stage's embedding that megatron keeps equal; keep them equal here too.
                    key = "shared_embedding"
                if getattr(p, "tensor_model_parallel", False):
                    key += f"/tp{parallel.tp_rank()}"
                gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
