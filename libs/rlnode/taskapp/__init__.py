"""Task Apps: the contract (`contract`), the SDK to write one (`server`), and the client it
uses to reach the policy (`inference`)."""

from rlnode.taskapp.contract import NormalisedRollout, RolloutRequest, RolloutResponse
from rlnode.taskapp.inference import (
    ChatResult,
    InferenceClient,
    InferenceError,
    chat_completions_url,
)
from rlnode.taskapp.server import (
    Episode,
    Policy,
    TaskAppDefinition,
    create_task_app,
    run_rollout,
    serve,
    single_turn,
)
from rlnode.taskapp.workers import EpisodeError, Isolated

__all__ = [
    "ChatResult",
    "Episode",
    "EpisodeError",
    "InferenceClient",
    "InferenceError",
    "Isolated",
    "NormalisedRollout",
    "Policy",
    "RolloutRequest",
    "RolloutResponse",
    "TaskAppDefinition",
    "chat_completions_url",
    "create_task_app",
    "run_rollout",
    "serve",
    "single_turn",
]
