"""SGLang's real API, read from the installed sglang package's own source files.

`sglang.Engine`, the request structs of `sglang.srt.managers.io_struct` and the Qwen2/Qwen3/Llama
model classes do not import on this CPU machine (they pull in uvloop, torchvision, tvm_ffi and
SGLang's CUDA kernels), so their definitions are read with `ast` from the installed files
instead of being imported. Nothing here is copied or recorded: a new SGLang version that renames
an argument, a request field or a weight name changes what these functions return, and the tests
that use them fail here instead of on a cluster.
"""

from __future__ import annotations

import ast
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


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found in {path}")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
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
    return _signature(_method(_class(ENGINE_PY, "Engine"), method))


def engine_method_line(method: str) -> int:
    return _method(_class(ENGINE_PY, "Engine"), method).lineno


def struct_fields(name: str) -> dict[str, bool]:
    """Fields of an io_struct request class (and its io_struct bases): name -> has a default."""
    cls = _class(IO_STRUCT_PY, name)
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
    cls_name = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model]
    fn = _method(_class(path, cls_name), method)
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
    """Where SGLang's Qwen2 `_legacy_load_weights` loop puts tensor `name`: (param, shard_id),
    or None when it drops it (it only logs "not found"). Follows the loop's own steps: the first
    mapping row whose shard name is in `name` rewrites it; a miss tries the next row."""
    for param_name, shard_name, shard_id in mapping:
        if shard_name not in name:
            continue
        name = name.replace(shard_name, param_name)
        if name not in params:
            continue
        return name, shard_id
    return (name, None) if name in params else None


def engine_method(fn):
    """Give a test double's method sglang.Engine's real signature: inspect.signature reports it,
    and every call is bound against it (a TypeError for an argument the real Engine does not
    take), then passed on by keyword with the real defaults filled in."""
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
    fn = _method(_class(TOKENIZER_MANAGER_PY, "TokenizerManager"), "auto_create_handle_loop")
    names = []
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_signal_handler" and isinstance(node.args[0], ast.Attribute)):
            names.append(node.args[0].attr)
    if not names:
        raise LookupError(f"no add_signal_handler call in TokenizerManager.auto_create_handle_loop ({TOKENIZER_MANAGER_PY})")
    return names
