"""What the learner remembers of the weight versions it published (what its HTTP route may
serve), and the generator's settings for downloading them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlnode.messages import WeightVersion
from rlnode.messages.examples import example_payloads
from rlnode.messages.jobs import WeightsLoadedData
from rlnode.training.transport import InMemoryTransport
from rlnode_services.learner.weights import PublishedWeights
from rlnode_services.rollout_generator.settings import GeneratorSettings, safe_name


def version(job: str, number: int, org: str = "acme") -> WeightVersion:
    (example,) = [p for p in example_payloads() if isinstance(p, WeightVersion)]
    return example.model_copy(update={"job_id": job, "org_id": org, "version": number})


async def test_published_versions_are_noted_as_they_go_out_and_forgotten_with_the_run() -> None:
    published = PublishedWeights(kept_per_job=3)
    inner = InMemoryTransport()
    transport = published.noting(inner)
    for n in range(1, 6):
        await transport.publish_weights(version("job-a", n))
    await transport.publish_weights(version("job-b", 1, org="other"))
    assert [v.version for v in inner.weights] == [1, 2, 3, 4, 5, 1]  # passed on, in order
    assert published.find("acme", "job-a", 5) is not None
    assert published.find("acme", "job-a", 2) is None  # only the newest few are kept
    assert published.find("other", "job-a", 5) is None  # the job under another org
    assert published.find("acme", "job-b", 1) is None
    published.forget("job-a")
    assert published.find("acme", "job-a", 5) is None
    assert published.find("other", "job-b", 1) is not None


def test_always_fetching_needs_a_learner_url_and_urls_are_http(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="GENERATOR_WEIGHTS_URL"):
        GeneratorSettings(weights_fetch="always")
    with pytest.raises(ValidationError, match="not an http"):
        GeneratorSettings(weights_url="file:///etc")
    settings = GeneratorSettings(weights_url="http://learner:8740/", generator_id="gen/0")
    assert settings.weights_url == "http://learner:8740"
    # The host's generators share one directory; each keeps its links under its id.
    assert settings.fetched_weights_dir.name == "rlnode-fetched"
    assert [safe_name(n) for n in ("gen/0", "..", "gen0")] == ["gen_0", "_", "gen0"]
    assert GeneratorSettings(weights_dir=tmp_path).fetched_weights_dir == tmp_path


def test_a_weights_loaded_record_of_before_the_transport_field_still_reads() -> None:
    old = {"version": 3, "generator": "g", "load_s": 0.1, "probe_max_abs_diff": 0.0}
    data = WeightsLoadedData.model_validate(old | {"probe_ok": True})
    assert (data.transport, data.fetch_s, data.fetch_resumes) == ("shared-memory", 0.0, 0)
