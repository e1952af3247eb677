"""OpenAI tool calls without a server: what a request's tools and messages become for the chat
template, how the Hermes-format calls a model writes come back as `tool_calls`, the ChatML
template's rendering of tools and tool turns, and the calculator Task App's evaluator."""

from __future__ import annotations

import json

import pytest

from rlnode.engine import EngineError, render_chat
from rlnode.examples.taskapps.calculator import TOOLS, evaluate
from rlnode.models.tokenizers import bpe_tokenizer, char_tokenizer
from rlnode.service.openai_api import (
    BadChatRequest,
    ChatCompletionRequest,
    assistant_message,
    chat_chunks,
    chat_completion,
    completion_chunks,
    parse_tool_calls,
    text_content,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 3"}}\n</tool_call>'


def test_a_reply_in_the_hermes_format_becomes_tool_calls() -> None:
    content, calls = parse_tool_calls("Let me compute.\n" + CALL)
    assert content == "Let me compute."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17 * 3"}
    two = parse_tool_calls(CALL + CALL.replace("17 * 3", "2 + 2"))
    assert two[0] is None and len(two[1]) == 2
    # Not JSON, or JSON without a name: left as written, no call.
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"args": 1}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])
    message, finish = assistant_message(CALL, "stop", tools=True)
    assert finish == "tool_calls" and message["content"] is None and message["tool_calls"]
    # Without tools offered, the same text is only text.
    assert assistant_message(CALL, "stop", tools=False) == (
        {"role": "assistant", "content": CALL},
        "stop",
    )


def test_tool_choice_auto_and_none_and_what_is_refused() -> None:
    def request(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)

    assert request(tools=TOOLS).template_tools()[0]["function"]["name"] == "calculator"
    assert request(tools=TOOLS, tool_choice="none").template_tools() is None
    assert request().template_tools() is None
    for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
        with pytest.raises(BadChatRequest, match="constrained sampling"):
            request(tools=TOOLS, tool_choice=choice).template_tools()


def test_tool_turns_reach_the_template_with_their_arguments_as_objects() -> None:
    request = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "What is 17 * 3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "17 * 3"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "51"},
        ]
    )
    user, assistant, tool = (text_content(m) for m in request.messages)
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"expression": "17 * 3"}
    assert tool == {"role": "tool", "content": "51", "tool_call_id": "call_1"}
    broken = request.messages[1].model_copy(
        update={"tool_calls": [{"function": {"name": "calculator", "arguments": "{oops"}}]}
    )
    with pytest.raises(BadChatRequest, match="arguments are not JSON"):
        text_content(broken)

    tokenizer = bpe_tokenizer(vocab_size=600)
    ids = render_chat(tokenizer, [user, assistant, tool], TOOLS)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text
    assert CALL + "<|im_end|>" in text  # the call as the model writes it, so it can learn it
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n51\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Without tools the template is plain ChatML, as before.
    plain = tokenizer.decode(render_chat(tokenizer, [user]))
    assert plain == "<|im_start|>user\nWhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(EngineError, match="does not render tools"):
        render_chat(char_tokenizer(), [user], TOOLS)


def test_a_streamed_reply_sends_each_call_whole() -> None:
    class Turn:
        completion_ids = [1, 2]
        logprobs = [-0.1, -0.2]
        finish_reason = "stop"

    chunks = list(chat_chunks("m", None, [Turn()], [CALL], tools=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    (call,) = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert call["index"] == 0 and call["function"]["name"] == "calculator"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_streamed_reply_is_the_same_text_token_by_token_with_its_usage() -> None:
    tokenizer = bpe_tokenizer()

    class Turn:
        completion_ids = tokenizer("the answer is 42, not 41")["input_ids"]
        logprobs = [-0.1] * len(completion_ids)
        finish_reason = "length"

    text = tokenizer.decode(Turn.completion_ids, skip_special_tokens=True)
    whole = chat_completion("m", tokenizer, 7, [Turn()], [text])
    chunks = list(chat_chunks("m", tokenizer, [Turn()], [text], prompt_tokens=7))
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert len([p for p in pieces if p]) > 3  # token by token, not in one piece
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    assert chunks[-1] == chunks[-1] | {"choices": [], "usage": whole["usage"]}
    plain = list(completion_chunks("m", tokenizer, [Turn()], [text]))
    assert "".join(c["choices"][0]["text"] for c in plain) == text
    assert "usage" not in plain[-1]  # only when stream_options.include_usage asks


def test_the_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert evaluate("17 * 3 + 4") == 55
    assert evaluate("-(2 - 8) / 4") == 1.5
    for bad in ("__import__('os')", "2 ** 999999", "x + 1", "1 / 0", "1" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)
