"""A client for SGLang servers started separately (`python -m sglang.launch_server ...`), with
the same calls as sglang.Engine so SGLangEngine drives either. Standard library only (urllib),
loopback addresses only: weights travel as CUDA IPC handles, which only mean something on the
same machine, and the admin endpoints must not be reachable from elsewhere.

At start-up, `server_tp_size` reads the server's TP size from GET /server_info: a weight update
carries one payload per server TP rank (SGLang TP rank r deserializes entry r).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import urllib.error
import urllib.request
from typing import Any, Sequence
from urllib.parse import urlparse


def _check_loopback(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"SGLang server url {url!r}: expected http://<loopback host>:<port>")
    host = parsed.hostname
    if host != "localhost":
        try:
            loop = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loop = False
        if not loop:
            raise ValueError(f"SGLang server url {url!r}: only loopback addresses (127.0.0.0/8, ::1, localhost) "
                             "are allowed")
    return url.rstrip("/")


class HttpEngine:
    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = _check_loopback(url)
        self.timeout_s = timeout_s

    def _request(self, endpoint: str, payload: dict | None = None, *, method: str = "POST") -> Any:
        body = None if method == "GET" else json.dumps(payload or {}).encode()
        req = urllib.request.Request(f"{self.url}/{endpoint}", data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
                is_json = resp.headers.get_content_type() == "application/json"
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise RuntimeError(f"SGLang server {self.url}/{endpoint} answered HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"SGLang server {self.url}/{endpoint} unreachable: {e.reason}") from None
        if not is_json:  # /flush_cache answers plain text (errors come as HTTP 400 above)
            return {"success": True, "message": raw.decode(errors="replace")}
        return json.loads(raw) if raw else None

    def server_tp_size(self, key: str, *, routes: bool = False) -> int:
        """The server's TP size, from GET /server_info (SGLang's resolved ServerArgs:
        entrypoints/http_server.py server_info). Every TP rank of the server deserializes entry
        tp_rank of an update's payload list (managers/tp_worker.py deserialize_own_rank), so an update
        needs one payload per rank. Refused at start-up, in one ConfigError naming `key`: a server
        that does not answer, that reports no TP size, or that runs data-parallel replicas (its
        update_weights_from_tensor asserts dp_size == 1: managers/tokenizer_control_mixin.py), or,
        with `routes` (routing replay), one started without --enable-return-routed-experts."""
        from vapo_megatron.config import ConfigError

        try:
            info = self._request("server_info", method="GET")
        except RuntimeError as e:
            raise ConfigError(f"{key}: {e} (start the server before the trainer)") from None
        tp, dp = (info.get(k) if isinstance(info, dict) else None for k in ("tp_size", "dp_size"))
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"{key}: {self.url}/server_info reports no tp_size (got {tp!r}); "
                              "an SGLang server reports its ServerArgs there")
        if dp not in (None, 1):
            raise ConfigError(f"{key}: the SGLang server at {self.url} runs dp_size={dp}, and SGLang updates "
                              "weights from tensors only at dp_size=1: start it without --dp-size")
        if routes and info.get("enable_return_routed_experts") is not True:
            raise ConfigError(f"{key}: rollout.routing_replay is on, but the SGLang server at {self.url} does not "
                              "return routed experts: start it with --enable-return-routed-experts")
        return tp

    def generate(self, *, input_ids: Sequence[Sequence[int]], sampling_params: Sequence[dict], return_logprob: bool,
                 return_routed_experts: bool = False):
        body = {"input_ids": [list(x) for x in input_ids], "sampling_params": list(sampling_params),
                "return_logprob": return_logprob}
        if return_routed_experts:
            body["return_routed_experts"] = True
        return self._request("generate", body)

    def begin_weight_update(self):
        return self._request("begin_weight_update", {"selector": "all"})

    def end_weight_update(self):
        return self._request("end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors: Sequence[bytes | str], load_format: str | None = None,
                                   flush_cache: bool = True):
        """`named_tensors`: one serialized payload per engine TP rank (bytes go as base64, the
        JSON form SGLang's HTTP schema decodes)."""
        payloads = [p if isinstance(p, str) else base64.b64encode(p).decode() for p in named_tensors]
        return self._request("update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                            "load_format": load_format, "flush_cache": flush_cache})

    def release_memory_occupation(self, tags: list[str] | None = None):
        return self._request("release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None):
        return self._request("resume_memory_occupation", {"tags": tags})

    def flush_cache(self):
        return self._request("flush_cache", {})
