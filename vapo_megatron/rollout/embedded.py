"""Rollout engine on a transformers causal LM, in this process (the CPU default; one GPU works).

The model is built once; weight updates copy full HF-named tensors into the existing parameters
(no rebuild). Sampling is a small batched loop over a DynamicCache with left padding. Every sample
draws from its own torch.Generator seeded with SamplingParams.sample_seed, so sample j of prompt
i gets the same response whatever else is in the batch, and a run is reproducible given the seed.
A mixture-of-experts model's routers are watched (data/routes.py, RouteRecorder): asked for
(SamplingParams.return_routes), each output carries the experts its tokens were routed to.
"""

from __future__ import annotations

from typing import Sequence

import torch

from vapo_megatron.data.routes import RouteRecorder
from vapo_megatron.rollout.base import MEMORY_TAGS, Continuation, RolloutEngine, RolloutOutput, SamplingParams
from vapo_megatron.rollout.buckets import FlatBucket


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k / the top-p nucleus to -inf. logits: [B, V] (already / T)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class EmbeddedEngine(RolloutEngine):
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        max_batch_size: int = 1024,
        direct_load: bool = True,
    ) -> None:
        """direct_load: weight updates may write into the parameters (`weight_slot`); False
        makes every update go through load_bucket, as a GPU engine's would."""
        self.model = model.eval()
        self.direct_load = direct_load
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        # Every name the model answers to, tied aliases included (lm_head.weight -> embed), and
        # each routed expert's checkpoint names as views into transformers' fused expert tensors.
        named = dict(model.named_parameters(remove_duplicate=False))
        views = expert_views(named)
        fused = {n[: -len("gate_up_proj")] + f for n in named if n in _fused_experts(named)
                 for f in ("gate_up_proj", "down_proj")}
        self._params = {**{n: p for n, p in named.items() if n not in fused}, **views}
        self._version = -1
        self._updating = False
        self._loaded: set[str] = set()
        experts = getattr(model.config, "num_experts", None)
        self.recorder = RouteRecorder(model, experts) if experts else None

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       **kw) -> "EmbeddedEngine":
        """An engine with freshly initialized weights (they are replaced by the first sync)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
        return cls(model, eos_token_ids=_eos_ids(config), **kw)

    @classmethod
    def from_pretrained(cls, hf_dir: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        **kw) -> "EmbeddedEngine":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
        return cls(model, eos_token_ids=_eos_ids(model.config), **kw)

    # ---- weights ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def begin_weight_update(self) -> None:
        if self._updating:
            raise RuntimeError("begin_weight_update called twice without end_weight_update")
        self._updating = True
        self._loaded = set()

    def _param(self, name: str, shape) -> torch.Tensor:
        if not self._updating:
            raise RuntimeError("weights can only be loaded inside begin_weight_update()/end_weight_update()")
        param = self._params.get(name)
        if param is None:
            raise KeyError(
                f"weight {name!r} is not a parameter of the rollout model "
                f"({type(self.model).__name__}); known names start with "
                f"{sorted(self._params)[:4]}..."
            )
        if param.shape != shape:
            raise ValueError(f"weight {name!r}: got shape {tuple(shape)}, the model has {tuple(param.shape)}")
        self._loaded.add(name)
        return param

    def weight_slot(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """The live parameter itself (detached: same storage), counted as loaded."""
        if not self.direct_load:
            return None
        return self._param(name, shape).detach()

    @torch.no_grad()
    def load_bucket(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        if isinstance(named_tensors, FlatBucket):
            named_tensors = named_tensors.named_tensors()
        for name, tensor in named_tensors:
            self._param(name, tensor.shape).copy_(tensor)  # in place: casts dtype, moves device

    def end_weight_update(self, version: int, *, strict: bool = True) -> None:
        if not self._updating:
            raise RuntimeError("end_weight_update without begin_weight_update")
        self._updating = False
        if strict:
            # A tied alias counts as loaded when the tensor it shares is.
            loaded = {id(self._params[n]) for n in self._loaded}
            missing = sorted(n for n, p in self._params.items() if n not in self._loaded and id(p) not in loaded)
            if missing:
                raise RuntimeError(f"weight update left {len(missing)} parameters unset, e.g. {missing[:5]}")
        self._version = version

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        # Nothing to give back on the CPU; on one GPU the trainer and this model share memory
        # and the model is small next to the trainer's state, so it stays resident.
        pass

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        pass

    # ---- sampling ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[RolloutOutput]:
        if params.return_routes and (self.recorder is None or not self.recorder.routers):
            raise ValueError(f"routes asked for, but the rollout model ({type(self.model).__name__}) has no "
                             "mixture-of-experts routers")
        per_chunk = max(1, self.max_batch_size // params.n)
        outs: list[RolloutOutput] = []
        if self.recorder is not None:
            self.recorder.recording = params.return_routes
        try:
            for lo in range(0, len(prompt_ids), per_chunk):
                chunk = list(prompt_ids[lo : lo + per_chunk])
                rows = len(chunk) * params.n
                seeds = [params.sample_seed(lo + b // params.n, b % params.n) for b in range(rows)]
                outs += self._decode(chunk, params.n, seeds, [0] * rows, [params.max_new_tokens] * rows, lo, params)
        finally:
            if self.recorder is not None:
                self.recorder.recording, self.recorder.calls = False, []
        return outs

    @torch.no_grad()
    def extend(self, requests: Sequence[Continuation], params: SamplingParams) -> list[RolloutOutput]:
        """Prefills prompt + response so far and samples on; each row's generator first skips the
        draws of the tokens it already has, so token t gets the draw the one-go generation gave it."""
        if any(r.max_new_tokens < 1 for r in requests):
            raise ValueError("extend: every request needs max_new_tokens >= 1")
        if params.return_routes:  # preflight refuses partial rollout with routing replay
            raise ValueError("extend: a continued response's routes are not recorded (partial rollout with "
                             "routing replay is refused at start-up)")
        outs: list[RolloutOutput] = []
        for lo in range(0, len(requests), self.max_batch_size):
            chunk = list(requests[lo : lo + self.max_batch_size])
            outs += self._decode([list(r.prompt_ids) + list(r.response_ids) for r in chunk], 1, [r.seed for r in chunk],
                                 [len(r.response_ids) for r in chunk], [r.max_new_tokens for r in chunk], lo, params)
        return outs

    def _decode(self, prompts, n: int, seeds: list[int], skips: list[int], budgets: list[int], first_index: int,
                p: SamplingParams) -> list[RolloutOutput]:
        """P prompts -> P * n samples (rows b = i * n + j), row b drawing from its own generator
        (seeds[b], advanced by skips[b] tokens' draws) for at most budgets[b] tokens. Each prompt
        is prefilled once and its KV cache repeated n times."""
        from transformers import DynamicCache

        dev = self.device
        P = len(prompts)
        if any(len(x) == 0 for x in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        L = max(len(x) for x in prompts)
        ids = torch.full((P, L), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((P, L), dtype=torch.long, device=dev)
        for b, x in enumerate(prompts):  # left padding: the last prompt token sits at L-1
            ids[b, L - len(x) :] = torch.tensor(list(x), dtype=torch.long)
            mask[b, L - len(x) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits[:, -1, :].float()  # [P, V]
        routes = p.return_routes
        prompt_routes = self.recorder.take(P, L) if routes else None  # [P, L, moe_layers, k]
        step_routes = []  # per decode step: [B, moe_layers, k] of the token it fed
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)  # [B, V], B = P * n
        mask = mask.repeat_interleave(n, dim=0)
        next_pos = pos[:, -1].repeat_interleave(n, dim=0) + 1

        B, T = P * n, max(budgets)
        stop = torch.tensor(sorted(set(self.eos_token_ids) | set(p.stop_token_ids)), dtype=torch.long, device=dev)
        # One generator per sample: its draws do not depend on the rest of the batch.
        gens = [torch.Generator(device=dev).manual_seed(seed) for seed in seeds]
        if p.temperature > 0:
            for g, k in zip(gens, skips):
                _advance(g, k, logits.shape[-1], dev)
        budget = torch.tensor(budgets, dtype=torch.long, device=dev)
        out_tokens = torch.full((B, T), self.pad_token_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros((B, T), dtype=torch.float32, device=dev)
        lengths = budget.clone()
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        for step in range(T):
            tok, logp = self._sample(logits, gens, p)
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            out_tokens[:, step] = tok
            out_logp[:, step] = logp
            hit = ~done & torch.isin(tok, stop)
            lengths = torch.where(hit, torch.full_like(lengths, step + 1), lengths)
            stopped |= hit
            done |= hit | (budget <= step + 1)
            if step + 1 == T or bool(done.all()):
                break
            mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
            logits = self.model(
                input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                past_key_values=cache, use_cache=True,
            ).logits[:, -1, :].float()
            if routes:
                step_routes.append(self.recorder.take(B, 1)[:, 0])
            next_pos = next_pos + 1

        res = []
        for b in range(B):
            k = int(lengths[b])
            own = None
            if routes:  # every prompt token, and each response token the loop fed back (all but the last)
                fed = [s[b] for s in step_routes[: k - 1]]
                own = torch.cat([prompt_routes[b // n, L - len(prompts[b // n]) :], *(x[None] for x in fed)])
            res.append(RolloutOutput(
                prompt_index=first_index + b // n,
                token_ids=out_tokens[b, :k].tolist(),
                finish_reason="stop" if bool(stopped[b]) else "length",
                logprobs=out_logp[b, :k].tolist(),
                weight_version=self._version,
                routes=own,
            ))
        return res

    @staticmethod
    def _sample(logits: torch.Tensor, gens: list[torch.Generator], p: SamplingParams):
        """Returns (token [B], log_softmax(logits / T)[token] [B]); greedy when T == 0."""
        if p.temperature == 0:
            tok = logits.argmax(-1)
            return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
        scaled = logits / p.temperature
        filtered = filter_logits(scaled, p.top_k, p.top_p)
        V = logits.shape[-1]
        u = torch.stack([torch.rand(V, generator=g, device=logits.device) for g in gens])
        u = u.clamp(min=1e-12, max=1 - 1e-7)
        # Gumbel-max: argmax(filtered + G) with G = -log(-log U) is a draw from softmax(filtered).
        tok = (filtered - torch.log(-torch.log(u))).argmax(-1)
        return tok, torch.log_softmax(scaled, -1).gather(-1, tok[:, None])[:, 0]


def _advance(g: torch.Generator, k: int, vocab: int, device: torch.device) -> None:
    """Spend the draws of k sampled tokens (one uniform vector of the vocabulary each). On the CPU
    torch.rand(k, V) draws the same stream as k calls of torch.rand(V), so rows go in blocks."""
    if device.type != "cpu":
        for _ in range(k):
            torch.rand(vocab, generator=g, device=device)
        return
    block = max(1, (1 << 22) // vocab)
    for lo in range(0, k, block):
        torch.rand(min(block, k - lo), vocab, generator=g)


def _fused_experts(named: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in named.items() if n.endswith(".experts.gate_up_proj") and t.ndim == 3]


def expert_views(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names of routed experts -> views into transformers 5's fused expert parameters.

    transformers 5 holds a MoE layer's experts as `<p>.gate_up_proj` [E, 2I, H] ([gate; up] per
    expert) and `<p>.down_proj` [E, H, I]; checkpoints, SGLang and the name table keep one tensor
    per expert (`<p>.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj`). Writing into these
    views writes the fused parameters in place."""
    views = {}
    for name in _fused_experts(named):
        fused = named[name]
        prefix = name[: -len("gate_up_proj")]
        down = named[prefix + "down_proj"]
        half = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            views[f"{prefix}{e}.gate_proj.weight"] = fused[e, :half]
            views[f"{prefix}{e}.up_proj.weight"] = fused[e, half:]
            views[f"{prefix}{e}.down_proj.weight"] = down[e]
    return views


def _eos_ids(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


