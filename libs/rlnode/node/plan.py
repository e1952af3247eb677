"""The GPU plan (docs/architecture.md §5): a pure function from the visible GPUs and a job's topology to
which GPUs each inference engine gets (tensor-parallel groups), which the learner trains on
(data parallel), and where the reference model lives. Impossible requests raise PlanError
with what would fit.

`auto` rules: 0 GPUs runs everything on the CPU; 1 GPU is shared by inference and training
(with a stated memory split); otherwise a quarter of the GPUs train (at least one) and the
rest infer: 8 -> 6/2, 4 -> 3/1, 2 -> 1/1. With tensor parallelism the inference GPUs are
rounded down to a multiple of it and the remainder trains. The reference goes on an
inference GPU when there is one (its logprobs arrive with the trajectories), on the trainer
otherwise.

A node over several hosts plans each host for its roles (rlnode.node.roles): an inference
host gives every GPU to engines (the reference stacked beside each one when it is `auto` or
`inference`), a training host every GPU to data-parallel ranks (one kept for a `dedicated`
reference), a control host none; a host with both keeps the split above."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from rlnode.messages.config import TopologySpec
from rlnode.node.roles import ALL_ROLES
from rlnode.service.registry import CHECKPOINT_SERVER, GENERATOR, LEARNER

Placement = Literal["inference", "trainer", "dedicated", "none"]

# vLLM's gpu_memory_utilization per engine. An inference GPU of its own: the policy engine
# takes most of it. A reference stacked on it takes a share sized for its weights (a 7B model
# in bf16 is ~15 GB, 0.19 of an 80 GB GPU) and a small KV cache (it only scores). One GPU
# shared with the trainer: the engines together take SHARED_INFERENCE_FRACTION.
INFERENCE_FRACTION = 0.85
STACKED_REFERENCE_FRACTION = 0.25
SHARED_INFERENCE_FRACTION = 0.45
SHARED_REFERENCE_FRACTION = 0.15


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class GpuPlan:
    visible: int
    engines: list[list[int]]  # one list of GPU indices per inference engine (tensor parallel)
    training: list[int]  # data-parallel ranks
    reference: Placement
    reference_gpus: list[int] = field(default_factory=list)
    shared: bool = False  # one GPU for both sides
    notes: list[str] = field(default_factory=list)
    roles: tuple[str, ...] = ALL_ROLES  # the host's roles (a node on one machine has all)

    @property
    def runs_inference(self) -> bool:
        return "inference" in self.roles

    @property
    def runs_training(self) -> bool:
        return "training" in self.roles

    @property
    def cpu_only(self) -> bool:
        return self.visible == 0

    @property
    def inference_gpus(self) -> list[int]:
        return [g for engine in self.engines for g in engine]

    @property
    def tensor_parallel(self) -> int:
        return len(self.engines[0]) if self.engines else 1

    def engine_memory(self) -> tuple[float, float | None]:
        """vLLM's gpu_memory_utilization for each policy engine and for the reference engine
        stacked beside it (None when there is none)."""
        total = SHARED_INFERENCE_FRACTION if self.shared else INFERENCE_FRACTION
        if self.reference != "inference":
            return total, None
        reference = SHARED_REFERENCE_FRACTION if self.shared else STACKED_REFERENCE_FRACTION
        return round(total - reference, 2), reference

    @property
    def learner_gpus(self) -> list[int]:
        """The GPUs the learner process sees: its ranks', then a dedicated reference's."""
        return self.training + (self.reference_gpus if self.reference == "dedicated" else [])

    def learner_devices(self) -> str:
        """LEARNER_DEVICES for this plan (with CUDA_VISIBLE_DEVICES set to the same GPUs,
        the learner numbers them from 0)."""
        if self.cpu_only:
            return "cpu"
        return ",".join(f"cuda:{i}" for i in range(len(self.training)))

    def rows(self) -> list[tuple[str, str, str]]:
        """(role, GPUs, what runs there), for the table `rlnode plan` prints: this host's."""
        if not (self.runs_inference or self.runs_training):
            return [("control", "-", "broker, vault, gateways: no GPU work")]
        if self.cpu_only:
            rows = [("inference", "cpu", "1 torch engine"), ("training", "cpu", "1 rank")]
            rows = [r for r in rows if r[0] in self.roles]
            where = "cpu" if self.reference != "none" else "-"
            return [*rows, ("reference", where, self.reference)]
        policy, reference = self.engine_memory()
        rows = [
            (
                f"inference engine {i}",
                ",".join(map(str, gpus)),
                f"vLLM, tensor parallel {len(gpus)}, {policy:.0%} of memory",
            )
            for i, gpus in enumerate(self.engines)
        ]
        if self.runs_training:
            rows.append(
                (
                    "training",
                    ",".join(map(str, self.training)),
                    f"{len(self.training)} data-parallel rank(s)"
                    + (f", {1 - SHARED_INFERENCE_FRACTION:.0%} of memory" if self.shared else ""),
                )
            )
        where = {
            "inference": "a frozen copy beside each engine (logprobs come with trajectories), "
            f"{reference or 0:.0%} of memory",
            "trainer": "beside the policy on the training GPU(s)",
            "dedicated": "its own GPU",
            "none": "no reference model (no KL term)",
        }[self.reference]
        if self.reference == "inference" and not self.runs_inference:
            where = "beside each engine on the inference hosts (logprobs come with trajectories)"
        elif self.reference in ("trainer", "dedicated") and not self.runs_training:
            where = f"on the training host ({where})"
        rows.append(("reference", ",".join(map(str, self.reference_gpus)) or "-", where))
        return rows


def _auto_split(available: int, tp: int) -> tuple[int, int]:
    training = max(1, available // 4)
    inference = (available - training) // tp * tp
    if inference == 0:
        raise PlanError(
            f"{available} GPU(s) leave no room for an inference engine of tensor parallel {tp} "
            f"beside training; use --tensor-parallel {max(1, available - 1)} or fewer, or more GPUs"
        )
    return inference, available - inference


def make_plan(
    visible: int, topology: TopologySpec | None = None, roles: Sequence[str] = ALL_ROLES
) -> GpuPlan:
    """The plan of a host with `visible` GPUs and these roles (a node on one machine has
    them all)."""
    topology = topology or TopologySpec()
    roles = tuple(roles)
    if visible < 0:
        raise PlanError("the number of GPUs cannot be negative")
    inference, training = "inference" in roles, "training" in roles
    if inference and training:
        return replace(_node_plan(visible, topology), roles=roles)
    if visible == 0 and (inference or training):
        what = "the torch engine runs" if inference else "the trainer runs"
        return replace(_node_plan(0, topology), roles=roles, notes=[f"no GPU: {what} on the CPU"])
    if inference:
        return _inference_host(visible, topology, roles)
    if training:
        return _training_host(visible, topology, roles)
    notes = [f"{visible} GPU(s) left unused: a control host runs no GPU work"] if visible else []
    return GpuPlan(visible, [], [], "none", roles=roles, notes=notes)


def _node_plan(visible: int, topology: TopologySpec) -> GpuPlan:
    """One machine's GPUs shared by inference and training."""
    tp, reference = topology.tensor_parallel, topology.reference
    inference, training = topology.inference_gpus, topology.training_gpus
    if visible == 0:
        asked = [v for v in (inference, training) if v not in ("auto", 0)]
        if asked or tp > 1 or reference in ("inference", "dedicated"):
            raise PlanError(
                "no GPU is visible, so everything runs on the CPU: leave inference_gpus, "
                "training_gpus and tensor_parallel at auto/1, and the reference at auto, "
                "trainer or none"
            )
        return GpuPlan(
            0,
            [],
            [],
            "none" if reference == "none" else "trainer",
            notes=["no GPU: the torch engine and the trainer run on the CPU"],
        )
    if visible == 1 and inference in ("auto", 1) and training in ("auto", 1):
        if tp > 1:
            raise PlanError("1 GPU cannot hold a tensor-parallel engine; use tensor_parallel 1")
        if reference == "dedicated":
            raise PlanError(
                "a dedicated reference needs a GPU of its own and 1 GPU is shared already; "
                "use reference 'inference' or 'trainer'"
            )
        return GpuPlan(
            1,
            [[0]],
            [0],
            "inference" if reference == "auto" else reference,
            [0] if reference in ("auto", "inference", "trainer") else [],
            shared=True,
            notes=[
                f"one GPU shared: vLLM takes {SHARED_INFERENCE_FRACTION:.0%} of its memory "
                "(gpu_memory_utilization), the trainer the rest"
            ],
        )
    dedicated = 1 if reference == "dedicated" else 0
    budget = visible - dedicated
    if inference == "auto":
        if training == "auto":
            if budget < 2:
                raise PlanError(
                    f"a dedicated reference on {visible} GPU(s) leaves {budget} for inference "
                    "and training, which need one each; use reference 'inference' or "
                    "'trainer', or more GPUs"
                )
            inference, training = _auto_split(budget, tp)
        else:
            inference = (budget - training) // tp * tp
    elif training == "auto":
        training = budget - inference
    if inference < 1 or training < 1:
        raise PlanError(
            f"inference gets {inference} and training {training} GPU(s): each needs at least "
            f"one on a GPU node; with {visible} visible, try " + _suggest(visible, tp, dedicated)
        )
    if inference % tp:
        fits = [d for d in range(1, inference + 1) if inference % d == 0]
        raise PlanError(
            f"tensor parallel {tp} does not divide {inference} inference GPUs; use "
            f"tensor_parallel in {fits}, or a multiple of {tp} inference GPUs"
        )
    total = inference + training + dedicated
    if total > visible:
        raise PlanError(
            f"the plan asks for {total} GPUs (inference {inference}, training {training}"
            + (", reference 1" if dedicated else "")
            + f") but {visible} are visible; try "
            + _suggest(visible, tp, dedicated)
        )
    gpus = list(range(visible))
    engines = [gpus[i : i + tp] for i in range(0, inference, tp)]
    trainer = gpus[inference : inference + training]
    if reference == "auto":
        reference = "inference"
    reference_gpus = {
        "inference": [engine[0] for engine in engines],  # a copy beside every engine
        "trainer": trainer,
        "dedicated": gpus[inference + training : inference + training + 1],
        "none": [],
    }[reference]
    notes = []
    if total < visible:
        notes.append(f"{visible - total} GPU(s) left unused")
    return GpuPlan(visible, engines, trainer, reference, reference_gpus, notes=notes)


def _inference_host(visible: int, topology: TopologySpec, roles: tuple[str, ...]) -> GpuPlan:
    """Every GPU to engines of `tensor_parallel` GPUs each; the reference beside each engine
    (auto, inference) or on the training host (trainer, dedicated)."""
    tp, asked = topology.tensor_parallel, topology.inference_gpus
    if topology.training_gpus not in ("auto", 0):
        raise PlanError(
            f"an inference host trains nothing: training_gpus {topology.training_gpus} is the "
            "training host's; leave it auto here"
        )
    if tp > visible:
        raise PlanError(
            f"an engine of tensor parallel {tp} needs {tp} GPUs and this host has {visible}; "
            f"use tensor_parallel {_largest_divisor(visible, tp)} or a host with more GPUs"
        )
    inference = visible // tp * tp if asked == "auto" else asked
    if inference < 1:
        raise PlanError(
            "inference_gpus 0 leaves an inference host nothing to run; leave it auto "
            f"(all {visible // tp * tp} GPUs)"
        )
    if inference > visible:
        raise PlanError(
            f"the plan asks for {inference} inference GPUs but {visible} are visible; try "
            f"inference_gpus {visible // tp * tp} (what auto gives)"
        )
    if inference % tp:
        fits = [d for d in range(1, inference + 1) if inference % d == 0]
        raise PlanError(
            f"tensor parallel {tp} does not divide {inference} inference GPUs; use "
            f"tensor_parallel in {fits}, or a multiple of {tp} inference GPUs"
        )
    engines = [list(range(i, i + tp)) for i in range(0, inference, tp)]
    reference = "inference" if topology.reference == "auto" else topology.reference
    stacked = [engine[0] for engine in engines] if reference == "inference" else []
    notes = [f"{visible - inference} GPU(s) left unused"] if inference < visible else []
    return GpuPlan(visible, engines, [], reference, stacked, roles=roles, notes=notes)


def _training_host(visible: int, topology: TopologySpec, roles: tuple[str, ...]) -> GpuPlan:
    """Every GPU to data-parallel ranks, but one for a dedicated reference. `auto` leaves
    the reference beside the inference hosts' engines, as it is on one node."""
    if topology.inference_gpus not in ("auto", 0):
        raise PlanError(
            f"a training host runs no engine: inference_gpus {topology.inference_gpus} is the "
            "inference hosts'; leave it auto here"
        )
    reference = "inference" if topology.reference == "auto" else topology.reference
    dedicated = 1 if reference == "dedicated" else 0
    training = visible - dedicated if topology.training_gpus == "auto" else topology.training_gpus
    if training < 1:
        raise PlanError(
            f"a dedicated reference on {visible} GPU(s) leaves none for training; use reference "
            "'trainer' or 'inference', or a host with more GPUs"
            if dedicated and topology.training_gpus == "auto"
            else "training_gpus 0 leaves a training host nothing to run; leave it auto "
            f"(all {visible - dedicated} GPUs)"
        )
    if training + dedicated > visible:
        raise PlanError(
            f"the plan asks for {training + dedicated} GPUs (training {training}"
            + (", reference 1" if dedicated else "")
            + f") but {visible} are visible; try training_gpus {visible - dedicated} (what "
            "auto gives)"
        )
    ranks = list(range(training))
    reference_gpus = {"trainer": ranks, "dedicated": [training]}.get(reference, [])
    notes = [f"{visible - training - dedicated} GPU(s) left unused"]
    return GpuPlan(
        visible,
        [],
        ranks,
        reference,
        reference_gpus,
        roles=roles,
        notes=notes if training + dedicated < visible else [],
    )


def _largest_divisor(visible: int, tp: int) -> int:
    return max(d for d in range(1, min(visible, tp) + 1) if visible % d == 0)


def _suggest(visible: int, tp: int, dedicated: int) -> str:
    try:
        inference, training = _auto_split(visible - dedicated, tp)
    except PlanError:
        return "fewer GPUs per role, or tensor_parallel 1"
    return f"inference_gpus {inference}, training_gpus {training} (what auto gives)"


def plan_table(plan: GpuPlan) -> str:
    rows = [("role", "GPUs", "what"), *plan.rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])


BASE_COMPOSE_GENERATORS = 6  # compose.yaml carries the default 8-GPU plan: six engines


def engine_settings(plan: GpuPlan, gpus: list[int]) -> dict[str, str]:
    """The settings of a rollout-generator whose engine runs on `gpus` (the same whether the
    node starts it as a process or compose as a container)."""
    prefix = GENERATOR.env_prefix
    policy, reference = plan.engine_memory()
    settings = {
        f"{prefix}ENGINE": "vllm",
        f"{prefix}DEVICE": "cuda",
        f"{prefix}TENSOR_PARALLEL": str(len(gpus)),
        f"{prefix}REFERENCE_ON_INFERENCE": str(reference is not None).lower(),
        f"{prefix}GPU_MEMORY_FRACTION": str(policy),
    }
    if reference is not None:
        settings[f"{prefix}REFERENCE_GPU_MEMORY_FRACTION"] = str(reference)
    return settings


def learner_settings(plan: GpuPlan) -> dict[str, str]:
    settings = {
        f"{LEARNER.env_prefix}DEVICES": plan.learner_devices(),
        f"{LEARNER.env_prefix}VISIBLE_GPUS": str(plan.visible),
    }
    if not plan.runs_inference:  # it checks a job's topology against this host's plan
        settings[f"{LEARNER.env_prefix}HOST_ROLES"] = json.dumps(list(plan.roles))
    if plan.reference == "dedicated":  # numbered after the ranks in the learner's GPUs
        settings[f"{LEARNER.env_prefix}REFERENCE_DEVICE"] = f"cuda:{len(plan.training)}"
    return settings


def serving_settings(_plan: GpuPlan) -> dict[str, str]:
    # Serving shares the last training GPU: inference on checkpoints mostly follows training.
    return {f"{CHECKPOINT_SERVER.env_prefix}DEVICE": "cuda"}


def compose_gpu_services(
    plan: GpuPlan, base_generators: int = BASE_COMPOSE_GENERATORS
) -> dict[str, dict]:
    """The GPU-bearing services of a compose file for this plan: one rollout-generator per
    engine (those of the base file's `base_generators` the plan does not use scaled to 0),
    the learner, the checkpoint-server; each of the host's roles, with its device
    reservation and the settings the plan implies. Inside a container the reserved GPUs are
    numbered from 0."""

    def gpus(ids: list[int]) -> dict:
        return {
            "resources": {
                "reservations": {
                    "devices": [
                        {
                            "driver": "nvidia",
                            "device_ids": [str(i) for i in ids],
                            "capabilities": ["gpu"],
                        }
                    ]
                }
            }
        }

    services: dict[str, dict] = {}
    if plan.runs_inference:
        for index, engine in enumerate(plan.engines):
            name = f"{GENERATOR.name}-{index}"
            services[name] = {
                "environment": {
                    f"{GENERATOR.env_prefix}GENERATOR_ID": f"gen{index}",
                    f"{GENERATOR.env_prefix}PUBLIC_URL": GENERATOR.url_in(name),
                    **engine_settings(plan, engine),
                },
                "deploy": gpus(engine),
            }
        for index in range(len(plan.engines), base_generators):
            services[f"{GENERATOR.name}-{index}"] = {"deploy": {"replicas": 0}}
    if plan.runs_training:
        services[LEARNER.name] = {
            "environment": learner_settings(plan),
            "deploy": gpus(plan.learner_gpus),
        }
        services[CHECKPOINT_SERVER.name] = {
            "environment": serving_settings(plan),
            "deploy": gpus(plan.training[-1:]),
        }
    return services
