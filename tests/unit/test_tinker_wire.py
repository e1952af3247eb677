"""The tinker-api's wire format against the SDK's own encoders and decoders
(`tinker.proto`): a forward_backward request the SDK would send is read as the datums it
holds; the outputs the service writes are read by the SDK as the values it wrote; what the
node cannot take is refused naming it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from rlnode.messages.tinker import SampledSequence, SampleResult
from rlnode_services.tinker_api import wire


def _request(data: list[types.Datum], loss: str = "ppo", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id="s:train:0",
        seq_id=3,
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss, loss_fn_config=config
        ),
    )
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_a_request_the_sdk_encodes_reads_as_its_datums_and_config() -> None:
    body = _request(
        [
            _datum(
                [1, 2, 3],
                target_tokens=[2, 3, 4],
                logprobs=[-1.0, -2.0, -0.5],
                advantages=[0.5, 0.5, 0.5],
            ),
            _datum([7, 8], target_tokens=[8, 9], logprobs=[-0.1, -0.2], advantages=[-1.0, -1.0]),
        ],
        config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    )
    model_id, seq, op = wire.parse_forward_backward(body)
    assert (model_id, seq, op.loss_fn, op.forward_only) == ("s:train:0", 3, "ppo", False)
    assert op.loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    )
    first, second = op.datums
    assert (first.input_ids, first.targets) == ([1, 2, 3], [2, 3, 4])
    assert first.inputs["logprobs"] == pytest.approx([-1.0, -2.0, -0.5])
    assert second.inputs["advantages"] == pytest.approx([-1.0, -1.0])


def test_the_zstd_body_the_sdk_can_send_is_read_too() -> None:
    import zstandard

    body = _request([_datum([1, 2], target_tokens=[2, 3], weights=[1.0, 1.0])], "cross_entropy")
    compressed = zstandard.ZstdCompressor().compress(body)
    _model, _seq, op = wire.parse_forward_backward(compressed, "zstd")
    assert op.datums[0].inputs == {"weights": [1.0, 1.0]}


@pytest.mark.parametrize(
    ("datum", "says"),
    [
        (
            types.Datum(
                model_input=types.ModelInput(
                    chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
                ),
                loss_fn_inputs={"target_tokens": [1, 2, 3, 4]},
            ),
            "has a image chunk: this node trains text models only",
        ),
        (_datum([1, 2], weights=[1.0, 1.0]), "datum 0 has no target_tokens"),
        (_datum([1, 2], target_tokens=[2, 3], weights=[1.0]), "weights has 1 values for 2"),
    ],
)
def test_what_the_node_cannot_take_is_refused_naming_it(datum, says) -> None:
    with pytest.raises(wire.WireError) as refused:
        wire.parse_forward_backward(_request([datum], "cross_entropy"))
    assert says in str(refused.value)


def test_a_body_that_is_not_a_request_is_refused() -> None:
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.parse_forward_backward(b"\xff\xff\xff\xff")


def test_the_output_reads_back_in_the_sdk_as_written() -> None:
    logprobs = [[-1.5, -0.25], [-3.0, -2.0, -1.0]]
    body = wire.forward_backward_output(logprobs, {"loss:sum": 8.75, "num_tokens:sum": 5.0})
    out = response_conv.deserialize_forward_backward_output(body)
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == logprobs
    assert out.metrics == {"loss:sum": 8.75, "num_tokens:sum": 5.0}
    with pytest.raises(ValueError, match="name:reduction"):
        wire.forward_backward_output(logprobs, {"loss": 1.0})


def test_a_sample_response_reads_back_with_none_where_no_prompt_logprob_is() -> None:
    result = SampleResult(
        sequences=[
            SampledSequence(tokens=[4, 5], logprobs=[-0.5, -1.25], stop_reason="stop"),
            SampledSequence(tokens=[6], logprobs=[-2.0], stop_reason="length"),
        ],
        prompt_logprobs=[None, -3.0, -1.0, -0.5],
    )
    decoded = response_conv.deserialize_sample_response(wire.sample_response(result))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in decoded.sequences] == [
        ([4, 5], [-0.5, -1.25], "stop"),
        ([6], [-2.0], "length"),
    ]
    assert decoded.prompt_logprobs == [None, -3.0, -1.0, -0.5]
    last_two = response_conv.deserialize_sample_response(wire.sample_response(result, 2))
    assert last_two.prompt_logprobs == [None, None, -1.0, -0.5]
    raw = pb.SampleResponse()
    raw.ParseFromString(wire.sample_response(result))
    assert math.isnan(float(np.frombuffer(raw.prompt_logprobs, "<f4")[0]))  # on the wire
