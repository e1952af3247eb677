"""The GPU plan, rule by rule (docs/architecture.md §5)."""

from __future__ import annotations

import io

import pytest

from rlnode.messages.config import TopologySpec
from rlnode.node.plan import PlanError, make_plan, plan_table


def topo(**kw) -> TopologySpec:
    return TopologySpec(**kw)


@pytest.mark.parametrize(
    ("gpus", "spec", "engines", "training", "reference", "reference_gpus"),
    [
        # auto: a quarter trains (at least one), the rest infers; reference stacked on inference
        (8, {}, [[0], [1], [2], [3], [4], [5]], [6, 7], "inference", [0, 1, 2, 3, 4, 5]),
        (4, {}, [[0], [1], [2]], [3], "inference", [0, 1, 2]),
        (2, {}, [[0]], [1], "inference", [0]),
        # tensor parallel groups; the remainder trains
        (8, {"tensor_parallel": 2}, [[0, 1], [2, 3], [4, 5]], [6, 7], "inference", [0, 2, 4]),
        (8, {"tensor_parallel": 4}, [[0, 1, 2, 3]], [4, 5, 6, 7], "inference", [0]),
        # explicit counts
        (
            8,
            {"inference_gpus": 4, "training_gpus": 4},
            [[0], [1], [2], [3]],
            [4, 5, 6, 7],
            "inference",
            [0, 1, 2, 3],
        ),
        (
            8,
            {"training_gpus": 3},
            [[0], [1], [2], [3], [4]],
            [5, 6, 7],
            "inference",
            [0, 1, 2, 3, 4],
        ),
        (8, {"inference_gpus": 4}, [[0], [1], [2], [3]], [4, 5, 6, 7], "inference", [0, 1, 2, 3]),
        # reference placements
        (8, {"reference": "trainer"}, [[0], [1], [2], [3], [4], [5]], [6, 7], "trainer", [6, 7]),
        (8, {"reference": "dedicated"}, [[0], [1], [2], [3], [4], [5]], [6], "dedicated", [7]),
        (8, {"reference": "none"}, [[0], [1], [2], [3], [4], [5]], [6, 7], "none", []),
        (3, {"reference": "dedicated"}, [[0]], [1], "dedicated", [2]),
    ],
)
def test_plans(gpus, spec, engines, training, reference, reference_gpus) -> None:
    plan = make_plan(gpus, topo(**spec))
    assert plan.engines == engines
    assert plan.training == training
    assert plan.reference == reference and plan.reference_gpus == reference_gpus
    used = (
        plan.inference_gpus
        + plan.training
        + (plan.reference_gpus if reference == "dedicated" else [])
    )
    assert len(used) == len(set(used)) and max(used) < gpus  # no GPU twice, none invented


def test_one_gpu_is_shared_and_says_how() -> None:
    plan = make_plan(1, topo())
    assert plan.shared and plan.engines == [[0]] and plan.training == [0]
    assert "45%" in plan_table(plan) and plan.learner_devices() == "cuda:0"


def test_no_gpu_runs_on_the_cpu() -> None:
    plan = make_plan(0, topo())
    assert plan.cpu_only and plan.learner_devices() == "cpu" and plan.reference == "trainer"
    assert "cpu" in plan_table(plan)


def test_the_learner_numbers_its_gpus_from_zero() -> None:
    assert make_plan(8, topo()).learner_devices() == "cuda:0,cuda:1"


@pytest.mark.parametrize(
    ("gpus", "spec", "says"),
    [
        (8, {"inference_gpus": 6, "training_gpus": 4}, "asks for 10 GPUs"),
        (8, {"inference_gpus": 6, "training_gpus": 2, "tensor_parallel": 4}, "does not divide 6"),
        (2, {"reference": "dedicated"}, r"dedicated reference on 2 GPU\(s\)"),
        (1, {"reference": "dedicated"}, "needs a GPU of its own"),
        (1, {"tensor_parallel": 2}, "cannot hold a tensor-parallel engine"),
        (0, {"training_gpus": 2}, "no GPU is visible"),
        (0, {"reference": "dedicated"}, "no GPU is visible"),
        (8, {"inference_gpus": 8}, "training 0"),
        (2, {"tensor_parallel": 2}, "no room for an inference engine"),
    ],
)
def test_impossible_plans_say_what_would_fit(gpus, spec, says) -> None:
    with pytest.raises(PlanError, match=says):
        make_plan(gpus, topo(**spec))


def test_a_message_suggests_a_plan_that_fits() -> None:
    with pytest.raises(PlanError) as e:
        make_plan(8, topo(inference_gpus=6, training_gpus=4))
    assert "inference_gpus 6, training_gpus 2" in str(e.value)


def test_rlnode_plan_prints_the_table_or_the_reason(capsys) -> None:
    from rlnode.cli import main

    assert main(["plan", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "inference engine 5" in out and "6,7" in out
    assert main(["plan", "--gpus", "8", "--inference-gpus", "6", "--tensor-parallel", "4"]) == 1
    assert "does not divide 6" in capsys.readouterr().err
    assert main(["plan", "--gpus", "2", "--reference", "dedicated"]) == 1


@pytest.mark.parametrize(
    ("gpus", "reference", "policy", "stacked", "learner_gpus", "reference_device"),
    [
        (8, "inference", "0.6", "0.25", "6,7", None),
        (8, "trainer", "0.85", None, "6,7", None),
        (8, "dedicated", "0.85", None, "6,7", "cuda:1"),  # rank on 6, the reference on 7
        (8, "none", "0.85", None, "6,7", None),
        (1, "auto", "0.3", "0.15", "0", None),  # one GPU shared by all
    ],
)
def test_each_process_gets_the_environment_of_its_placement(
    monkeypatch, gpus, reference, policy, stacked, learner_gpus, reference_device
) -> None:
    from rlnode.node.local import plan_env
    from rlnode_services.learner.settings import LearnerSettings
    from rlnode_services.rollout_generator.settings import GeneratorSettings

    plan = make_plan(gpus, topo(reference=reference))
    generators, learner, serving = plan_env(plan)
    assert len(generators) == len(plan.engines)
    for engine, env in zip(plan.engines, generators, strict=True):
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, engine))
        assert env["GENERATOR_GPU_MEMORY_FRACTION"] == policy
        assert env.get("GENERATOR_REFERENCE_GPU_MEMORY_FRACTION") == stacked
        assert env["GENERATOR_REFERENCE_ON_INFERENCE"] == str(stacked is not None).lower()
        if stacked is not None:  # the engines on one GPU fit in what the plan gives them
            assert float(policy) + float(stacked) <= (0.45 if plan.shared else 0.85)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            settings = GeneratorSettings()
        assert settings.engine == "vllm" and settings.gpu_memory_fraction == float(policy)
    assert learner["CUDA_VISIBLE_DEVICES"] == learner_gpus
    assert learner.get("LEARNER_REFERENCE_DEVICE") == reference_device
    with monkeypatch.context() as m:
        for key, value in learner.items():
            m.setenv(key, value)
        learner_settings = LearnerSettings()
    assert learner_settings.reference_device == reference_device
    visible = learner_settings.device_list + ([reference_device] if reference_device else [])
    assert len(visible) == len(learner_gpus.split(","))  # every GPU it sees has a use
    assert serving["CUDA_VISIBLE_DEVICES"] == str(plan.training[-1])


# -- a host of a node over several machines: its GPUs to its roles (rlnode.node.roles) --


@pytest.mark.parametrize(
    ("roles", "spec", "engines", "training", "reference", "reference_gpus"),
    [
        # inference only: every GPU to engines, the reference beside each (auto, inference)
        (("inference",), {}, [[g] for g in range(8)], [], "inference", list(range(8))),
        (
            ("inference",),
            {"tensor_parallel": 2},
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            [],
            "inference",
            [0, 2, 4, 6],
        ),
        (("inference",), {"tensor_parallel": 8}, [list(range(8))], [], "inference", [0]),
        # ... or on the training host
        (("inference",), {"reference": "trainer"}, [[g] for g in range(8)], [], "trainer", []),
        (("inference",), {"reference": "dedicated"}, [[g] for g in range(8)], [], "dedicated", []),
        (
            ("inference",),
            {"inference_gpus": 4},
            [[0], [1], [2], [3]],
            [],
            "inference",
            [0, 1, 2, 3],
        ),
        # training only: every GPU a data-parallel rank; auto leaves the reference on the
        # inference hosts' engines, as on one node
        (("training",), {}, [], list(range(8)), "inference", []),
        (("training",), {"reference": "trainer"}, [], list(range(8)), "trainer", list(range(8))),
        (("training",), {"reference": "dedicated"}, [], list(range(7)), "dedicated", [7]),
        (("training",), {"tensor_parallel": 4}, [], list(range(8)), "inference", []),
        (("control", "training"), {"training_gpus": 4}, [], [0, 1, 2, 3], "inference", []),
        (("control", "inference"), {}, [[g] for g in range(8)], [], "inference", list(range(8))),
        # control only: no GPU work
        (("control",), {}, [], [], "none", []),
        # both inference and training on one host: today's split
        (
            ("training", "inference"),
            {},
            [[g] for g in range(6)],
            [6, 7],
            "inference",
            list(range(6)),
        ),
    ],
)
def test_a_host_gives_its_gpus_to_its_roles(
    roles, spec, engines, training, reference, reference_gpus
) -> None:
    plan = make_plan(8, topo(**spec), roles)
    assert plan.roles == roles
    assert plan.engines == engines and plan.training == training
    assert plan.reference == reference and plan.reference_gpus == reference_gpus
    used = plan.inference_gpus + plan.learner_gpus
    assert len(used) == len(set(used)) and all(0 <= g < 8 for g in used)


def test_an_inference_host_engines_have_the_memory_of_a_gpu_of_their_own() -> None:
    plan = make_plan(8, topo(), ("inference",))
    assert not plan.shared and plan.engine_memory() == (0.6, 0.25)
    assert make_plan(8, topo(reference="trainer"), ("inference",)).engine_memory() == (0.85, None)


def test_a_host_s_table_shows_only_its_roles() -> None:
    inference = plan_table(make_plan(8, topo(tensor_parallel=2), ("inference",)))
    assert "inference engine 3" in inference and "training" not in inference
    training = plan_table(make_plan(8, topo(), ("training",)))
    assert "8 data-parallel rank(s)" in training and "inference engine" not in training
    assert "on the inference hosts" in training  # where its reference logprobs come from
    control = plan_table(make_plan(8, topo(), ("control",)))
    assert "no GPU work" in control and "8 GPU(s) left unused" in control
    remote = plan_table(make_plan(8, topo(reference="trainer"), ("inference",)))
    assert "on the training host" in remote


def test_a_host_without_gpus_runs_its_roles_on_the_cpu() -> None:
    inference = make_plan(0, topo(), ("inference",))
    assert inference.cpu_only and inference.notes == ["no GPU: the torch engine runs on the CPU"]
    assert "training" not in plan_table(inference)
    training = make_plan(0, topo(), ("control", "training"))
    assert training.learner_devices() == "cpu" and "1 rank" in plan_table(training)
    assert make_plan(0, topo(), ("control",)).rows() == [
        ("control", "-", "broker, vault, gateways: no GPU work")
    ]


@pytest.mark.parametrize(
    ("gpus", "roles", "spec", "says"),
    [
        (
            2,
            ("inference",),
            {"tensor_parallel": 4},
            "needs 4 GPUs and this host has 2; use tensor_parallel 2",
        ),
        (
            8,
            ("inference",),
            {"inference_gpus": 10},
            "asks for 10 inference GPUs but 8 are visible; try inference_gpus 8",
        ),
        (8, ("inference",), {"inference_gpus": 6, "tensor_parallel": 4}, "does not divide 6"),
        (8, ("inference",), {"inference_gpus": 0}, "leaves an inference host nothing to run"),
        (8, ("inference",), {"training_gpus": 2}, "an inference host trains nothing"),
        (8, ("training",), {"inference_gpus": 6}, "a training host runs no engine"),
        (8, ("training",), {"training_gpus": 9}, r"asks for 9 GPUs \(training 9\) but 8"),
        (8, ("training",), {"training_gpus": 8, "reference": "dedicated"}, "reference 1"),
        (1, ("training",), {"reference": "dedicated"}, "leaves none for training"),
        (8, ("training",), {"training_gpus": 0}, "leaves a training host nothing to run"),
        (0, ("inference",), {"tensor_parallel": 2}, "no GPU is visible"),
    ],
)
def test_impossible_host_plans_say_what_would_fit(gpus, roles, spec, says) -> None:
    with pytest.raises(PlanError, match=says):
        make_plan(gpus, topo(**spec), roles)


def test_rlnode_plan_prints_a_host_s_plan(capsys) -> None:
    from rlnode.cli import main

    assert main(["plan", "--gpus", "8", "--role", "inference", "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "of a host with role(s) inference" in out and "inference engine 3" in out
    assert main(["plan", "--gpus", "8", "--role", "control,training"]) == 0
    assert "8 data-parallel rank(s)" in capsys.readouterr().out
    assert main(["plan", "--gpus", "8", "--role", "control"]) == 0
    assert "no GPU work" in capsys.readouterr().out
    assert main(["plan", "--gpus", "2", "--role", "inference", "--tensor-parallel", "4"]) == 1
    assert "use tensor_parallel 2" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8", "--role", "storage"]) == 2
    assert "unknown role(s) storage" in capsys.readouterr().err


def test_rlnode_up_plans_the_host_for_its_roles(monkeypatch, tmp_path) -> None:
    """`rlnode up --role inference` hands LocalNode the inference host's plan."""
    from rlnode.node import supervisor

    seen = {}

    class Started(Exception):
        pass

    def node(options):
        seen["options"] = options
        raise Started

    monkeypatch.setattr(supervisor, "LocalNode", node)
    with pytest.raises(Started):
        supervisor.run_up(
            8,
            data_dir=tmp_path,
            topology=topo(tensor_parallel=2),
            roles=("inference",),
            out=io.StringIO(),
        )
    options = seen["options"]
    assert options.plan.engines == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert options.plan.training == [] and options.services == ("rollout-generator",)
