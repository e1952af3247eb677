"""The Tinker wire format, both ways, with the SDK's own protobuf messages
(`tinker.proto.tinker_public_pb2`): a forward_backward request in, its output out. Anything
the node cannot take (image or audio chunks, per-position distributions) is refused with a
message that names it. Nothing else of the SDK is imported here."""

from __future__ import annotations

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from rlnode.messages.tinker import ForwardBackward, SampleResult, TinkerDatum

_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
# What a forward_backward body may be when it is zstd-compressed (the SDK's own chunks are
# at most 5 MB uncompressed by default).
MAX_BODY_BYTES = 256 * 2**20


class WireError(ValueError):
    """A request the node cannot use: the client's mistake (400, or a failed future)."""


def parse_forward_backward(
    body: bytes, content_encoding: str | None = None
) -> tuple[str, int, ForwardBackward]:
    """(model_id, seq_id, the call) from a serialized ForwardBackwardRequest."""
    if content_encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
        except zstandard.ZstdError as e:
            raise WireError(f"the zstd body could not be decompressed: {e}") from None
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError, and anything a truncated body raises
        raise WireError(f"the body is not a ForwardBackwardRequest: {e}") from None
    if not request.model_id:
        raise WireError("ForwardBackwardRequest.model_id is empty")
    datums = [_datum(d, i) for i, d in enumerate(request.data)]
    if not datums:
        raise WireError("forward_backward needs at least one datum")
    config: dict[str, float | str] = {}
    for key, value in request.loss_fn_config.items():
        config[key] = value
    for key, item in request.loss_fn_config_v2.items():  # the SDK's newer form wins
        config[key] = item.text if item.WhichOneof("value") == "text" else item.number
    op = ForwardBackward(
        datums=datums,
        loss_fn=request.loss_fn,
        loss_fn_config=config or None,
        forward_only=request.forward_only,
    )
    return request.model_id, request.seq_id, op


def forward_backward_place(
    body: bytes, content_encoding: str | None = None
) -> tuple[str, int] | None:
    """(model_id, seq_id) of a ForwardBackwardRequest whose datums are refused, if the
    message itself parses (its place in the model's order is kept)."""
    try:
        if content_encoding == "zstd":
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
        request = pb.ForwardBackwardRequest()
        request.ParseFromString(body)
    except Exception:
        return None
    return (request.model_id, request.seq_id) if request.model_id else None


def _datum(datum: pb.Datum, index: int) -> TinkerDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                f"datum {index} has a {kind} chunk: this node trains text models only "
                "(encoded_text chunks)"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs: dict[str, list[float]] = {}
    targets: list[int] | None = None
    for name, tensor in datum.loss_fn_inputs.items():
        values = _tensor(tensor, f"datum {index}'s {name}")
        if name == "target_tokens":
            targets = [int(v) for v in values]
        else:
            inputs[name] = [float(v) for v in values]
    if targets is None:
        raise WireError(f"datum {index} has no target_tokens in loss_fn_inputs")
    if not tokens:
        raise WireError(f"datum {index} has no input tokens")
    try:
        return TinkerDatum(input_ids=tokens, targets=targets, inputs=inputs)
    except ValueError as e:
        raise WireError(f"datum {index}: {e}") from None


def _tensor(tensor: pb.Tensor, what: str) -> np.ndarray:
    shape = list(tensor.shape)
    if len(shape) > 1:
        raise WireError(
            f"{what} has shape {shape}: this node takes one value per position (1-D tensors)"
        )
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{what} has dtype {pb.DType.Name(tensor.dtype)}: send float32 or int64")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raise WireError(f"{what} is sparse: send it dense (one value per position)")
    values = np.frombuffer(tensor.dense, dtype=dtype)
    if shape and values.size != shape[0]:
        raise WireError(f"{what} holds {values.size} values for shape {shape}")
    return values


def forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """A serialized ForwardBackwardOutput: every datum's `logprobs` (float32, one per target)
    in one ArrayRecord, and metrics named `name:reduction` as the SDK requires."""
    for key in metrics:
        if key.count(":") != 1:
            raise ValueError(f"metric {key!r} is not named name:reduction")
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [np.asarray(row, dtype="<f4") for row in logprobs]
    offsets = np.cumsum([0, *(a.nbytes for a in arrays)], dtype=np.int64)
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.astype("<i8").tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def sample_response(result: SampleResult, prompt_logprobs_last_n: int | None = None) -> bytes:
    """A serialized SampleResponse: each sequence's tokens (int32) and logprobs (float32),
    and the prompt's logprobs (NaN where there are none: the first token, and those before
    the last `prompt_logprobs_last_n`)."""
    out = pb.SampleResponse()
    for sequence in result.sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP
            if sequence.stop_reason == "stop"
            else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype="<f4").tobytes(),
        )
    if result.prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in result.prompt_logprobs]
        if prompt_logprobs_last_n is not None:
            cut = max(0, len(values) - prompt_logprobs_last_n)
            values = [np.nan] * cut + values[cut:]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return out.SerializeToString()


def prompt_tokens(prompt: dict, what: str = "prompt") -> list[int]:
    """The tokens of a JSON ModelInput ({"chunks": [{"type": "encoded_text", ...}]})."""
    tokens: list[int] = []
    for chunk in (prompt or {}).get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise WireError(f"the {what} has a {kind} chunk: this node samples text only")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    if not tokens:
        raise WireError(f"the {what} has no tokens")
    return tokens
