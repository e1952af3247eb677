"""Settings of the learner, from LEARNER_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rlnode.engine.precision import resolved_dtype
from rlnode.messages.rollouts import MAX_SAMPLES_PER_WORK
from rlnode.messages.topics import LEARNER_GROUP, LEARNER_TINKER_GROUP, LEARNER_TRAJECTORIES_GROUP
from rlnode.service.registry import GATEWAY, LEARNER
from rlnode.service.settings import VaultClientSettings
from rlnode.training.network import split_endpoint

SERVICE = LEARNER


class LearnerSettings(VaultClientSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")
    gateway_url: str = Field(GATEWAY.default_url, description="Where Task Apps are checked.")

    devices: str = Field(
        "cpu",
        description=(
            "Training devices, comma-separated: one is a plain trainer, several are data "
            "parallel (e.g. 'cuda:0,cuda:1'; 'cpu,cpu' runs 2 gloo ranks on the CPU)."
        ),
    )
    rank_hosts: str = Field(
        "",
        description="Other hosts that lend training ranks, comma-separated, each as it names "
        "itself (its address toward the learner, or `rlnode trainer-ranks --host`): every job "
        "trains on LEARNER_DEVICES (rank 0 first) and on every rank these hosts lend, all of "
        "which must be there when it starts. Needs LEARNER_RENDEZVOUS.",
    )
    rendezvous: str | None = Field(
        None,
        description="address:port the learner listens on for rank hosts (the c10d store their "
        "torchrun joins, `--rdzv-endpoint`; `rlnode trainer-ranks --join` there), on the "
        "network they reach it by: not 127.0.0.1 when they are elsewhere. E.g. 10.0.0.1:29400.",
    )
    socket_ifname: str | None = Field(
        None,
        description="The network interface of the training ranks' collectives on this host "
        "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) when rank hosts take part; default: "
        "GLOO_SOCKET_IFNAME when set, else the interface holding the LEARNER_RENDEZVOUS "
        "address.",
    )
    rank_join_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a job waits for every rank host to be there when it starts; "
        "past it the job fails, naming the hosts that are missing.",
    )
    rank_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait of one collective between training ranks (and of their "
        "loading the model) before the job fails naming the rank, with the stacks of this "
        "host's ranks that live (SIGUSR1, faulthandler); a rank or rank host that exits or "
        "stops its heartbeat is found within seconds.",
    )
    reference_device: str | None = Field(
        None,
        description="Where a job with reference 'dedicated' keeps its reference model "
        "(the GPU plan sets it: the dedicated GPU); otherwise beside the policy.",
    )
    weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The dtype weight versions are written in: the engines' (auto: bfloat16 "
        "when training on GPUs, float32 on the CPU).",
    )
    visible_gpus: int = Field(
        0, ge=0, description="GPUs this node has (the plan checks requests against it)."
    )
    host_roles: list[Literal["control", "training", "inference"]] = Field(
        ["control", "training", "inference"],
        min_length=1,
        description="The roles of the learner's host (rlnode up --role; a JSON list): a "
        "job's topology is checked against this host's part of the plan (a training host "
        "gives every GPU to ranks; the engines are the inference hosts').",
    )
    max_running_jobs: int = Field(1, ge=1, description="Jobs trained at once; more are queued.")
    group_id: str = Field(LEARNER_GROUP, description="The consumer group of job requests.")
    trajectory_group_id: str = Field(
        LEARNER_TRAJECTORIES_GROUP, description="The consumer group of trajectories."
    )
    tinker_group_id: str = Field(
        LEARNER_TINKER_GROUP, description="The consumer group of Tinker API runs' calls."
    )
    step_timeout_s: float = Field(
        1800.0, gt=0, description="Longest wait for one step's trajectories."
    )

    # What one request may cost (a request over a limit is rejected, naming it)
    model_dirs: list[Path] = Field(
        default_factory=list,
        description="Directories a job's model.source may name a local model (an HF directory "
        "or a .gguf file) in (JSON list). Besides these: Hugging Face repo ids, the node's "
        "model store (RLNODE_MODEL_DIR) and the org's own checkpoints. `rlnode up` allows the "
        "temporary directory.",
    )
    samples_per_work: int = Field(
        16,
        ge=1,
        le=MAX_SAMPLES_PER_WORK,
        description="Samples of a group in one work item: a generator takes them as one record and "
        "runs them with one call to the gateway; fewer spread a group over more "
        "generators.",
    )
    max_rollouts_per_step: int = Field(
        4096, ge=1, description="prompts_per_step x group_size of one job, at most."
    )
    max_tokens_per_sample: int = Field(16384, ge=1, description="sampling.max_tokens, at most.")
    max_seq_len: int = Field(32768, ge=1, description="model.max_seq_len, at most.")
    max_steps: int = Field(100_000, ge=1, description="training.steps, at most.")
    max_jobs_per_org: int = Field(
        4, ge=1, description="Jobs of one org queued or running at once, at most."
    )
    max_checkpoint_bytes: int = Field(
        500 * 2**30,
        ge=1,
        description="Checkpoint bytes of one job, at most: estimated from the model before it "
        "starts, measured at each checkpoint after.",
    )
    max_tinker_runs: int = Field(
        4,
        ge=1,
        description="Tinker API runs trained at once (each holds its model): a client's "
        "create_model past it is refused, naming this setting.",
    )
    tinker_tokens_per_micro_batch: int = Field(
        4096,
        ge=1,
        description="Tokens in one forward and backward pass of a Tinker API run (its datums "
        "are split into passes of at most this many; one longer datum is a pass alone).",
    )
    tinker_recompute_from_tokens: int = Field(
        2048,
        ge=0,
        description="A Tinker API run's pass of at least this many tokens (rows x longest) "
        "recomputes its activations in the backward pass; a smaller one keeps them, a quarter "
        "faster (0: every pass recomputes).",
    )
    tinker_checkpoint_every: int = Field(
        1,
        ge=1,
        description="A Tinker API run checkpoints itself every this many optimizer steps; a "
        "restarted learner resumes it there and runs the calls after it again.",
    )
    disk_full_wait_s: float = Field(
        600.0,
        ge=0,
        description="How long a job waits, paused, for room when its checkpoint or weights "
        "store is full (each write is tried again with backoff); past it the job fails, "
        "saying where and how much is free.",
    )

    @field_validator("devices")
    @classmethod
    def _known_devices(cls, value: str) -> str:
        devices = [d.strip() for d in value.split(",") if d.strip()]
        if not devices:
            raise ValueError("name at least one training device, e.g. 'cpu' or 'cuda:0'")
        for d in devices:
            _check_device(d)
        if len(set(devices)) != len(devices) and any(d != "cpu" for d in devices):
            raise ValueError(f"a GPU appears twice in {value!r}: each rank needs its own")
        return ",".join(devices)

    @field_validator("rank_hosts")
    @classmethod
    def _distinct_hosts(cls, value: str) -> str:
        hosts = [h.strip() for h in value.split(",") if h.strip()]
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"a rank host appears twice in {value!r}")
        return ",".join(hosts)

    @field_validator("rendezvous")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            split_endpoint(value)
        return value

    @model_validator(mode="after")
    def _rank_hosts_need_a_rendezvous(self) -> LearnerSettings:
        if self.rank_hosts and self.rendezvous is None:
            raise ValueError(
                "LEARNER_RANK_HOSTS needs LEARNER_RENDEZVOUS: the address:port the rank hosts "
                "join (e.g. 10.0.0.1:29400)"
            )
        return self

    @field_validator("reference_device")
    @classmethod
    def _known_reference_device(cls, value: str | None) -> str | None:
        if value is not None:
            _check_device(value)
        return value

    @property
    def engine_dtype(self) -> str:
        return resolved_dtype(self.weights_dtype, self.devices)

    @property
    def device_list(self) -> list[str]:
        return self.devices.split(",")

    @property
    def rank_host_list(self) -> list[str]:
        return self.rank_hosts.split(",") if self.rank_hosts else []


def _check_device(device: str) -> None:
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda:N'")
