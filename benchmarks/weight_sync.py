"""Benchmark: weight sync from a TP=2 Megatron actor into the embedded engine, against a plain
memory copy of the same bytes, side by side in one run.

Two gloo ranks on the CPU (spawned by this script) build a Qwen2-shaped Megatron actor from a
preset (random init; default qwen2.5-0.5b: 494M parameters, bf16) at TP=2. Rank 0 holds an
EmbeddedEngine (a transformers Qwen2ForCausalLM of the same config). One timed sync is the real
`stream_weights` call end to end: TP shards through the transport (shared memory here), q/k/v and
gate/up split and vocab padding dropped by the mapping table, written into the engine's
parameters (or, with --buckets, through bounded flat buckets and engine.load_bucket), version
set. Megatron's norms are float32 next to bf16 weights on the CPU; the engine casts them.

Baseline, in the same processes, alternating with the syncs (so both see the same machine
load): `dst.copy_(src)` for tensors of exactly the shapes and dtypes the engine received (src:
the engine's own parameters, dst: a second set allocated and touched once), i.e. the same bytes
as one sync delivers.

Rates are bytes (and tensors) delivered to the engine per second; median over --repeats runs
after one warm-up sync (which also creates the shared-memory staging kept for later syncs).
Every rank runs --threads torch threads. Also printed: the peak bytes the sync held per rank
(SyncStats.peak_bytes, measured: buckets, transport buffers, staging) against the promised bound
(one bucket + the largest full tensor), and each rank's resident-set growth during the timed
syncs (kernel VmHWM).

Run: python -m benchmarks.weight_sync [--preset qwen2.5-0.5b] [--dtype bf16] [--bucket-mb 1024]
     [--transport auto|shm|collective] [--buckets]
The last line is `ratio: <sync rate / copy rate>` (bytes per second).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.peak_rss import reset_peak_rss, rss_kib  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TP = 2


def _rank_main(rank: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(TP), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    try:
        queue.put((rank, "ok", _bench_rank(rank, args)))
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from vapo_megatron.mcore import parallel

        parallel.destroy()


def _bench_rank(rank: int, args) -> dict:
    from transformers import AutoConfig

    from model_providers import family_for
    from model_providers.presets import preset
    from vapo_megatron.mcore import parallel
    from vapo_megatron.mcore.models import build_chunks
    from vapo_megatron.rollout.embedded import EmbeddedEngine
    from vapo_megatron.rollout.weight_sync import stream_weights

    dtype = DTYPES[args.dtype]
    hf_cfg = preset(args.preset)
    family = family_for(hf_cfg)
    parallel.init_distributed(TP, 1)
    t0 = time.perf_counter()
    chunks = build_chunks(hf_cfg, params_dtype=dtype, critic=False)
    n_local = sum(p.numel() for c in chunks for p in c.parameters())
    engine = None
    if rank == 0:
        cfg = AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "architectures"},
                                   architectures=hf_cfg["architectures"])
        engine = EmbeddedEngine.from_hf_config(cfg, dtype=dtype, direct_load=not args.buckets)
    build_s = time.perf_counter() - t0
    bucket_bytes = args.bucket_mb << 20

    def sync(version: int):
        parallel.barrier()
        return stream_weights(chunks, family, hf_cfg, engine, version=version, bucket_bytes=bucket_bytes,
                            transport=args.transport)

    params, dst = [], []
    if engine is not None:  # the baseline's tensors: the engine's parameters (tied ones once) and a copy
        params = list(engine.model.parameters())
        dst = [torch.empty_like(p) for p in params]

    def copy_all():
        t = time.perf_counter()
        for d, p in zip(dst, params):
            d.copy_(p)
        return time.perf_counter() - t

    sync(0)  # warm-up: first touch of buffers; creates the shared-memory staging kept for later syncs
    copy_all()  # warm-up: first touch of dst
    reset_peak_rss()
    rss0 = rss_kib("VmRSS")
    # Sync and copy alternate, so both see the same load from whatever else runs on the machine.
    runs, copy_s = [], []
    for v in range(1, args.repeats + 1):
        runs.append(sync(v))
        if engine is not None:
            copy_s.append(copy_all())
        parallel.barrier()
    rss_growth = (rss_kib("VmHWM") - rss0) * 1024
    out = {"rank": rank, "local_params": n_local, "build_s": build_s,
           "sync_s": [s.seconds for s in runs], "peak_bytes": max(s.peak_bytes for s in runs),
           "bound": runs[0].bound(), "rss_growth": rss_growth,
           "largest_tensor_bytes": runs[0].largest_tensor_bytes, "rss": rss_kib("VmRSS") * 1024}
    if engine is None:
        return out
    s = runs[0]
    assert engine.weight_version == args.repeats
    held = sum(p.numel() * p.element_size() for p in params)
    assert (held, len(params)) == (s.bytes, s.tensors), (f"sync delivered {s.tensors} tensors, {s.bytes} bytes; "
                                                         f"engine holds {len(params)}, {held}")
    out.update(tensors=s.tensors, bytes=s.bytes, buckets=s.buckets, copy_s=copy_s,
               engine_params=sum(p.numel() for p in params))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="model_providers.presets name (Qwen2 shape)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--bucket-mb", type=int, default=1024, help="bucket bound (MiB); the trainer's default is 1 GiB")
    ap.add_argument("--transport", default="auto", choices=["auto", "shm", "collective"],
                    help="how TP shards travel (auto: shared memory here)")
    ap.add_argument("--buckets", action="store_true",
                    help="load through buckets (engine.load_bucket, as a GPU engine) instead of into the parameters")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(TP):
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=600 if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise SystemExit("\n".join(errors))

    r0 = results[0]
    gib, mib = 1 << 30, 1 << 20
    sync_t = statistics.median(r0["sync_s"])
    copy_t = statistics.median(r0["copy_s"])
    sync_rate, copy_rate = r0["bytes"] / sync_t, r0["bytes"] / copy_t
    print(f"[weight_sync] preset={args.preset} ({r0['engine_params'] / 1e6:.0f}M parameters), {args.dtype}, "
          f"TP={TP} gloo ranks on the CPU, torch threads per rank={args.threads}, "
          f"bucket={args.bucket_mb} MiB, transport={args.transport}, "
          f"{'buckets' if args.buckets else 'direct into the parameters'}, median of {args.repeats} alternating runs "
          "after a warm-up")
    print(f"[weight_sync] Megatron params per rank: {[results[r]['local_params'] / 1e6 for r in range(TP)]} M; "
          f"build {max(results[r]['build_s'] for r in range(TP)):.1f} s")
    print(f"[weight_sync] delivered per sync: {r0['tensors']} tensors, {r0['bytes'] / gib:.3f} GiB, "
          f"{r0['buckets']} buckets")
    print(f"[weight_sync] stream_weights into EmbeddedEngine: {sync_t:.3f} s  -> {sync_rate / gib:.3f} GiB/s, "
          f"{r0['tensors'] / sync_t:.0f} tensors/s   (runs: {', '.join(f'{t:.3f}' for t in r0['sync_s'])})")
    print(f"[weight_sync] plain copy_ of the same tensors: {copy_t:.3f} s  -> {copy_rate / gib:.3f} GiB/s, "
          f"{r0['tensors'] / copy_t:.0f} tensors/s   (runs: {', '.join(f'{t:.3f}' for t in r0['copy_s'])})")
    for r in range(TP):
        res = results[r]
        print(f"[weight_sync] rank {r}: peak held by the sync {res['peak_bytes'] / mib:.1f} MiB "
              f"<= bound {res['bound'] / mib:.1f} MiB (bucket + largest tensor "
              f"{res['largest_tensor_bytes'] / mib:.1f} MiB): "
              f"{res['peak_bytes'] <= res['bound']}; RSS growth over the timed syncs {res['rss_growth'] / mib:.1f} MiB "
              f"(process RSS {res['rss'] / gib:.2f} GiB)")
    print(f"ratio: {sync_rate / copy_rate:.3f}")


if __name__ == "__main__":
    main()
