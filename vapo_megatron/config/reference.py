"""docs/config.md, the configuration reference, generated from the schema (schema.py): every key
with its type, default and meaning, the meaning taken from the comments above the key (or beside
it) and each section's docstring. The suite fails when the file is not what this module writes,
so a key added to the schema without regenerating is caught.

    python -m vapo_megatron.config.reference            # rewrite docs/config.md
    python -m vapo_megatron.config.reference --check    # exit 1 when docs/config.md is stale

Pure Python (the schema's source is read with ast and tokenize; nothing is imported but it and
load.py's table of moved keys).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path

from vapo_megatron.config import schema
from vapo_megatron.config.load import MOVED_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
HEADER = """# Configuration reference

Generated from vapo_megatron/config/schema.py by `python -m vapo_megatron.config.reference`; do not
edit by hand (the test suite checks it is current). Every key can be set in
the YAML file or on the command line as `section.key=value`; `vapo-train --print-config --config
FILE [overrides]` prints the resolved configuration. What a resume may change:
vapo_megatron/config/resume.py.
"""


def _comments(cls: type) -> dict[str, str]:
    """{field: the comment lines right above it, or beside it} from the class's source."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, n = [], node.lineno - 1
            while n in comments and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            beside = comments.get(node.lineno)
            if beside and above:  # two sentences: the group's note, then the key's own
                beside = beside[0].upper() + beside[1:] + "."
            out[node.target.id] = " ".join(above + ([beside] if beside else []))
    return out


def _type(hint: str) -> str:
    return hint.replace("Literal[", "one of [").replace("'", '"')


def _default(value: object) -> str:
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections() -> list[tuple[str, type, object]]:
    """(dotted name, dataclass, its default) of every section, nested ones (trainer.wandb) too."""
    out = []

    def walk(prefix: str, cls: type, value: object) -> None:
        out.append((prefix, cls, value))
        for f in dataclasses.fields(cls):
            child = getattr(value, f.name)
            if dataclasses.is_dataclass(child):
                walk(f"{prefix}.{f.name}", type(child), child)

    root = schema.Config()
    for f in dataclasses.fields(schema.Config):
        walk(f.name, type(getattr(root, f.name)), getattr(root, f.name))
    return out


def render() -> str:
    parts = [HEADER]
    for name, cls, value in sections():
        parts.append(f"\n## `{name}`\n")
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses invent a signature docstring
            parts.append(" ".join(doc.split()) + "\n")
        notes = _comments(cls)
        parts.append("\n| key | type | default | meaning |\n|---|---|---|---|\n")
        defaults = to_dict_section(value)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(getattr(value, f.name)):
                meaning = notes.get(f.name) or f"see `{name}.{f.name}` below"
                parts.append(f"| `{name}.{f.name}` | section | | {_cell(meaning)} (section `{name}.{f.name}`) |\n")
                continue
            parts.append(f"| `{name}.{f.name}` | {_cell(_type(str(f.type)))} | {_cell(_default(defaults[f.name]))} "
                         f"| {_cell(notes.get(f.name, ''))} |\n")
    parts.append("\n## Moved keys\n\nA file or override that sets an old key is refused, in one line naming the new "
                 "one; a run directory's config.yaml written before a move is read in the new form, so the run "
                 "resumes (vapo_megatron/config/load.py MOVED_KEYS).\n\n| old key | new key |\n|---|---|\n")
    parts += [f"| `{old}` | `{new}` |\n" for old, new in MOVED_KEYS.items()]
    return "".join(parts)


def to_dict_section(value: object) -> dict:
    """A section's defaults as YAML/JSON types (tuples become lists), as config.yaml writes them."""
    return json.loads(json.dumps(dataclasses.asdict(value)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write docs/config.md from the config schema.")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is not current")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC} is out of date: run python -m vapo_megatron.config.reference", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


__all__ = ["DOC", "render", "sections"]

if __name__ == "__main__":
    sys.exit(main())
