"""The settings tables in the READMEs, generated from the settings classes, so the docs
cannot drift from the code: a table sits between

    <!-- settings: rlnode.bus.settings.KafkaSettings -->
    <!-- /settings -->

and lists every variable of that class (name, default, meaning from its `description`).

    python -m rlnode.service.settings_reference [--check] FILE...
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

MARKER = re.compile(
    r"(<!-- settings: (?P<target>[\w.]+) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.DOTALL
)


def settings_class(target: str) -> type[BaseSettings]:
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, BaseSettings)):
        raise TypeError(f"{target} is not a settings class")
    return cls


def variable(cls: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, str):
        return alias
    prefix = cls.model_config.get("env_prefix", "") or ""
    return f"{prefix}{name}".upper()


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return f"{value:g}"
    return str(value)


def _nested(field: FieldInfo) -> bool:
    annotation: Any = field.annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def table(cls: type[BaseSettings]) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in cls.model_fields.items():
        if _nested(field):
            continue  # node-wide settings (KAFKA_*, DATABASE_URL, RLNODE_DATA_DIR): their own table
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{variable(cls, name, field)}` | {default_text(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """`text` with every marked table regenerated."""
    return MARKER.sub(
        lambda m: m.group(1) + table(settings_class(m.group("target"))) + m.group(4), text
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="fail if a table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in args.files:
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(path)
            if not args.check:
                path.write_text(fresh)
    if args.check and stale:
        names = ", ".join(map(str, stale))
        print(f"settings tables out of date in {names}: run `make docs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
