"""A client for SGLang servers started separately (`python -m sglang.launch_server ...`), with
the same calls as sglang.Engine so SGLangEngine drives either. Standard library only (urllib),
loopback addresses only: weights travel as CUDA IPC handles, which only mean something on the
same machine, and the admin endpoints must not be reachable from elsewhere.
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
            raise ValueError(f"SGLang server url {url!r}: only loopback addresses (127.0.0.0/8, ::1, localhost) are allowed")
    return url.rstrip("/")


class HttpEngine:
    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = _check_loopback(url)
        self.timeout_s = timeout_s

    def _post(self, endpoint: str, payload: dict | None = None) -> Any:
        body = json.dumps(payload or {}).encode()
        req = urllib.request.Request(f"{self.url}/{endpoint}", data=body, method="POST",
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

    def generate(self, *, input_ids: Sequence[Sequence[int]], sampling_params: Sequence[dict], return_logprob: bool):
        return self._post("generate", {"input_ids": [list(x) for x in input_ids],
                                       "sampling_params": list(sampling_params), "return_logprob": return_logprob})

    def begin_weight_update(self):
        return self._post("begin_weight_update", {"selector": "all"})

    def end_weight_update(self):
        return self._post("end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors: Sequence[bytes | str], load_format: str | None = None,
                                   flush_cache: bool = True):
        """`named_tensors`: one serialized payload per engine TP rank (bytes go as base64, the
        JSON form SGLang's HTTP schema decodes)."""
        payloads = [p if isinstance(p, str) else base64.b64encode(p).decode() for p in named_tensors]
        return self._post("update_weights_from_tensor", {"serialized_named_tensors": payloads,
                                                         "load_format": load_format, "flush_cache": flush_cache})

    def release_memory_occupation(self, tags: list[str] | None = None):
        return self._post("release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None):
        return self._post("resume_memory_occupation", {"tags": tags})

    def flush_cache(self):
        return self._post("flush_cache", {})
