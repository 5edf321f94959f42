"""TEST DOUBLES for sglang.Engine, which needs a GPU; everything else about SGLang in them is real.

Every method takes exactly the real Engine method's signature, read from SGLang's source
(sglang_source.engine_method); payloads are rebuilt with SGLang's own classes, and names go
through SGLang's Qwen2 weight-name mapping read from its source.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.helpers.sglang_source import engine_method, engine_signature


def hf_state():
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def encode_routes(routes: torch.Tensor) -> str:
    """meta_info["routed_experts"] of one request as SGLang writes it: the detokenizer's own
    _b64_encode_per_request (detokenizer_manager.py) run from source on int32 [tokens, layers, k]."""
    import pybase64

    from tests.helpers.sglang_source import SRT, sglang_function

    encode = sglang_function(SRT / "managers" / "detokenizer_manager.py", "_b64_encode_per_request",
                             "DetokenizerManager", pybase64=pybase64)
    return encode([routes.to(torch.int32)])[0]


def decode_routes(encoded: str):
    """SGLang's own decoder, extract_routed_experts_from_meta_info (state_capturer/routed_experts.py), from source."""
    import numpy as np
    import pybase64

    from tests.helpers.sglang_source import SRT, sglang_function

    decode = sglang_function(SRT / "state_capturer" / "routed_experts.py", "extract_routed_experts_from_meta_info",
                             np=np, pybase64=pybase64)
    return decode({"meta_info": {"routed_experts": encoded}})


def sglang_rank_view(payloads, tp_rank):
    """What SGLang TP rank `tp_rank` does with load_format="flattened_bucket"
    (engine.py _serialize_tensors_per_rank, tp_worker.py deserialize_own_rank,
    model_runner_components/weight_updater.py _update_weights_from_flattened_bucket),
    through SGLang's classes."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    raw = normalize_serialized_named_tensor_payloads(payloads)  # Engine._serialize_tensors_per_rank
    data = MultiprocessingSerializer.deserialize(raw[tp_rank])  # TpModelWorker.deserialize_own_rank
    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx,
                                    numel=m.numel) for m in data["metadata"]]  # the weight updater's conversion
    return FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta).reconstruct_tensors()


class FakeSGLangEngineForTests:
    """TEST DOUBLE for sglang.Engine, which needs a GPU. Every method it has takes exactly the
    real Engine method's signature, read from SGLang's source (sglang_source.engine_method: a
    call with an argument the real Engine lacks is a TypeError). Its update path does what
    Engine.update_weights_from_tensor and each SGLang TP rank do with load_format=
    "flattened_bucket" (sglang_rank_view), then what SGLang's Qwen2 `_legacy_load_weights` does
    with each name (its stacked_params_mapping, read from qwen2.py): a name SGLang would drop
    fails here, and every tensor must have the full HF shape its weight loader slices. It loads
    into a transformers model; generate checks each request's sampling params with SGLang's own
    SamplingParams class and answers in SGLang's output format."""

    def __init__(self, model, tp_size=1):
        from tests.helpers.sglang_source import sglang_param_names, stacked_params_mapping

        self.model, self.tp_size, self.calls = model, tp_size, []
        self.route_shape = None  # (layers, k): what meta_info["routed_experts"] holds per token, when asked
        self.params = dict(model.named_parameters())  # tied embeddings: no lm_head.weight, as in SGLang
        self.mapping = stacked_params_mapping("qwen2", "_legacy_load_weights")
        self.sglang_params = sglang_param_names(self.params, self.mapping)

    @engine_method
    def begin_weight_update(self, selector):
        assert selector == "all"
        self.calls.append("begin")
        return True, "ok"

    @engine_method
    def end_weight_update(self):
        self.calls.append("end")
        return True, "ok"

    @engine_method
    def flush_cache(self):
        self.calls.append("flush")
        return FlushCacheReqOutputForTests(success=True)

    def load_weights(self, rank, named_tensors):
        """SGLang TP rank `rank`'s model.load_weights for the names we push."""
        from tests.helpers.sglang_source import legacy_load_target

        loaded = {}
        for name, t in named_tensors:
            target = legacy_load_target(name, self.sglang_params, self.mapping)
            assert target is not None, f"SGLang's Qwen2 loader would drop {name!r}"
            assert tuple(t.shape) == tuple(self.params[name].shape), (name, t.shape)  # full HF tensor
            loaded[name] = t
        return loaded

    def receive(self, named_tensors, load_format):
        """Every engine TP rank's tensors, as SGLang rebuilds them: {rank: {name: tensor}}."""
        assert load_format == "flattened_bucket"
        assert len(named_tensors) == self.tp_size  # SGLang TP rank r reads entry r
        return {r: self.load_weights(r, sglang_rank_view(named_tensors, r)) for r in range(self.tp_size)}

    @engine_method
    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        self.calls.append("update")
        with torch.no_grad():
            for tensors in self.receive(named_tensors, load_format).values():
                for name, t in tensors.items():
                    self.params[name].copy_(t)
        return True, "Success"

    @engine_method
    def release_memory_occupation(self, tags):
        assert set(tags) <= {"weights", "kv_cache", "cuda_graph"}
        self.calls.append(("release", tuple(tags)))

    @engine_method
    def shutdown(self):
        self.calls.append("shutdown")

    @engine_method
    def resume_memory_occupation(self, tags):
        assert set(tags) <= {"weights", "kv_cache", "cuda_graph"}
        self.calls.append(("resume", tuple(tags)))

    def check_generate_args(self, args):
        """What our calls may set, and each sampling-params dict through SGLang's class."""
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

        set_args = {k for k, v in args.items() if v != engine_signature("generate").parameters[k].default}
        assert set_args <= {"input_ids", "sampling_params", "return_logprob", "return_routed_experts"}, set_args
        assert not args["return_routed_experts"] or self.route_shape is not None
        assert isinstance(args["input_ids"], list) and len(args["sampling_params"]) == len(args["input_ids"])
        for sp in args["sampling_params"]:
            SGLangSamplingParams(**sp).verify(self.model.config.vocab_size)

    @engine_method
    def generate(self, **args):
        self.check_generate_args(args)
        self.calls.append(("generate", len(args["input_ids"])))
        return [{"output_ids": [7, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                 "output_token_logprobs": [(-0.5, 7, None), (-0.25, 2, None)], "weight_version": "default",
                 **self.routes_meta(args, len(ids) + 1)}} for ids in args["input_ids"]]

    def routes_meta(self, args, rows: int) -> dict:
        """meta_info["routed_experts"] when the request asked: expert (token + layer + j) % 4 for j < k."""
        if not args["return_routed_experts"]:
            return {}
        layers, k = self.route_shape
        ids = (torch.arange(rows)[:, None, None] + torch.arange(layers)[None, :, None] + torch.arange(k)) % 4
        return {"routed_experts": encode_routes(ids)}


@dataclass
class FlushCacheReqOutputForTests:
    """Engine.flush_cache's answer (io_struct.FlushCacheReqOutput, which does not import here)."""

    success: bool
    message: str = ""


class FakeColocatedSGLangEngineForTests(FakeSGLangEngineForTests):
    """TEST DOUBLE for a colocated sglang.Engine (GPU only), built from an SGLangEngineConfig,
    with the real Engine's signatures (see FakeSGLangEngineForTests). Each update deserializes
    every engine TP rank's payload with SGLang's classes, puts each name through SGLang's Qwen2
    name mapping, checks the ranks agree, and loads the tensors into a transformers model; it
    tracks released memory and generate refuses to run on released weights."""

    def __init__(self, hf_dir: Path, cfg):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(1000)  # a fresh initialization: only the sync can make it right
        super().__init__(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir)).eval(), cfg.tp_size)
        self.released: set[str] = set()

    @engine_method
    def update_weights_from_tensor(self, named_tensors, load_format, flush_cache):
        assert "weights" not in self.released
        views = self.receive(named_tensors, load_format)
        with torch.no_grad():
            for name, t in views[0].items():
                for r in range(1, self.tp_size):
                    assert torch.equal(views[r][name], t), name  # every engine TP rank gets the full tensor
                self.params[name].copy_(t)
        self.calls.append("update")
        return True, "Success"

    @engine_method
    def release_memory_occupation(self, tags):
        super().release_memory_occupation(tags=tags)
        self.released |= set(tags)

    @engine_method
    def resume_memory_occupation(self, tags):
        super().resume_memory_occupation(tags=tags)
        self.released -= set(tags)

    @engine_method
    def generate(self, **args):
        assert not self.released, f"generate with {self.released} released"
        self.check_generate_args(args)
        self.calls.append(("generate", len(args["input_ids"])))
        outs = []
        with torch.no_grad():
            for ids, sp in zip(args["input_ids"], args["sampling_params"]):
                nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                outs.append({"output_ids": [nxt, sp["sampling_seed"]],
                             "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                           "weight_version": "default"}})
        return outs


class SignalTakingEngineForTests(FakeColocatedSGLangEngineForTests):
    """TEST DOUBLE for a colocated sglang.Engine that also does to the process's signal handlers
    what the real one does (it cannot start here: GPU only):
      - at start (engine.py, _set_envs_and_config): SIGQUIT -> the custom_sigquit_handler it was
        given, else a handler that kills the process (SGLang's kill_process_tree);
      - on its first call (tokenizer_manager.py, auto_create_handle_loop): asyncio handlers on its
        own loop for each signal that function registers, read from SGLang's source
        (sglang_source.first_call_signals): SIGTERM starts a graceful exit, SIGQUIT kills the
        process (running_phase_sigquit_handler)."""

    def __init__(self, hf_dir, cfg, kwargs: dict):
        import asyncio
        import os
        import signal

        super().__init__(hf_dir, cfg)
        self.gracefully_exit = False
        kill = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        signal.signal(signal.SIGQUIT, kwargs.get("custom_sigquit_handler") or kill)
        self.loop = asyncio.new_event_loop()  # Engine._ensure_event_loop
        self._taken = False

    def take_signals(self):
        import os
        import signal

        from tests.helpers.sglang_source import first_call_signals

        if self._taken:
            return
        self._taken = True
        handlers = {"SIGTERM": lambda: setattr(self, "gracefully_exit", True),
                    "SIGQUIT": lambda: os.kill(os.getpid(), signal.SIGKILL)}
        for name in first_call_signals():
            self.loop.add_signal_handler(getattr(signal, name), handlers[name])

    @engine_method
    def release_memory_occupation(self, tags):
        self.take_signals()
        super().release_memory_occupation(tags=tags)

    @engine_method
    def resume_memory_occupation(self, tags):
        self.take_signals()
        super().resume_memory_occupation(tags=tags)


class SeededSamplingEngineForTests(FakeSGLangEngineForTests):
    """TEST DOUBLE for sglang.Engine under enable_deterministic_inference, sampling as SGLang's sampler
    does there (layers/sampler.py multinomial_with_seed, read in tests/unit/test_sglang_api.py): each
    token's Gumbel noise is a function of the request's sampling_seed and the position it is sampled
    at only (SGLang hashes them with murmur_hash32, a CUDA/sgl_kernel op; a torch.Generator seeded
    from the pair stands in), that position being the last input position of a prefill and the
    input token's position of a decode step (model_executor/model_runner.py `sample`). Greedy at
    temperature 0, stop tokens kept (no_stop_trim), logprobs of the temperature-scaled softmax."""

    @engine_method
    def generate(self, **args):
        self.check_generate_args(args)
        self.calls.append(("generate", len(args["input_ids"])))
        outs = []
        with torch.no_grad():
            for ids, sp in zip(args["input_ids"], args["sampling_params"]):
                seq, new, logps, reason = list(ids), [], [], "length"
                for _ in range(sp["max_new_tokens"]):
                    logits = self.model(torch.tensor([seq])).logits[0, -1].double()
                    scaled = logits / max(sp["temperature"], 1e-6)
                    g = torch.Generator().manual_seed(sp["sampling_seed"] * 1_000_003 + len(seq) - 1)
                    u = torch.rand(len(logits), generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
                    noise = -torch.log(-torch.log(u))
                    tok = int(scaled.argmax()) if sp["temperature"] == 0 else int((scaled + noise).argmax())
                    new.append(tok)
                    logps.append(float(torch.log_softmax(scaled, -1)[tok]))
                    seq.append(tok)
                    if tok in sp.get("stop_token_ids", ()):
                        reason = "stop"
                        break
                outs.append({"output_ids": new, "meta_info": {
                    "finish_reason": {"type": reason} | ({"matched": new[-1]} if reason == "stop"
                                                         else {"length": len(new)}),
                    "output_token_logprobs": [(lp, t, None) for lp, t in zip(logps, new)],
                    "weight_version": "default"}})
        return outs
