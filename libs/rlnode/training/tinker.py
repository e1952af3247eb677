"""The Tinker API's driver of a `Policy`: one run's calls (rlnode.messages.tinker), executed in
their order, each answered with a result.

A run survives its learner. After every `checkpoint_every` optimizer steps it writes a
checkpoint that records the last call it covers (`seq_id`); the learner commits the calls'
offsets only up to there. A learner that restarts restores that checkpoint and is handed
every later call again: it runs them again on the restored state (gradients accumulate
afresh) and answers them again (the tinker-api keeps the first answer of each request), so
a call is never applied twice to the weights and never lost. Calls at or before the
restored checkpoint are skipped."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlnode.messages import JobEvent, JobEventType, TrainingSpec
from rlnode.messages.jobs import TrainStepData
from rlnode.messages.tinker import (
    CloseRun,
    CreateRun,
    ForwardBackward,
    LoadWeights,
    OptimStep,
    SaveForSampler,
    SaveWeights,
    TinkerCall,
    TinkerResult,
)
from rlnode.service.stores import job_dir
from rlnode.training.losses.tinker import LossRefused, TokenLoss
from rlnode.training.policy import JobFailed, Policy
from rlnode.training.trainer import TokenDatum, TrainerConfig
from rlnode.training.transport import JobTransport

log = logging.getLogger("rlnode.training.tinker")
RECOVERY = "step-"  # the run's own checkpoints, which it resumes from
NAMED = "named-"  # checkpoints the client named (save_weights)


class CallRefused(Exception):
    """A call that cannot be run as asked (the client's mistake, not retried)."""


def named_checkpoint(checkpoint_root: Path, org_id: str, run_id: str, name: str) -> Path:
    return job_dir(checkpoint_root, org_id, run_id) / "checkpoints" / f"{NAMED}{name}"


class TinkerRun:
    def __init__(
        self,
        run_id: str,
        org_id: str,
        spec: CreateRun,
        checkpoint_root: Path,
        devices: list[str],
        transport: JobTransport,
        *,
        tokens_per_micro_batch: int = 4096,
        recompute_from_tokens: int = 2048,
        checkpoint_every: int = 1,
        weights_root: Path | None = None,
        weights_dtype: str = "float32",
        kept_versions: int = 4,
        max_checkpoint_bytes: int | None = None,
        disk_full_wait_s: float = 600.0,
        source: str = "learner",
    ) -> None:
        self.run_id, self.org_id, self.spec = run_id, org_id, spec
        self.checkpoint_root = checkpoint_root
        self.root = job_dir(checkpoint_root, org_id, run_id)
        self.transport = transport
        self.source = source
        self.checkpoint_every = checkpoint_every
        self.cancelled = asyncio.Event()
        # Every layer's activations recomputed in the backward pass of a long pass: a client
        # sends whole multi-turn episodes, and without it SmolLM2's activations for 6,000
        # tokens took 17 GiB on the CPU (the learner was killed for memory); with it, 5.9 GiB.
        # A short pass keeps them (16 x 130 tokens: 11-13 s against 15 s, 5.3 GiB against 3.2).
        training = TrainingSpec(
            lora=spec.lora,
            seed=spec.seed,
            tokens_per_micro_batch=tokens_per_micro_batch,
            activation_checkpointing=True,
        )
        self.policy = Policy(
            run_id,
            org_id,
            self.root,
            spec.base_model,
            replace(TrainerConfig.of(training), recompute_from_tokens=recompute_from_tokens),
            devices,
            publish_weights=transport.publish_weights,
            event=self._event,
            cancelled=self.cancelled,
            kept_versions=kept_versions,
            adapter=spec.lora,
            weights_root=weights_root,
            weights_dtype=weights_dtype,
            max_checkpoint_bytes=max_checkpoint_bytes,
            disk_full_wait_s=disk_full_wait_s,
        )
        self.steps = 0  # optimizer steps taken
        self.last_seq = -1  # the last call run (or covered by the restored checkpoint)
        self.checkpointed_seq = -1  # calls up to here are in a checkpoint
        # What forward_backward passes added since the last optimizer step (for train.step).
        self._pending_loss, self._pending_tokens, self._pending_s = 0.0, 0, 0.0
        self.started = False

    async def start(self) -> None:
        """Load the model; resume from the run's newest checkpoint when it has one."""
        await self.policy.start()
        state = await self.policy.resume(f"{RECOVERY}*")
        if state is not None:
            self.steps = state["step"]
            self.last_seq = self.checkpointed_seq = state["seq_id"]
        self.started = True
        resumed = f" (resumed at step {self.steps})" if state is not None else ""
        await self._event(
            JobEventType.STARTED,
            f"Tinker API run of {self.spec.base_model}"
            + (f", LoRA rank {self.spec.lora.rank}" if self.spec.lora else ", full weights")
            + resumed,
        )

    async def close(self) -> None:
        await self.policy.close()

    def settled(self, seq_id: int) -> bool:
        """Whether a checkpoint covers the call (its offset may be committed)."""
        return seq_id <= self.checkpointed_seq

    # -- calls ------------------------------------------------------------------------------

    async def execute(self, call: TinkerCall) -> TinkerResult | None:
        """Run one call; None when it was run before the checkpoint this run resumed from
        (its answer was given then)."""
        if call.seq_id <= self.last_seq:
            return None
        op = call.call
        try:
            result = await self._run(call, op)
        except (CallRefused, LossRefused) as e:
            result = self._result(call, error=str(e), error_category="user")
        except JobFailed as e:
            result = self._result(call, error=str(e), error_category="server")
        self.last_seq = call.seq_id
        return result

    async def _run(self, call: TinkerCall, op: Any) -> TinkerResult:
        if isinstance(op, CreateRun):
            if op != self.spec:
                raise CallRefused(f"run {self.run_id} exists already with another model spec")
            return self._result(call, step=self.steps)
        if isinstance(op, ForwardBackward):
            return await self._forward_backward(call, op)
        if isinstance(op, OptimStep):
            return await self._optim_step(call, op)
        if isinstance(op, SaveWeights):
            path = await self.policy.save_checkpoint(
                f"{NAMED}{op.name}", self.steps, self._state(call.seq_id, op.name), final=False
            )
            return self._result(
                call, step=self.steps, checkpoint=op.name, weights_uri=path.as_uri()
            )
        if isinstance(op, SaveForSampler):
            version = await self.policy.publish_weights(self.steps, keep_as=op.name)
            return self._result(
                call, step=self.steps, weight_version=version.version, weights_uri=version.uri
            )
        if isinstance(op, LoadWeights):
            return await self._load(call, op)
        if isinstance(op, CloseRun):
            return self._result(call, step=self.steps)
        raise CallRefused(f"unknown call {type(op).__name__}")

    async def _forward_backward(self, call: TinkerCall, op: ForwardBackward) -> TinkerResult:
        loss = TokenLoss.of(op.loss_fn, op.loss_fn_config)
        for i, datum in enumerate(op.datums):
            loss.check_inputs({"target_tokens", *datum.inputs}, i)
        datums = [TokenDatum(d.input_ids, d.targets, d.inputs) for d in op.datums]
        trainer = self.policy.started
        started = time.perf_counter()
        done = await self.policy.on_trainer_thread(
            trainer.forward_backward, datums, loss, not op.forward_only
        )
        if not op.forward_only:
            self._pending_loss += done.loss_sum
            self._pending_tokens += done.tokens
            self._pending_s += time.perf_counter() - started
        return self._result(
            call, logprobs=done.logprobs, loss_sum=done.loss_sum, tokens=done.tokens
        )

    async def _optim_step(self, call: TinkerCall, op: OptimStep) -> TinkerResult:
        trainer = self.policy.started
        started = time.perf_counter()
        grad_norm = await self.policy.on_trainer_thread(
            trainer.optim_step,
            op.learning_rate,
            op.beta1,
            op.beta2,
            op.eps,
            op.weight_decay,
            op.grad_clip_norm,
        )
        self.steps += 1
        passes_s = self._pending_s
        compute_s = passes_s + time.perf_counter() - started
        tokens, loss = self._pending_tokens, self._pending_loss
        self._pending_loss, self._pending_tokens, self._pending_s = 0.0, 0, 0.0
        await self._event(
            JobEventType.TRAIN_STEP,
            f"step {self.steps}: loss {loss:.4f} over {tokens} tokens",
            TrainStepData(
                step=self.steps,
                total_steps=self.steps,  # a Tinker run's length is its client's to decide
                loss=loss / tokens if tokens else 0.0,
                reward_mean=0.0,  # rewards are the client's: the server never sees them
                reward_std=0.0,
                kl=None,
                clip_fraction=0.0,
                staleness_min=0,
                staleness_mean=0.0,
                staleness_max=0,
                tokens_per_s=tokens / compute_s if compute_s > 0 else 0.0,
                wait_s=0.0,
                compute_s=compute_s,
                world_size=trainer.world,
                learning_rate=op.learning_rate,
                grad_norm=grad_norm,
            ),
        )
        if self.steps % self.checkpoint_every == 0:
            # Before the answer: a call answered is covered by a checkpoint or replayed.
            await self.policy.save_checkpoint(
                f"{RECOVERY}{self.steps:06d}", self.steps, self._state(call.seq_id), final=False
            )
            self.checkpointed_seq = call.seq_id
            await asyncio.to_thread(self._prune_recovery)
        timings = {"forward_backward_s": passes_s, "optim_step_s": time.perf_counter() - started}
        return self._result(call, step=self.steps, grad_norm=grad_norm, timings=timings)

    async def _load(self, call: TinkerCall, op: LoadWeights) -> TinkerResult:
        path = named_checkpoint(self.checkpoint_root, self.org_id, op.source_run, op.name)
        if not (path / "trainer_state.json").is_file():
            raise CallRefused(f"there is no checkpoint {op.name!r} of run {op.source_run}")
        state = await self.policy.load_checkpoint(path, with_optimizer=op.with_optimizer)
        saved = state.get("tinker_spec", {})
        if saved.get("lora") != (self.spec.lora.model_dump() if self.spec.lora else None):
            log.warning("run %s loaded %s, saved with another LoRA spec", self.run_id, path)
        if op.with_optimizer:
            self.steps = state["step"]
        return self._result(call, step=self.steps, checkpoint=op.name)

    def _state(self, seq_id: int, name: str | None = None) -> dict[str, Any]:
        return {
            "seq_id": seq_id,
            "tinker_spec": self.spec.model_dump(mode="json"),
            **({"name": name} if name else {}),
        }

    def _prune_recovery(self) -> None:
        """The run's own checkpoints: the newest two stay (one may be half-read by a
        restarting learner while the next is written)."""

        own = sorted(self.policy.checkpoints.glob(f"{RECOVERY}*"))
        for old in own[:-2]:
            shutil.rmtree(old, ignore_errors=True)

    def _result(self, call: TinkerCall, **fields: Any) -> TinkerResult:
        return TinkerResult.of(call, **fields)

    async def _event(self, kind: JobEventType, message: str, data: Any = None) -> None:
        event = JobEvent.of(self.run_id, self.org_id, self.source, kind, message, data)
        await self.transport.publish_event(event)
