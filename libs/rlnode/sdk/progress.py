"""Showing a job's progress to a person: one status line per training step (rewritten in
place on a terminal), a text chart of a series, and a PNG of reward and loss. Used by
`rlnode job watch|plot` and by the demo."""

from __future__ import annotations

import sys
from pathlib import Path

from rlnode.messages import JobEvent, JobEventType

# Events a watcher does not print a line for (train.step has the progress line).
QUIET = {JobEventType.WEIGHTS_PUBLISHED, JobEventType.WEIGHTS_LOADED, JobEventType.ROLLOUT_BATCH}


class Progress:
    """One status line per training step: step of total, reward, loss, staleness, ETA.
    On a terminal it rewrites itself in place; in a log it is one line per step."""

    def __init__(self, stream=sys.stdout) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.first: tuple[int, float] | None = None
        self.open_line = False

    def step(self, event: JobEvent) -> None:
        d = event.data
        step, total = int(d.get("step", 0)), int(d.get("total_steps") or 0)
        now = event.ts.timestamp()
        if self.first is None:
            self.first = (step, now)
        eta = ""
        done_steps, since = step - self.first[0], now - self.first[1]
        if total and done_steps > 0 and since > 0:
            eta = f"  ETA {_duration((total - step) * since / done_steps)}"
        width = 24
        filled = int(width * step / total) if total else 0
        bar = "#" * filled + "-" * (width - filled)
        line = (
            f"[{bar}] {step}/{total or '?'}  reward {d.get('reward_mean', 0):.3f}"
            f"  loss {d.get('loss', 0):+.4f}  staleness {d.get('staleness_mean', 0):.1f}{eta}"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.open_line = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        if self.open_line:
            self.stream.write("\n")
            self.open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def write_plot(rows: list[dict], out: Path, title: str, evals: list[dict] | None = None) -> Path:
    """Reward (mean ± std) and loss against step, as a PNG; held-out evaluation rounds
    (`evals`: their step and reward_mean) as points beside the training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    spread = [r.get("reward_std", 0.0) for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, reward, color="tab:blue", label="training rollouts")
    top.fill_between(
        steps,
        [m - s for m, s in zip(reward, spread, strict=True)],
        [m + s for m, s in zip(reward, spread, strict=True)],
        color="tab:blue",
        alpha=0.15,
    )
    points = [(e["step"], e["reward_mean"]) for e in evals or [] if e["reward_mean"] is not None]
    if points:
        top.plot(
            [s for s, _ in points],
            [r for _, r in points],
            "o--",
            color="tab:orange",
            label="held-out eval",
        )
        top.legend(loc="best")
    top.set_ylabel("reward (mean ± std)")
    top.set_title(title)
    bottom.plot(steps, [r["loss"] for r in rows], color="tab:red")
    bottom.set_ylabel("loss")
    bottom.set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def terminal_curve(values: list[float], width: int = 60, height: int = 10) -> str:
    """A small text chart of a series (for terminals with no image viewer)."""
    if not values:
        return "(no data)"
    if len(values) > width:  # bucket means
        size = len(values) / width
        values = [
            sum(values[int(i * size) : int((i + 1) * size)])
            / max(1, len(values[int(i * size) : int((i + 1) * size)]))
            for i in range(width)
        ]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    rows = []
    for level in range(height, 0, -1):
        threshold = low + span * (level - 0.5) / height
        rows.append("".join("█" if v >= threshold else " " for v in values))
    return "\n".join(
        [
            f"{high:8.3f} ┤{rows[0]}",
            *(f"{'':8} │{r}" for r in rows[1:-1]),
            f"{low:8.3f} ┤{rows[-1]}",
        ]
    )
