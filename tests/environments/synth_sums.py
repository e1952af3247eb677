"""A Task App written with synth-containers' own SDK, as its users write them (its venv:
`.venvs/synth-containers`, `make environments`; it imports nothing of rlnode's): a
single-turn sum, asked of the policy named by the rollout's typed `policy`, scored right
(1.0) or wrong (0.0). Its rows come in a training and a held-out split, served on
`/dataset` and `/dataset/rows` beside the SDK's routes as Synth's cookbooks serve them; a
rollout reads its row from `task` (as Synth's optimizers send it). `env.config.behaviour`
"hang" never answers and "raise" has the scorer raise: a buggy container, for the tests.

Run: `.venvs/synth-containers/bin/python tests/environments/synth_sums.py` (PORT, HOST).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import uvicorn
from synth_containers import Container, RolloutResult

ROWS = {
    split: [
        {"split": split, "seed": seed, "question": f"What is {a} + {b}?", "answer": a + b}
        for seed, (a, b) in enumerate(pairs)
    ]
    for split, pairs in {
        "train": [(2, 3), (17, 25), (40, 2), (9, 9)],
        "test": [(101, 202), (55, 45), (7, 800)],
    }.items()
}

container = Container(
    "rlnode-test-sums",
    description="Sums of two numbers, scored right or wrong.",
    default_submission_mode="async",
)


def row_for(split: str, seed: int) -> dict[str, Any]:
    rows = ROWS.get(split) or ROWS["train"]
    return rows[seed % len(rows)]


@container.taskset
def taskset() -> dict[str, Any]:
    return {"taskset_id": "sums.v1", "splits": {name: len(rows) for name, rows in ROWS.items()}}


@container.taskset_tasks
def taskset_tasks(payload: dict[str, Any]) -> dict[str, Any]:
    split = str(payload.get("split") or "train")
    return {"tasks": [row_for(split, int(i.rsplit(":", 1)[-1])) for i in payload["task_ids"]]}


@container.rollout
async def rollout(payload: dict[str, Any]) -> dict[str, Any]:
    row = payload.get("task") or row_for("train", int(payload.get("seed") or 0))
    behaviour = payload.get("env", {}).get("config", {}).get("behaviour")
    if behaviour == "hang":
        await asyncio.sleep(3600)
    policy = payload["policy"]
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        reply = await client.post(
            policy["inference_url"],
            json={
                "model": policy["model"],
                "messages": [{"role": "user", "content": row["question"]}],
                "max_tokens": policy.get("max_tokens") or 16,
            },
        )
        reply.raise_for_status()
    said = reply.json()["choices"][0]["message"]["content"].strip()
    if behaviour == "raise":
        raise ValueError("the scorer lost its answer key")
    correct = said == str(row["answer"])
    return RolloutResult(
        rollout_id=payload["rollout_id"],
        reward=1.0 if correct else 0.0,
        task_id=f"sums:{row['split']}:{row['seed']}",
        reward_details={"correct": float(correct)},
        summary={"split": row["split"], "question": row["question"], "said": said},
    ).to_dict()


app = container.fastapi()


@app.get("/dataset")
def dataset() -> dict[str, Any]:
    return {"dataset_id": "sums.v1", "splits": {name: len(rows) for name, rows in ROWS.items()}}


@app.post("/dataset/rows")
def dataset_rows(payload: dict[str, Any]) -> dict[str, Any]:
    split = str(payload.get("split") or "train")
    return {"rows": [row_for(split, int(seed)) for seed in payload.get("seeds") or []]}


if __name__ == "__main__":
    host, port = os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8000"))
    uvicorn.run(app, host=host, port=port, log_level="warning")
