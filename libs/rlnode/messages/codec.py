"""orjson encoding and decoding of the contract models, with errors a person can read."""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rlnode.messages import PAYLOAD_TYPES, Stamped

M = TypeVar("M", bound=BaseModel)

_SENSITIVE = re.compile(r"token|secret|password|passphrase|api_?key|plaintext|private", re.I)


class DecodeError(ValueError):
    """A record could not be turned into its model. `kind` is "decode" (not JSON) or
    "validation" (JSON of the wrong shape); `document` is the parsed JSON, if any."""

    def __init__(
        self, kind: Literal["decode", "validation"], reason: str, document: Any = None
    ) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.document = document


def encode(message: BaseModel) -> bytes:
    # mode="python" leaves UUIDs, datetimes and enums for orjson, which writes them natively.
    return orjson.dumps(message.model_dump(mode="python", by_alias=True))


def parse_json(raw: bytes | str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise DecodeError("decode", f"not valid JSON: {e}") from None


def decode(raw: bytes | str, model: type[M]) -> M:
    return _validate(parse_json(raw), model)


def _validate(document: Any, model: type[M]) -> M:
    try:
        return model.model_validate(document)
    except ValidationError as e:
        raise DecodeError(
            "validation", describe_validation_error(e, model.__name__), document
        ) from None


def decode_any(raw: bytes | str) -> Stamped:
    """Decode a record of any payload type, dispatching on its `schema` tag."""
    document = parse_json(raw)
    tag = document.get("schema") if isinstance(document, dict) else None
    model = PAYLOAD_TYPES.get(tag) if isinstance(tag, str) else None
    if model is None:
        known = ", ".join(sorted(PAYLOAD_TYPES))
        raise DecodeError(
            "validation", f"unknown schema {tag!r}; expected one of {known}", document
        )
    return _validate(document, model)


def describe_validation_error(error: ValidationError, what: str, limit: int = 8) -> str:
    """One line per problem: `field.path: message (got value)`."""
    problems = []
    for item in error.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in item["loc"]) or "(the whole record)"
        got = item.get("input")
        if any(_SENSITIVE.search(str(p)) for p in item["loc"]):
            shown = " (value withheld)"  # never echo something that may be a credential
        elif isinstance(got, dict | list):
            shown = ""
        else:
            shown = f" (got {_short(got)})"
        problems.append(f"{where}: {item['msg']}{shown}")
    more = error.error_count() - limit
    if more > 0:
        problems.append(f"... and {more} more")
    return f"invalid {what}: " + "; ".join(problems)


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
