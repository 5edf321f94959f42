"""SGLang payloads through SGLang's own classes (CPU tensors), the engine wrapper's call order,
and the HTTP client, built as the trainer builds it, against a real loopback server that records
requests and loads every update as each of its TP ranks does (TP 1 and 2)."""

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.helpers.sglang_doubles import FakeSGLangEngineForTests, encode_routes, hf_state, sglang_rank_view
from tests.helpers.sglang_source import check_request_body
from vapo_megatron.rollout.base import SamplingParams
from vapo_megatron.rollout.buckets import FlatBucket, group_into_buckets
from vapo_megatron.rollout.sglang_engine import (
    SGLangEngine,
    serialize_flattened_bucket,
    to_flattened_bucket,
)
from vapo_megatron.rollout.sglang_http import HttpEngine


def test_flat_bucket_payload_round_trips_through_sglang():
    _, state = hf_state()
    received = {}
    bucket = FlatBucket(4000)

    def deliver():
        # The payload shares the bucket's memory (as CUDA IPC does on a GPU): like SGLang's
        # loaders, copy out before the buffer is reused for the next bucket.
        received.update({n: t.clone()
                         for n, t in sglang_rank_view([serialize_flattened_bucket(to_flattened_bucket(bucket))], 0)})

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


def test_closing_the_generator_stops_the_engine_it_started():
    """Before: Generator.close asked the SGLangEngine wrapper for a shutdown it did not have, so a
    colocated Engine's scheduler and detokenizer outlived the run (a forked process, which runs no
    atexit handler, never ended; tests/distributed/test_sglang_colocated_real.py)."""
    from vapo_megatron.rollout.generator import Generator

    source, _ = hf_state()
    fake = FakeSGLangEngineForTests(source)
    gen = object.__new__(Generator)  # its engine alone: Generator() itself is collective
    gen.engine = SGLangEngine(fake)
    gen.close()
    assert fake.calls == ["shutdown"]


def test_cpu_payloads_load_in_a_process_the_trainer_did_not_start(tmp_path):
    """A server started on its own (sglang_http) reads a CPU payload. Before: CPU tensors went as
    file descriptors, which only the sender's child processes may fetch (multiprocessing's authkey),
    and sglang.launch_server's scheduler died of AuthenticationError on the first update
    (tests/distributed/test_sglang_server_real.py)."""
    import subprocess
    import sys

    from tests.helpers.train_runs import ROOT

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    fb = to_flattened_bucket([("w", t)])  # alive until loaded, as load_bucket keeps its bucket
    (tmp_path / "payload").write_bytes(serialize_flattened_bucket(fb))
    code = ("import sys, torch; from sglang.srt.utils import MultiprocessingSerializer as M; "
            "d = M.deserialize(open(sys.argv[1], 'rb').read()); print(d['flattened_tensor'].sum().item())")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "payload")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    want = float(fb.get_flattened_tensor().sum())  # SGLang flattens to bytes (uint8)
    assert proc.returncode == 0 and float(proc.stdout.split()[-1]) == want, proc.stderr[-2000:]


def test_list_buckets_and_base64_payloads_round_trip():
    _, state = hf_state()
    for group in group_into_buckets(state.items(), 3000):
        fb = to_flattened_bucket(group)
        as_text = serialize_flattened_bucket(fb, output_str=True)  # what the HTTP API carries
        for name, t in sglang_rank_view([as_text], 0):
            assert torch.equal(t, state[name])
    with pytest.raises(ValueError, match="one dtype"):
        to_flattened_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])


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


def _server_info(tp: int, dp: int = 1, routes: bool = False) -> dict:
    """What GET /server_info answers (http_server.py server_info), built by SGLang's own code."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import build_server_info
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    args = ServerArgs(model_path="/m", tp_size=tp, dp_size=dp, enable_return_routed_experts=routes)
    return msgspec_to_builtins(build_server_info(args, {}))


def routes_of(ids: list[int], layers: int, k: int) -> torch.Tensor:
    """The stand-in's routes of a request: expert (token id + layer + j) % 4 for the j-th of k."""
    return (torch.tensor(ids)[:, None, None] + torch.arange(layers)[None, :, None] + torch.arange(k)) % 4


class _Recorder(BaseHTTPRequestHandler):
    """A loopback stand-in for an SGLang server of `server.tp` TP ranks: it records the requests,
    checks each body against SGLang's request struct, and loads each weight update during the
    request as every TP rank does: rank r reads entry r of the payload list (tp_worker.py
    deserialize_own_rank; a missing entry is an IndexError that kills a real server)."""

    def _answer(self, code: int, out: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self.server.requests.append((self.path, None))
        assert self.path == "/server_info", self.path
        self._answer(200, json.dumps(self.server.info).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.path in REQUEST_STRUCTS:
            check_request_body(REQUEST_STRUCTS[self.path], body)  # the fields SGLang's request class has
        if self.path == "/update_weights_from_tensor" and not self.server.fail_updates:
            # Like a real server, load during the request: the payload points at the client's
            # bucket buffer (shared memory here, CUDA IPC on a GPU), reused for the next bucket.
            payloads = body["serialized_named_tensors"]
            assert body["load_format"] == "flattened_bucket"
            assert all(base64.b64decode(p, validate=True) for p in payloads)
            # One entry per server TP rank, each serialized on its own (CUDA IPC refcounts); a CPU
            # payload names its shared memory, so the entries are equal bytes here.
            assert len(payloads) == self.server.tp
            for r in range(self.server.tp):
                try:
                    view = sglang_rank_view(payloads, r)
                except IndexError as e:
                    return self._answer(500, f"TP rank {r}: IndexError: {e}".encode(), "text/plain")
                self.server.loaded[r].update({n: t.clone() for n, t in view})
        if self.path == "/flush_cache":
            out, ctype = b"Cache flushed.\n", "text/plain"
        elif self.path == "/generate":
            asked = body.get("return_routed_experts", False)  # rows: the prompt and the one response token, less one
            out = json.dumps([{"output_ids": [5], "meta_info": {
                "finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-1.0, 5, None]],
                "weight_version": "9",
                **({"routed_experts": encode_routes(routes_of(ids, *self.server.route_shape))} if asked else {})}}
                for ids in body["input_ids"]]).encode()
            ctype = "application/json"
        elif self.path == "/update_weights_from_tensor" and self.server.fail_updates:
            return self._answer(400,
                                json.dumps({"success": False, "message": "not in a weight-update session"}).encode())
        else:
            out, ctype = json.dumps({"success": True, "message": "ok"}).encode(), "application/json"
        self._answer(200, out, ctype)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(tp, dp=1): a loopback SGLang stand-in of tp TP ranks, stopped after the test."""
    servers = []

    def start(tp: int, dp: int = 1):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        srv.tp, srv.info, srv.requests, srv.fail_updates = tp, _server_info(tp, dp), [], False
        srv.route_shape = (4, 2)  # (MoE layers, k) of the routes it answers when asked
        srv.loaded = [{} for _ in range(tp)]
        srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _http_engine(monkeypatch, url: str, model: str = "", replay: bool | None = None):
    """The trainer's engine for rollout.engine=sglang_http, built where the trainer builds it."""
    from model_providers import read_hf_config
    from vapo_megatron.config import Config, ModelConfig, RolloutConfig, SGLangHttpConfig
    from vapo_megatron.data.routes import replays
    from vapo_megatron.mcore import parallel
    from vapo_megatron.rollout.generator import build_engine

    for name in ("tp_rank", "pp_rank", "dp_rank"):  # the replica's first rank holds the engine
        monkeypatch.setattr(parallel, name, lambda: 0)
    cfg = Config(model=ModelConfig(hf_path=model or _dense_dir()),
                 rollout=RolloutConfig(engine="sglang_http", sglang_http=SGLangHttpConfig(urls=(url,)),
                                       routing_replay=replay))
    return build_engine(cfg, routes=replays(cfg, read_hf_config(cfg.model.hf_path)))  # as the trainer resolves it


def _dense_dir() -> str:
    import tempfile

    from tests.helpers.tiny_hf import qwen2_config

    path = Path(tempfile.mkdtemp(prefix="dense-"))
    qwen2_config(tied=False).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tp", [1, 2])
def test_http_client_sends_sglang_requests(serve, monkeypatch, tp):
    _, state = hf_state()
    server = serve(tp)
    eng = _http_engine(monkeypatch, server.url)
    eng.release_memory()  # as after start-up; the wrapper then resumes only what was released
    eng.resume_memory(("weights",))
    stats = eng.update_weights(state.items(), version=9, bucket_bytes=20000)
    eng.resume_memory(("kv_cache", "cuda_graph"))
    outs = eng.generate([[1, 2, 3]],
                        SamplingParams(n=2, temperature=0.5, max_new_tokens=1, seed=4, stop_token_ids=(2,)))
    eng.release_memory()
    paths = [p for p, _ in server.requests]
    assert paths == (["/server_info", "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update"]
                     + ["/update_weights_from_tensor"] * stats.buckets
                     + ["/end_weight_update", "/flush_cache", "/resume_memory_occupation",
                        "/generate", "/release_memory_occupation"])
    for got in server.loaded:  # every server TP rank loaded every tensor
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


def test_http_engine_refuses_unusable_servers_at_start(serve, monkeypatch):
    from vapo_megatron.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.sglang_http.urls\[0\]: the SGLang server at .* runs dp_size=2"):
        _http_engine(monkeypatch, serve(2, dp=2).url)
    other = serve(2)
    other.info = {"version": "?"}
    with pytest.raises(ConfigError, match=r"rollout.sglang_http.urls\[0\]: .*/server_info reports no tp_size"):
        _http_engine(monkeypatch, other.url)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=r"rollout.sglang_http.urls\[0\]: .* unreachable.*start the server"):
        _http_engine(monkeypatch, f"http://127.0.0.1:{port}")


def test_http_client_refuses_other_hosts():
    with pytest.raises(ValueError, match="loopback"):
        HttpEngine("http://10.1.2.3:30000")
    HttpEngine("http://localhost:30000")
    HttpEngine("http://[::1]:30000")


def test_sglang_engines_return_the_routes_sglang_sends(serve, monkeypatch, tmp_path):
    """Routing replay: a colocated engine (the double, real Engine.generate signature) and an HTTP
    server (requests checked against GenerateReqInput) answer meta_info["routed_experts"] as SGLang
    encodes it; the wrapper asks only when the sampling asks, and reads [prompt + response - 1, L, k]."""
    from tests.helpers.tiny_hf import qwen3_moe_config

    fake = FakeSGLangEngineForTests(hf_state()[0])
    fake.route_shape = (3, 2)
    eng = SGLangEngine(fake, routes=(3, 2, 4))
    outs = eng.generate([[1, 2], [3]], SamplingParams(n=1, max_new_tokens=4, return_routes=True))
    assert [tuple(o.routes.shape) for o in outs] == [(3, 3, 2), (2, 3, 2)]  # prompt + 2 output tokens - 1
    assert outs[0].routes[2, 1].tolist() == [3, 0] and outs[0].routes.dtype == torch.uint8
    assert eng.generate([[1]], SamplingParams(max_new_tokens=2))[0].routes is None
    with pytest.raises(ValueError, match="not built for routing replay"):
        SGLangEngine(fake).generate([[1]], SamplingParams(return_routes=True))
    moe = tmp_path / "moe"
    qwen3_moe_config(mlp_only_layers=()).save_pretrained(moe)  # 4 MoE layers (SGLang builds no dense ones)
    server = serve(1)
    server.info = _server_info(1, routes=True)
    http = _http_engine(monkeypatch, server.url, str(moe))  # routing replay: on by default for a MoE model
    assert http.routes == (4, 2, 4)
    http.resume_memory(("kv_cache", "cuda_graph"))
    (out,) = http.generate([[7, 8, 9]], SamplingParams(max_new_tokens=1, return_routes=True))
    assert torch.equal(out.routes.long(), routes_of([7, 8, 9], 4, 2).long())
    assert dict(server.requests)["/generate"]["return_routed_experts"] is True
    from vapo_megatron.config import ConfigError

    with pytest.raises(ConfigError,
                       match=r"rollout.sglang_http.urls\[0\]: rollout.routing_replay is on, but the SGLang "
                       r"server at .* --enable-return-routed-experts"):
        _http_engine(monkeypatch, serve(1).url, str(moe))
    assert _http_engine(monkeypatch, serve(1).url, str(moe), replay=False).routes is None


@pytest.mark.parametrize("engine_flag", [None, "--engine"])
def test_deterministic_sampling_is_refused_on_sglangs_cpu_engine(monkeypatch, engine_flag):
    """sglang 0.5.23 refuses enable_deterministic_inference with its CPU attention backends
    (tests/unit/test_sglang_api.py reads why); trainer.deterministic (vapo-eval's --deterministic)
    asks for it. Before: vapo-train started, built its models and died in sglang.Engine's argument
    resolution with SGLang's traceback; now the start is refused naming the setting."""
    from tests.helpers.sglang_world import SGLANG_DOUBLES
    from vapo_megatron.config import Config, RolloutConfig, TrainerConfig
    from vapo_megatron.config.preflight import hardware_problems

    def cfg(deterministic):
        return Config(rollout=RolloutConfig(engine="sglang"), trainer=TrainerConfig(deterministic=deterministic))

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.syspath_prepend(str(SGLANG_DOUBLES))  # sgl-kernel's CPU build, as the suite's SGLang world has it
    flag = "--deterministic" if engine_flag else "trainer.deterministic=true"
    (msg,) = hardware_problems(cfg(True), cuda=False, engine_flag=engine_flag,
                               deterministic_flag=engine_flag and "--deterministic")
    assert msg.startswith(f"{flag} with SGLang's CPU engine") and "torch_native" in msg, msg
    assert hardware_problems(cfg(False), cuda=False, engine_flag=engine_flag) == []
    assert hardware_problems(cfg(True), cuda=True, engine_flag=engine_flag) == []  # SGLang's GPU engine: allowed


@pytest.mark.parametrize("engine_flag", [None, "--engine"])
def test_sglang_without_sgl_kernel_is_refused_at_start_up(monkeypatch, engine_flag):
    """Issue 63, defect 9: rollout.engine=sglang with SGLANG_USE_CPU_ENGINE=1 and no sgl-kernel passed the
    start-up checks; the run built its models, started the engine and died 29 s later in SGLang's
    scheduler (`ModuleNotFoundError: No module named 'sgl_kernel'`). Now one line naming the setting and
    what to install, before any work. The module is really absent in this process (the suite's double,
    tests/doubles/sglang, is on the path only in SGLang's world); with the double on the path, no problem.
    On a GPU (CUDA visible) the same check names PyPI's sglang-kernel with sglang's own pin."""
    import importlib.metadata
    import importlib.util

    from tests.helpers.sglang_world import SGLANG_DOUBLES
    from vapo_megatron.config import Config, RolloutConfig
    from vapo_megatron.config.preflight import hardware_problems

    assert importlib.util.find_spec("sgl_kernel") is None  # what the test is about: not installed here
    cfg = Config(rollout=RolloutConfig(engine="sglang"))
    setting = f"{engine_flag} sglang" if engine_flag else "rollout.engine=sglang"
    embedded = f"{engine_flag} embedded" if engine_flag else "rollout.engine=embedded"
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    (msg,) = hardware_problems(cfg, cuda=False, engine_flag=engine_flag)
    assert msg.startswith(f"{setting} with SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel's CPU build "
                          "(the module sgl_kernel), which is not installed"), msg
    assert f"or use {embedded} on a CPU" in msg and "\n" not in msg, msg

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")  # SGLang's GPU engine, on a machine with GPUs
    (msg,) = hardware_problems(cfg, cuda=True, engine_flag=engine_flag)
    pin = next(r for r in importlib.metadata.requires("sglang") if r.startswith("sglang-kernel"))
    assert msg == (f"{setting} needs sgl-kernel (the module sgl_kernel: PyPI's {pin}, which sglang requires), which "
                   "is not installed: pip install -e '.[gpu]' installs it with sglang"), msg
    (msg,) = hardware_problems(cfg, cuda=False, engine_flag=engine_flag)  # no GPU: that refusal, not the kernel's
    assert "needs CUDA GPUs and none is visible" in msg, msg

    monkeypatch.syspath_prepend(str(SGLANG_DOUBLES))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert hardware_problems(cfg, cuda=False, engine_flag=engine_flag) == []
