"""SGLang's real API, read from the installed sglang package's own source files.

`sglang.Engine`, the request structs of `sglang.srt.managers.io_struct` and the Qwen2/Qwen3/Qwen3-MoE/Llama model
classes do not import on this CPU machine (they pull in uvloop, torchvision, tvm_ffi and SGLang's CUDA kernels), so
their definitions are read with `ast` from the installed files instead of being imported. Nothing here is copied or
recorded: a new SGLang version that renames an argument, a request field or a weight name changes what these
functions return, and the tests that use them fail here instead of on a cluster.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.metadata
import importlib.util
import inspect
from pathlib import Path

# find_spec locates the package without running sglang/__init__ (slow: it imports torch and more).
SGLANG_VERSION = importlib.metadata.version("sglang")
SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
ENGINE_PY = SRT / "entrypoints" / "engine.py"
IO_STRUCT_PY = SRT / "managers" / "io_struct.py"


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def class_node(path: Path, name: str) -> ast.ClassDef:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found in {path}")


def method_node(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"{cls.name}.{name} not found")


class _Default:
    """A default that is not a literal: compared by its source text."""

    def __init__(self, src: str) -> None:
        self.src = src

    def __eq__(self, other) -> bool:
        return isinstance(other, _Default) and other.src == self.src

    def __hash__(self) -> int:
        return hash(self.src)

    def __repr__(self) -> str:
        return self.src


def _default(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _Default(ast.unparse(node))


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    """The function's parameters (names, kinds, defaults; annotations left out)."""
    a = fn.args
    P = inspect.Parameter
    params = []
    positional = a.posonlyargs + a.args
    pos_defaults = [P.empty] * (len(positional) - len(a.defaults)) + [_default(d) for d in a.defaults]
    for i, (arg, d) in enumerate(zip(positional, pos_defaults)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=d))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _default(d)))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def engine_signature(method: str) -> inspect.Signature:
    """inspect.Signature of sglang.Engine.<method> (sglang/srt/entrypoints/engine.py)."""
    return _signature(method_node(class_node(ENGINE_PY, "Engine"), method))


def engine_method_line(method: str) -> int:
    return method_node(class_node(ENGINE_PY, "Engine"), method).lineno


def struct_fields(name: str) -> dict[str, bool]:
    """Fields of an io_struct request class (and its io_struct bases): name -> has a default."""
    cls = class_node(IO_STRUCT_PY, name)
    fields: dict[str, bool] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id not in ("object",):
            try:
                fields.update(struct_fields(base.id))
            except LookupError:
                pass  # msgspec.Struct and other outside bases carry no fields
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.target.id] = node.value is not None
    return fields


def check_request_body(struct: str, body: dict) -> None:
    """Raise if `body` would not build io_struct.<struct>: unknown or missing fields."""
    fields = struct_fields(struct)
    unknown = sorted(set(body) - set(fields))
    missing = sorted(f for f, has_default in fields.items() if not has_default and f not in body)
    if unknown or missing:
        raise TypeError(f"{struct} (sglang {SGLANG_VERSION}): unknown fields {unknown}, missing {missing}")


def stacked_params_mapping(model: str, method: str) -> list[tuple[str, str, str | int]]:
    """The (param_name, shard_name, shard_id) list that <model>.py's ...ForCausalLM.<method>
    uses to fold HF q/k/v and gate/up tensors into SGLang's fused parameters."""
    path = SRT / "models" / f"{model}.py"
    cls_name = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}[model]
    fn = method_node(class_node(path, cls_name), method)
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "stacked_params_mapping"
                                                for t in node.targets):
            return [tuple(x) for x in ast.literal_eval(node.value)]
    raise LookupError(f"no stacked_params_mapping in {path}:{cls_name}.{method}")


def sglang_param_names(hf_names, mapping) -> set[str]:
    """The parameter names of SGLang's model for a checkpoint with `hf_names` (SGLang loads HF
    checkpoints; its fused parameters are the HF names with the shard name replaced)."""
    out = set()
    for name in hf_names:
        for param_name, shard_name, _ in mapping:
            if shard_name in name:
                name = name.replace(shard_name, param_name)
                break
        out.add(name)
    return out


def legacy_load_target(name: str, params: set[str], mapping) -> tuple[str, str | int | None] | None:
    """Where SGLang's Qwen2 `_legacy_load_weights` loop puts tensor `name`: (param, shard_id), or None when it drops it
    (logs "not found"). As the loop: the first row whose shard name is in `name` rewrites it; a miss tries the next."""
    for param_name, shard_name, shard_id in mapping:
        if shard_name not in name:
            continue
        name = name.replace(shard_name, param_name)
        if name not in params:
            continue
        return name, shard_id
    return (name, None) if name in params else None


def engine_method(fn):
    """Give a test double's method sglang.Engine's real signature: inspect.signature reports it, and every call is
    bound to it (a TypeError for an argument Engine lacks), then passed by keyword with the real defaults filled in."""
    sig = engine_signature(fn.__name__)

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        named.pop("self")
        return fn(self, **named)

    wrapper.__signature__ = sig
    return wrapper


TOKENIZER_MANAGER_PY = SRT / "managers" / "tokenizer_manager.py"


def first_call_signals() -> list[str]:
    """The signals sglang's TokenizerManager takes over on the Engine's first call: the names X
    of every `loop.add_signal_handler(signal.X, ...)` in TokenizerManager.auto_create_handle_loop."""
    fn = method_node(class_node(TOKENIZER_MANAGER_PY, "TokenizerManager"), "auto_create_handle_loop")
    names = []
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_signal_handler" and isinstance(node.args[0], ast.Attribute)):
            names.append(node.args[0].attr)
    if not names:
        raise LookupError("no add_signal_handler call in TokenizerManager.auto_create_handle_loop "
                          f"({TOKENIZER_MANAGER_PY})")
    return names


# Qwen3-MoE: load_weights folds q/k/v and dense gate/up like Qwen3, experts' gate/up/down into FusedMoE's w13/w2_weight
QWEN3_MOE_PY = SRT / "models" / "qwen3_moe.py"
QWEN2_MOE_PY = SRT / "models" / "qwen2_moe.py"
FUSED_MOE_PY = SRT / "layers" / "moe" / "fused_moe_triton" / "layer.py"
UNQUANT_PY = SRT / "layers" / "quantization" / "unquant.py"


def _run_source(fn: ast.FunctionDef, path: Path):
    """One function of SGLang's source as a plain Python function (decorators and annotations
    dropped, so it needs none of SGLang's imports); tracebacks point into `path`."""
    fn = copy.deepcopy(fn)
    fn.decorator_list, fn.returns = [], None
    for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
        arg.annotation = None
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    namespace: dict = {}
    exec(compile(module, str(path), "exec"), namespace)
    return namespace[fn.name]


def sglang_function(path: Path, name: str, cls: str | None = None, **names):
    """Function `name` (a method of `cls`) of an SGLang source file, run as plain Python with `names` as its globals."""
    node = (method_node(class_node(path, cls), name) if cls
            else next(n for n in _tree(path).body if getattr(n, "name", "") == name))
    fn = _run_source(node, path)
    fn.__globals__.update(names)
    return fn


def _self_attrs(path: Path, cls_name: str) -> dict[str, ast.expr]:
    """`self.X = value` assignments of <cls_name>.__init__ (`self.X, ... = value` too): X -> value."""
    out = {}
    for node in ast.walk(method_node(class_node(path, cls_name), "__init__")):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        out[e.attr] = node.value
    return out


def _require_attrs(path: Path, cls_name: str, names: tuple[str, ...]) -> dict[str, ast.expr]:
    attrs = _self_attrs(path, cls_name)
    missing = [n for n in names if n not in attrs]
    if missing:
        raise LookupError(f"{cls_name}.__init__ ({path}) no longer sets {missing}")
    return attrs


def _keyword(call: ast.expr, name: str):
    """The literal value of keyword `name` of a call, or LookupError when the call omits it."""
    for kw in call.keywords if isinstance(call, ast.Call) else ():
        if kw.arg == name:
            return ast.literal_eval(kw.value)
    raise LookupError(name)


def qwen3_moe_layer_is_sparse(config, layer_id: int) -> bool:
    """Whether SGLang builds layer `layer_id` with routed experts: the `is_layer_sparse = ...`
    expression of Qwen3MoeDecoderLayer.stage_facts, evaluated for the HF config object `config`."""
    fn = method_node(class_node(QWEN3_MOE_PY, "Qwen3MoeDecoderLayer"), "stage_facts")
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "is_layer_sparse"
                                                for t in node.targets):
            expr = compile(ast.Expression(body=node.value), str(QWEN3_MOE_PY), "eval")
            return bool(eval(expr, {"__builtins__": {}}, {"config": config, "layer_id": layer_id}))
    raise LookupError(f"no is_layer_sparse in Qwen3MoeDecoderLayer.stage_facts ({QWEN3_MOE_PY})")


def qwen3_moe_expert_mapping(config) -> list[tuple[str, str, int, str]]:
    """(param_name, weight_name, expert_id, shard_id) rows of Qwen3MoeForCausalLM.load_weights' expert_params_mapping:
    its call's arguments (`self.config.X` from `config`), FusedMoE.make_expert_params_mapping run from its source."""
    fn = method_node(class_node(QWEN3_MOE_PY, "Qwen3MoeForCausalLM"), "load_weights")
    for node in ast.walk(fn):
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "expert_params_mapping" for t in node.targets)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)):
            call = node.value
            break
    else:
        raise LookupError(f"no expert_params_mapping = X.Y(...) in Qwen3MoeForCausalLM.load_weights ({QWEN3_MOE_PY})")
    kwargs = {}
    for kw in call.keywords:
        src = ast.unparse(kw.value)
        if src.startswith("self.config."):
            kwargs[kw.arg] = getattr(config, src.removeprefix("self.config."))
        else:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
    cls_name, method = ast.unparse(call.func.value), call.func.attr
    make = _run_source(method_node(class_node(FUSED_MOE_PY, cls_name), method), FUSED_MOE_PY)
    return [tuple(row) for row in make(None, **kwargs)]


def fused_moe_params(with_bias: bool) -> list[str]:
    """The parameters UnquantizedFusedMoEMethod.create_weights registers on a FusedMoE layer (the bf16 path): the
    names of its `layer.register_parameter(...)` calls, those under `if self.with_bias:` only when `with_bias`."""
    fn = method_node(class_node(UNQUANT_PY, "UnquantizedFusedMoEMethod"), "create_weights")
    names = []

    def visit(node, in_bias: bool):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "self.with_bias":
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, in_bias)
            return
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_parameter"
                and (with_bias or not in_bias)):
            names.append(ast.literal_eval(node.args[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, in_bias)

    visit(fn, False)
    if not names:
        raise LookupError(f"no register_parameter in UnquantizedFusedMoEMethod.create_weights ({UNQUANT_PY})")
    return names


def qwen3_moe_params(config) -> set[str]:
    """Parameter names of SGLang's Qwen3MoeForCausalLM for the HF config object `config` (unquantized, one pipeline
    stage): every module attribute used here is checked to be set in the class's __init__; the layer kind comes
    from stage_facts, the experts' parameters from FusedMoE's create_weights."""
    if "tie_word_embeddings" in ast.unparse(class_node(QWEN3_MOE_PY, "Qwen3MoeForCausalLM")):
        raise LookupError(f"Qwen3MoeForCausalLM ({QWEN3_MOE_PY}) now reads tie_word_embeddings: "
                          "update qwen3_moe_params")
    _require_attrs(QWEN3_MOE_PY, "Qwen3MoeForCausalLM", ("model", "lm_head"))  # lm_head: never tied (checked above)
    _require_attrs(QWEN2_MOE_PY, "Qwen2MoeModel", ("embed_tokens", "layers", "norm"))  # Qwen3MoeModel's base
    _require_attrs(QWEN3_MOE_PY, "Qwen3MoeDecoderLayer",
                   ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
    _require_attrs(QWEN3_MOE_PY, "Qwen3MoeAttention", ("qkv_proj", "o_proj", "q_norm", "k_norm"))
    _require_attrs(QWEN2_MOE_PY, "Qwen2MoeMLP", ("gate_up_proj", "down_proj"))  # a dense layer's MLP
    block = _require_attrs(QWEN3_MOE_PY, "Qwen3MoeSparseMoeBlock", ("gate", "experts"))
    if _keyword(block["gate"], "bias"):
        raise LookupError(f"Qwen3MoeSparseMoeBlock.gate has a bias now ({QWEN3_MOE_PY})")
    try:
        with_bias = _keyword(block["experts"], "with_bias")
    except LookupError:  # not passed: FusedMoE.__init__'s default
        with_bias = (_signature(method_node(class_node(FUSED_MOE_PY, "FusedMoE"), "__init__"))
                     .parameters["with_bias"].default)
    params = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        params |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                   "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                   "self_attn.k_norm.weight")}
        if qwen3_moe_layer_is_sparse(config, layer):
            params |= {p + "mlp.gate.weight"} | {p + "mlp.experts." + n for n in fused_moe_params(with_bias)}
        else:
            params |= {p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
    return params


def qwen3_moe_load_target(name: str, params: set[str], stacked,
                          experts) -> tuple[str, str | int | None, int | None] | None:
    """Where Qwen3MoeForCausalLM.load_weights puts tensor `name`: (param, shard_id, expert_id), or None when it
    skips it (silently: no log line). Follows the loop's own steps: the stacked rows skip expert names; a stacked
    row whose result is no parameter falls through to the next; with no stacked hit, the first expert row whose
    weight name is in `name` rewrites it, and a name that matched an expert row but reached no parameter is skipped."""
    if "mtp" in name or "rotary_emb.inv_freq" in name:
        return None
    for param_name, weight_name, shard_id in stacked:
        if weight_name not in name or "mlp.experts" in name:
            continue
        name = name.replace(weight_name, param_name)
        if name in params:
            return name, shard_id, None
    is_expert = False
    for param_name, weight_name, expert_id, shard_id in experts:
        if weight_name not in name:
            continue
        is_expert = True
        name = name.replace(weight_name, param_name)
        if name in params:
            return name, shard_id, expert_id
    if is_expert:
        return None
    return (name, None, None) if name in params else None


def fused_moe_local_expert(expert_id: int, *, ep_rank: int, ep_size: int, num_experts: int) -> int:
    """The local slot FusedMoE.weight_loader gives global expert `expert_id` on expert-parallel rank `ep_rank` (-1:
    not this rank's, the tensor is dropped there): SGLang's own _map_global_expert_id_to_local_expert_id, run from
    its source, without EPLB, shared-expert fusion or redundant experts (FusedMoE.__init__'s fields for that case)."""
    fn = _run_source(method_node(class_node(FUSED_MOE_PY, "FusedMoE"), "_map_global_expert_id_to_local_expert_id"),
                     FUSED_MOE_PY)
    local = num_experts // ep_size
    layer = type("FusedMoEFields", (), dict(_expert_storage_rank=ep_rank, _num_local_routed=local,
                                            _has_fused_shared=False, _num_global_routed=num_experts))()
    return fn(layer, expert_id)


def engine_start_nccl_env(server_args, environ: dict, **names) -> None:
    """What sglang.Engine's start does to `environ`'s NCCL_* variables for `server_args`: the statements of engine.py's
    _set_envs_and_config that name an NCCL_ variable and the plain assignments before them (`cfg = ...`, the
    conditions), run from its source, `os.environ` = `environ`; `names`: what else they call (resolving_view, ...)."""
    fn = next(n for n in _tree(ENGINE_PY).body if isinstance(n, ast.FunctionDef) and n.name == "_set_envs_and_config")
    nccl = [i for i, s in enumerate(fn.body) if "NCCL_" in ast.unparse(s)]
    if not nccl:
        raise LookupError(f"_set_envs_and_config ({ENGINE_PY}) no longer sets an NCCL_ variable")
    body = [s for s in fn.body[: nccl[-1] + 1] if "NCCL_" in ast.unparse(s)
            or (isinstance(s, ast.Assign) and all(isinstance(t, ast.Name) for t in s.targets))]
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), str(ENGINE_PY), "exec")
    exec(code, {"os": type("os", (), {"environ": environ}), "server_args": server_args, **names})
