"""proto/ is generated from the models and must not drift from them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import orjson
import pytest

from rlnode.messages import EVENT_DATA, proto, topics
from rlnode.messages.codec import encode
from rlnode.messages.examples import example_payloads

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def test_proto_dir_is_up_to_date_with_the_models() -> None:
    problems = proto.differences(PROTO_DIR)
    assert not problems, f"proto/ is out of date (run `make proto`): {problems}"


def test_check_mode_detects_drift(tmp_path: Path) -> None:
    proto.write(tmp_path)
    assert proto.main(["--check", str(tmp_path)]) == 0
    (tmp_path / "JobEvent.schema.json").write_text("{}\n")
    (tmp_path / "Old.schema.json").write_text("{}\n")
    assert proto.differences(tmp_path) == [
        "stale: Old.schema.json",
        "changed: JobEvent.schema.json",
    ]
    assert proto.main(["--check", str(tmp_path)]) == 1


@pytest.mark.parametrize("message", example_payloads(), ids=lambda m: type(m).__name__)
def test_wire_records_validate_against_the_published_schemas(message) -> None:
    """What a non-Python client reads in proto/ accepts exactly what we put on the wire."""
    schema = json.loads((PROTO_DIR / f"{type(message).__name__}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(orjson.loads(encode(message)), schema, cls=jsonschema.Draft202012Validator)


def test_published_schemas_refuse_a_record_with_a_stray_field() -> None:
    message = example_payloads()[0]
    schema = json.loads((PROTO_DIR / "JobRequest.schema.json").read_text())
    document = orjson.loads(encode(message)) | {"plaintext": "x"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)


def test_asyncapi_describes_every_topic() -> None:
    document = json.loads((PROTO_DIR / "asyncapi.json").read_text())
    assert document["asyncapi"].startswith("3.")
    addresses = {c["address"] for c in document["channels"].values()}
    assert addresses == set(topics.ALL_TOPICS)
    schemas = document["components"]["schemas"]
    for channel in document["channels"].values():
        (ref,) = channel["messages"].values()
        name = ref["$ref"].rsplit("/", 1)[1]
        assert (
            document["components"]["messages"][name]["payload"]["$ref"]
            == f"#/components/schemas/{name}"
        )
        assert name in schemas
    for event_type in EVENT_DATA:
        assert (PROTO_DIR / "events" / f"{event_type.value}.schema.json").is_file()
