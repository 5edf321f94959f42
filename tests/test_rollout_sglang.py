"""SGLang payloads through SGLang's own classes (CPU tensors), the engine wrapper's call order,
and the HTTP client against a real loopback server that records requests."""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from sglang_source import check_request_body, engine_method, engine_signature
from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout.buckets import FlatBucket, group_into_buckets
from vapo_megatron.rollout.sglang_engine import (
    SGLangEngine, serialize_flattened_bucket, to_flattened_bucket,
)
from vapo_megatron.rollout.sglang_http import HttpEngine


def hf_state():
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def sglang_rank_view(payloads, tp_rank):
    """What SGLang TP rank `tp_rank` does with load_format="flattened_bucket"
    (engine.py _serialize_tensors_per_rank, tp_worker.py deserialize_own_rank,
    model_runner_components/weight_updater.py _update_weights_from_flattened_bucket),
    through SGLang's classes."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    raw = normalize_serialized_named_tensor_payloads(payloads)  # Engine._serialize_tensors_per_rank
    data = MultiprocessingSerializer.deserialize(raw[tp_rank])  # TpModelWorker.deserialize_own_rank
    meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx,
                                    numel=m.numel) for m in data["metadata"]]  # the weight updater's conversion
    return FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=meta).reconstruct_tensors()


def test_flat_bucket_payload_round_trips_through_sglang():
    _, state = hf_state()
    received = {}
    bucket = FlatBucket(4000)

    def deliver():
        # The payload shares the bucket's memory (as CUDA IPC does on a GPU): like SGLang's
        # loaders, copy out before the buffer is reused for the next bucket.
        received.update({n: t.clone() for n, t in sglang_rank_view([serialize_flattened_bucket(to_flattened_bucket(bucket))], 0)})

    for name, t in state.items():
        if not bucket.fits(t):
            deliver()
            bucket.clear()
        bucket.add(name, t)
    deliver()
    assert list(received) == list(state)  # same HF names, same order
    assert "model.layers.0.self_attn.q_proj.weight" in received and "model.layers.1.mlp.up_proj.weight" in received
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in received)
    for name, t in state.items():
        assert torch.equal(received[name], t), name


def test_list_buckets_and_base64_payloads_round_trip():
    _, state = hf_state()
    for group in group_into_buckets(state.items(), 3000):
        fb = to_flattened_bucket(group)
        as_text = serialize_flattened_bucket(fb, output_str=True)  # what the HTTP API carries
        for name, t in sglang_rank_view([as_text], 0):
            assert torch.equal(t, state[name])
    with pytest.raises(ValueError, match="one dtype"):
        to_flattened_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])


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
        from sglang_source import sglang_param_names, stacked_params_mapping

        self.model, self.tp_size, self.calls = model, tp_size, []
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
        from sglang_source import legacy_load_target

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
    def resume_memory_occupation(self, tags):
        assert set(tags) <= {"weights", "kv_cache", "cuda_graph"}
        self.calls.append(("resume", tuple(tags)))

    def check_generate_args(self, args):
        """What our calls may set, and each sampling-params dict through SGLang's class."""
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

        set_args = {k for k, v in args.items() if v != engine_signature("generate").parameters[k].default}
        assert set_args <= {"input_ids", "sampling_params", "return_logprob"}, set_args
        assert isinstance(args["input_ids"], list) and len(args["sampling_params"]) == len(args["input_ids"])
        for sp in args["sampling_params"]:
            SGLangSamplingParams(**sp).verify(self.model.config.vocab_size)

    @engine_method
    def generate(self, **args):
        self.check_generate_args(args)
        self.calls.append(("generate", len(args["input_ids"])))
        return [{"output_ids": [7, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                 "output_token_logprobs": [(-0.5, 7, None), (-0.25, 2, None)], "weight_version": "default"}}
                for _ in args["input_ids"]]


@dataclass
class FlushCacheReqOutputForTests:
    """Engine.flush_cache's answer (io_struct.FlushCacheReqOutput, which does not import here)."""

    success: bool
    message: str = ""


def test_engine_wrapper_streams_buckets_and_keeps_the_order():
    source, state = hf_state()
    target, _ = hf_state()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    fake = FakeSGLangEngineForTests(target)
    eng = SGLangEngine(fake)
    eng.release_memory()
    eng.resume_memory(("weights",))
    stats = eng.update_weights(state.items(), version=3, bucket_bytes=5000)
    assert stats.buckets > 1 and eng.weight_version == 3
    assert fake.calls[:3] == [("release", ("weights", "kv_cache", "cuda_graph")), ("resume", ("weights",)), "begin"]
    assert fake.calls[3:] == ["update"] * stats.buckets + ["end", "flush"]
    for name, t in target.state_dict().items():
        assert torch.equal(t, state[name]), name
    outs = eng.generate([[1, 2], [3]], SamplingParams(n=2, max_new_tokens=4))
    assert [o.prompt_index for o in outs] == [0, 0, 1, 1]
    assert outs[0].token_ids == [7, 2] and outs[0].finish_reason == "stop" and outs[0].logprobs == [-0.5, -0.25]
    assert outs[0].weight_version == 3


# The io_struct request class each SGLang HTTP endpoint parses its body into (http_server.py).
REQUEST_STRUCTS = {
    "/generate": "GenerateReqInput", "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}


class _Recorder(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.path in REQUEST_STRUCTS:
            check_request_body(REQUEST_STRUCTS[self.path], body)  # the fields SGLang's request class has
        if self.path == "/update_weights_from_tensor" and not self.server.fail_updates:
            # Like a real server, load during the request: the payload points at the client's
            # bucket buffer (shared memory here, CUDA IPC on a GPU), reused for the next bucket.
            assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 1
            base64.b64decode(body["serialized_named_tensors"][0], validate=True)
            self.server.loaded.update({n: t.clone() for n, t in sglang_rank_view(body["serialized_named_tensors"], 0)})
        if self.path == "/flush_cache":
            out, ctype = b"Cache flushed.\n", "text/plain"
        elif self.path == "/generate":
            out = json.dumps([{"output_ids": [5], "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                                                "output_token_logprobs": [[-1.0, 5, None]], "weight_version": "9"}}
                              for _ in body["input_ids"]]).encode()
            ctype = "application/json"
        elif self.path == "/update_weights_from_tensor" and self.server.fail_updates:
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"success": False, "message": "not in a weight-update session"}).encode())
            return
        else:
            out, ctype = json.dumps({"success": True, "message": "ok"}).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.requests, srv.loaded, srv.fail_updates = [], {}, False
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_http_client_sends_sglang_requests(server):
    _, state = hf_state()
    eng = SGLangEngine(HttpEngine(f"http://127.0.0.1:{server.server_address[1]}"))
    eng.release_memory()  # as after start-up; the wrapper then resumes only what was released
    eng.resume_memory(("weights",))
    stats = eng.update_weights(state.items(), version=9, bucket_bytes=20000)
    eng.resume_memory(("kv_cache", "cuda_graph"))
    outs = eng.generate([[1, 2, 3]], SamplingParams(n=2, temperature=0.5, max_new_tokens=1, seed=4, stop_token_ids=(2,)))
    eng.release_memory()
    paths = [p for p, _ in server.requests]
    assert paths == (["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update"] + ["/update_weights_from_tensor"] * stats.buckets
                     + ["/end_weight_update", "/flush_cache", "/resume_memory_occupation",
                        "/generate", "/release_memory_occupation"])
    got = server.loaded
    assert list(got) == list(state) and all(torch.equal(got[n], state[n]) for n in state)
    gen = dict(server.requests)["/generate"]
    assert gen["input_ids"] == [[1, 2, 3]] * 2 and gen["return_logprob"] is True
    assert [s["sampling_seed"] for s in gen["sampling_params"]] == [4, 5]
    assert gen["sampling_params"][0]["stop_token_ids"] == [2] and gen["sampling_params"][0]["temperature"] == 0.5
    assert [o.weight_version for o in outs] == [9, 9] and outs[0].finish_reason == "length"
    server.fail_updates = True
    eng.begin_weight_update()
    with pytest.raises(RuntimeError, match="not in a weight-update session"):
        eng.load_bucket(list(state.items())[:1])


def test_http_client_refuses_other_hosts():
    with pytest.raises(ValueError, match="loopback"):
        HttpEngine("http://10.1.2.3:30000")
    HttpEngine("http://localhost:30000")
    HttpEngine("http://[::1]:30000")
