"""B10: what importing a GGUF costs: time, size, and quality against the GGUF's own numbers.

The float32 import holds exactly the GGUF's dequantized weights (tests/integration/
test_gguf_import.py checks every tensor bit for bit), so its forward pass is the GGUF's
dequantized forward, with no loss beyond the quantization the file already has. What is
measured here: the bfloat16 import against the float32 one (the cost of halving the size),
and, where llama-cpp-python is installed, llama.cpp's own forward on the quantized file
(its kernels quantize activations to 8 bits as well) against the float32 import. Each on
the arithmetic Task App's held-out questions: greedy agreement over `--tokens` tokens and
the logprob difference of the tokens the float32 model chose.

    python bench/gguf_import.py [--questions 32] [--tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import write_results

from rlnode.engine import render_chat
from rlnode.examples.taskapps import arithmetic
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.models.hf import load_causal_lm, load_tokenizer

EOS = 2  # SmolLM2's <|im_end|>: the end of an answer, left out of every compared answer


def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=EOS
        )
    completion = out[0, len(prompt) :].tolist()
    return completion[: completion.index(EOS)] if EOS in completion else completion


def logprobs_of(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    chosen = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return chosen.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def agreement(a: list[int], b: list[int]) -> float:
    """The share of positions up to the first difference (1.0: the same answer)."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same / max(len(a), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    gguf = packaged_gguf("smollm2-135m-instruct")
    rows, result = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        imports = {}
        for dtype in ("float32", "bfloat16"):
            imported = import_gguf(gguf, Path(tmp), dtype)
            size = sum(f.stat().st_size for f in imported.path.glob("*.safetensors"))
            imports[dtype] = imported.path
            result[f"import_{dtype}"] = {"seconds": imported.seconds, "bytes": size}
            rows.append(f"| import as {dtype} | {imported.seconds:.1f} s, {size / 1e6:.0f} MB |")
        tokenizer = load_tokenizer(imports["float32"])
        tasks = [
            arithmetic.make_task(s, {"max_operand": 20})
            for s in range(10**6, 10**6 + args.questions)
        ]
        prompts = [render_chat(tokenizer, arithmetic.prompt(t)) for t in tasks]
        reference = load_causal_lm(imports["float32"], dtype=torch.float32).eval()
        answers = [greedy(reference, p, args.tokens) for p in prompts]
        right = statistics.fmean(
            arithmetic.grade(t, tokenizer.decode(a, skip_special_tokens=True))[0]
            for t, a in zip(tasks, answers, strict=True)
        )
        result["float32_accuracy"] = right
        compared = {}
        half = load_causal_lm(imports["bfloat16"], dtype=torch.bfloat16).eval()
        compared["bfloat16 import"] = [greedy(half, p, args.tokens) for p in prompts]
        differences = [
            abs(x - y)
            for p, a in zip(prompts, answers, strict=True)
            for x, y in zip(logprobs_of(reference, p, a), logprobs_of(half, p, a), strict=True)
        ]
        result["bfloat16_logprob_diff"] = {
            "mean": statistics.fmean(differences),
            "max": max(differences),
        }
        try:
            from llama_cpp import Llama
        except ImportError:
            Llama = None
            rows.append("| llama.cpp's forward | not measured: llama-cpp-python is not installed |")
        if Llama is not None:
            llama = Llama(model_path=str(gguf), n_ctx=512, verbose=False, logits_all=False)
            started = time.perf_counter()
            runs = []
            for p in prompts:
                llama.reset()
                out = []
                for token in llama.generate(p, top_k=1, top_p=1.0, temp=0.0, reset=True):
                    if token == EOS or len(out) >= args.tokens:
                        break
                    out.append(token)
                runs.append(out)
            compared["llama.cpp on the GGUF"] = runs
            result["llama_cpp_seconds"] = time.perf_counter() - started
        for name, runs in compared.items():
            exact = statistics.fmean(
                a[: args.tokens] == b[: args.tokens] for a, b in zip(answers, runs, strict=True)
            )
            prefix = statistics.fmean(agreement(a, b) for a, b in zip(answers, runs, strict=True))
            result[name] = {"same_answer": exact, "agreeing_prefix": prefix}
            rows.append(
                f"| {name} vs the float32 import | same greedy answer {exact:.0%} of "
                f"{args.questions}; agreeing prefix {prefix:.0%} of the tokens |"
            )
    diff = result["bfloat16_logprob_diff"]
    rows.append(
        f"| bfloat16 import: logprob difference on the float32 model's answers | mean "
        f"{diff['mean']:.4f}, max {diff['max']:.3f} |"
    )
    table = [
        f"SmolLM2-135M-Instruct Q4_1 (210 Q4_1 tensors, 1 Q8_0, 61 F32). The float32 import "
        f"answers {result['float32_accuracy']:.0%} of the held-out sums right (greedy).",
        "",
        "| what | measured |",
        "|---|---|",
        *rows,
    ]
    write_results(
        "gguf_import", args, "B10: importing a GGUF: time, size and quality", table, **result
    )


if __name__ == "__main__":
    main()
