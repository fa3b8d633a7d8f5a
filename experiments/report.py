"""The one writer of what a benchmark leaves behind: a table on stdout (and
in report.txt), results.json, PNG plots and an offline wandb run, all under
the run's folder.

    text = table(headers, rows)
    publish(out, results, text, plots={"per_turn.png": plot}, wandb=WandbRun("bench_x", config, summary))

A benchmark that prints as it goes uses the pieces (table, write_json,
pyplot + save_figure, log_wandb) instead of publish.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Plot = Callable[[dict, Path], None]  # draws results into a PNG at the path


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Right-aligned columns; floats with one decimal."""
    cells = [list(headers)] + [[f"{c:.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display). matplotlib is
    in the bench extra, not the base install: ImportError without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


@dataclass
class WandbRun:
    """What one offline wandb run records: config, one history step per row
    of history, tables (name -> (columns, rows)) and summary values."""

    job: str
    config: dict
    summary: dict
    name: str | None = None  # the run's name; the job's by default
    history: Sequence[dict] = ()
    tables: Mapping[str, tuple[list[str], list[list]]] = field(default_factory=dict)


def log_wandb(run: WandbRun, out: Path) -> str:
    """Writes the run under out/wandb (offline: nothing leaves the machine).
    Returns what happened; never raises, a benchmark's results are written
    before and do not depend on it."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb
    except Exception as e:  # noqa: BLE001 - any import failure means no wandb
        return f"wandb skipped: {type(e).__name__}: {e}"
    try:
        w = wandb.init(project="agentkv", job_type=run.job, mode="offline", dir=str(out), config=run.config,
                       name=run.name or run.job)
        for row in run.history:
            w.log(row)
        for name, (columns, rows) in run.tables.items():
            w.log({name: wandb.Table(columns=columns, data=rows)})
        for key, value in run.summary.items():
            w.summary[key] = value
        w.finish()
        return f"wandb offline run in {out}/wandb"
    except Exception as e:  # noqa: BLE001
        return f"wandb failed: {type(e).__name__}: {e}"


def publish(out: Path, results: dict, text: str, plots: Mapping[str, Plot] | None = None,
            wandb: WandbRun | None = None) -> None:
    """Prints text and writes it to report.txt, results to results.json, each
    plot to its PNG (skipped, and said so, without matplotlib) and, when
    given, the wandb run."""
    print(text)
    write_json(out / "results.json", results)
    (out / "report.txt").write_text(text + "\n")
    written = ["results.json", "report.txt"]
    for png, plot in (plots or {}).items():
        try:
            plot(results, out / png)
            written.append(png)
        except ImportError as e:
            print(f"plot skipped: {e}")
    if wandb is not None:
        print(log_wandb(wandb, out))
    print(f"wrote {out}/{', '.join(written)}")
