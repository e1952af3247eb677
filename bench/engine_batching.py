"""Engine throughput with request batching on vs off: the same model, the same prompts, the
same sampling, runs interleaved in one invocation. Writes bench/results/engine_batching.{json,md}.

    python bench/engine_batching.py [--requests 64] [--max-tokens 32] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlnode.engine import GenerationRequest, render_chat
from rlnode.engine.torch_engine import TorchEngine
from rlnode.models.build import init_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"


async def run_once(
    engine: TorchEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, int]:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(p, max_tokens=max_tokens, stop_token_ids=[]))
            for p in prompts
        )
    )
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(r.completion_ids) for r in results)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="max batch size when batching is on")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(
            Path(tmp) / "m", seed=0, hidden=args.hidden, layers=args.layers, heads=4
        )
        engines = {
            "batching on": TorchEngine(
                model, device=args.device, dtype="float32", max_batch_size=args.batch, max_wait_ms=5
            ),
            "batching off": TorchEngine(
                model, device=args.device, dtype="float32", max_batch_size=1
            ),
        }
        tokenizer = engines["batching on"].tokenizer
        prompts = [
            render_chat(
                tokenizer, [{"role": "user", "content": f"Copy: {'abcd'[i % 4] * (4 + i % 5)}"}]
            )
            for i in range(args.requests)
        ]
        for engine in engines.values():  # warm-up
            await run_once(engine, prompts[:4], 4)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for name, engine in engines.items():
                seconds, tokens = await run_once(engine, prompts, args.max_tokens)
                runs[name].append(tokens / seconds)
    median = {name: statistics.median(v) for name, v in runs.items()}
    ratio = median["batching on"] / median["batching off"]
    result = {
        "benchmark": "engine_batching",
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        },
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "config": vars(args),
        "tokens_per_s": runs,
        "median_tokens_per_s": median,
        "ratio_on_over_off": ratio,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
    (RESULTS / f"engine_batching{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = [
        f"# Engine batching ({args.device}; {args.requests} concurrent requests x {args.max_tokens} tokens; "
        f"Llama hidden {args.hidden} x {args.layers} layers)",
        "",
        "| mode | median tokens/s | runs (tokens/s) |",
        "|---|---|---|",
        *[
            f"| {name} | {median[name]:.0f} | {', '.join(f'{v:.0f}' for v in runs[name])} |"
            for name in runs
        ],
        "",
        f"Batching on / off: **{ratio:.1f}x**",
        "",
    ]
    (RESULTS / f"engine_batching{suffix}.md").write_text("\n".join(table))
    print("\n".join(table))


if __name__ == "__main__":
    asyncio.run(main())
