"""proto/: one JSON Schema per payload (and per typed event data) plus an AsyncAPI document
of the topics, generated from the models. `python -m rlnode.messages.proto [--check] DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from rlnode import __version__
from rlnode.messages import EVENT_DATA, PAYLOAD_TYPES, JobEvent, Stamped, topics
from rlnode.taskapp import contract

# The Task App contract (docs/taskapp-contract.md): the bodies a Task App serves and takes.
TASKAPP_MODELS = (
    contract.RolloutRequest,
    contract.RolloutResponse,
    contract.TaskInfo,
    contract.InfoResponse,
    contract.HealthResponse,
)

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Who produces and who consumes each topic (docs/architecture.md).
TOPIC_ROLES: dict[str, tuple[str, str, str]] = {
    topics.JOB_REQUESTS: (
        "users (CLI, SDK, any Kafka client)",
        "learner (group learner)",
        "Start or cancel a job.",
    ),
    topics.JOB_EVENTS: (
        "every service",
        "users, checkpoint-server, CLI watch",
        "What happened to a job.",
    ),
    topics.ROLLOUT_WORK: (
        "learner",
        "rollout-generators (group rollout-generator)",
        "Rollouts to run.",
    ),
    topics.TRAJECTORIES: (
        "rollout-generators",
        "learner",
        "Recorded episodes with rewards, or why they failed.",
    ),
    topics.WEIGHT_VERSIONS: (
        "learner",
        "rollout-generators, checkpoint-server",
        "New policy weights in the checkpoint store.",
    ),
    topics.DEAD_LETTERS: (
        "any consumer",
        "operators",
        "Records a consumer could not use, with the reason.",
    ),
    topics.TINKER_CALLS: (
        "tinker-api",
        "learner (group learner-tinker)",
        "A Tinker API run's training calls, in the run's order.",
    ),
    topics.TINKER_RESULTS: (
        "learner",
        "tinker-api (every instance)",
        "What each call of a Tinker API run gave, or why it failed.",
    ),
}


def _dump(document: Any) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def payload_schema(model: type[Stamped]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return {"$schema": JSON_SCHEMA_DIALECT, "$id": schema_urn(model.SCHEMA), **schema}


def schema_urn(tag: str, fragment: str = "") -> str:
    """ "rlnode.JobRequest/1" -> "urn:rlnode:schema:JobRequest:1"."""
    name, version = tag.removeprefix("rlnode.").split("/")
    return f"urn:rlnode:schema:{name}:{version}{fragment}"


def asyncapi_document() -> dict[str, Any]:
    _, definitions = models_json_schema(
        [(m, "validation") for m in PAYLOAD_TYPES.values()],
        ref_template="#/components/schemas/{model}",
    )
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for topic in topics.ALL_TOPICS:
        model = topics.payload_type(topic)
        producer, consumer, summary = TOPIC_ROLES[topic]
        channel_id = topic.removeprefix("rlnode.").replace("-", "_")
        messages[model.__name__] = {
            "name": model.__name__,
            "title": model.SCHEMA,
            "contentType": "application/json",
            "summary": (model.__doc__ or model.__name__).strip().split("\n")[0],
            "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
            "bindings": {"kafka": {"key": {"type": "string", "description": "job_id"}}},
        }
        channels[channel_id] = {
            "address": topic,
            "summary": summary,
            "messages": {model.__name__: {"$ref": f"#/components/messages/{model.__name__}"}},
        }
        operations[f"publish_{channel_id}"] = {
            "action": "send",
            "summary": f"Produced by {producer}.",
            "channel": {"$ref": f"#/channels/{channel_id}"},
        }
        operations[f"consume_{channel_id}"] = {
            "action": "receive",
            "summary": f"Consumed by {consumer}.",
            "channel": {"$ref": f"#/channels/{channel_id}"},
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "rlnode topics",
            "version": __version__,
            "description": (
                "Every record is JSON (orjson) keyed by job_id, so a job's records share one "
                "partition and keep their order. See docs/architecture.md in the repository."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:9092", "protocol": "kafka"}},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": definitions.get("$defs", {})},
    }


def render() -> dict[str, str]:
    """Every generated file, relative path -> text."""
    files = {f"{m.__name__}.schema.json": _dump(payload_schema(m)) for m in PAYLOAD_TYPES.values()}
    for event_type, data_model in EVENT_DATA.items():
        schema = data_model.model_json_schema()
        files[f"events/{event_type.value}.schema.json"] = _dump(
            {
                "$schema": JSON_SCHEMA_DIALECT,
                "$id": schema_urn(JobEvent.SCHEMA, f"#data/{event_type.value}"),
                **schema,
            }
        )
    for taskapp_model in TASKAPP_MODELS:
        schema = taskapp_model.model_json_schema(by_alias=True)
        files[f"taskapp/{taskapp_model.__name__}.schema.json"] = _dump(
            {
                "$schema": JSON_SCHEMA_DIALECT,
                "$id": f"urn:rlnode:taskapp:{taskapp_model.__name__}",
                **schema,
            }
        )
    files["asyncapi.json"] = _dump(asyncapi_document())
    return files


def write(directory: Path) -> list[str]:
    files = render()
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _generated_files(directory) - set(files):
        (directory / stale).unlink()
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sorted(files)


def differences(directory: Path) -> list[str]:
    """What in `directory` differs from what the code generates (empty when up to date)."""
    files = render()
    problems = [f"missing: {n}" for n in sorted(files) if not (directory / n).is_file()]
    problems += [f"stale: {n}" for n in sorted(_generated_files(directory) - set(files))]
    problems += [
        f"changed: {n}"
        for n, text in sorted(files.items())
        if (directory / n).is_file() and (directory / n).read_text() != text
    ]
    return problems


def _generated_files(directory: Path) -> set[str]:
    return {
        str(p.relative_to(directory))
        for p in directory.rglob("*.json")
        if p.name.endswith(".schema.json") or p.name == "asyncapi.json"
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlnode.messages.proto", description=__doc__)
    parser.add_argument("directory", type=Path, nargs="?", default=Path("proto"))
    parser.add_argument("--check", action="store_true", help="fail if the directory is out of date")
    args = parser.parse_args(argv)
    if args.check:
        problems = differences(args.directory)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print(
                f"{args.directory} is out of date with the models: run `make proto`",
                file=sys.stderr,
            )
            return 1
        print(f"{args.directory} is up to date")
        return 0
    names = write(args.directory)
    print(f"wrote {len(names)} files to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
