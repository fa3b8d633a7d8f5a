"""Each agent's run on one time axis, a panel per system: its requests
(waiting for admission, then served), and the tool pauses between them.
Drawn from agent_runs.records_json, so from a run's results.json too."""
from __future__ import annotations

from pathlib import Path

from agentkv.experiments.report import pyplot, save_figure

COLORS = {"queued": "#d62728", "served": "#1f77b4", "tool pause": "#bbbbbb", "failed": "#000000"}
EDGE = {"edgecolor": "white", "linewidth": 0.6}  # consecutive requests stay apart


def plot_timelines(systems: dict[str, list[dict]], path: Path) -> None:
    """systems: name -> its agents' records (records_json). One panel per
    system, one row per agent, a shared time axis."""
    plt = pyplot()
    names = list(systems)
    rows = max((len(r) for r in systems.values()), default=1)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.2 + 0.32 * rows * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        agents = systems[name]
        for y, agent in enumerate(agents):
            for t in agent["turns"]:
                start, queued = t["start_s"], min(t.get("queued_s", 0.0), t["latency_s"])
                if t.get("error"):
                    ax.broken_barh([(start, t["latency_s"])], (y - 0.35, 0.7), color=COLORS["failed"], **EDGE)
                    continue
                ax.broken_barh([(start, queued)], (y - 0.35, 0.7), color=COLORS["queued"], **EDGE)
                ax.broken_barh([(start + queued, t["latency_s"] - queued)], (y - 0.35, 0.7), color=COLORS["served"], **EDGE)
                if t["pause_s"] > 0:
                    ax.broken_barh([(start + t["latency_s"], t["pause_s"])], (y - 0.2, 0.4), color=COLORS["tool pause"])
        ax.set_yticks(range(len(agents)), [a["agent"] for a in agents], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("seconds from the run's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", ncol=len(COLORS), fontsize=8)
    save_figure(fig, path)
