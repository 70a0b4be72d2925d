"""Plot parameter deviation over steps, per rank and per run, from HVD_SGP_METRICS logs
(as the SGP paper's parameter-deviation figure), or with ``--elastic`` each run's
elastic-consistency estimate, all variants on one axis (compression, local steps, delays).

    python -m hvd_sgp.plot run_exponential.jsonl run_ring.jsonl -o deviation.png
    python -m hvd_sgp.plot fp32.jsonl topk.jsonl int8.jsonl --elastic -o elastic.png
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(paths: list[str]) -> dict[str, list[dict]]:
    """Records grouped by run label, in step order."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    runs[record["label"]].append(record)
    return {label: sorted(rows, key=lambda r: r["step"]) for label, rows in runs.items()}


def plot(runs: dict[str, list[dict]], output: str, relative: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "relative_deviation" if relative else "deviation"
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False,
                             sharey=True)
    for ax, (label, rows) in zip(axes[0], runs.items()):
        steps = [r["step"] for r in rows]
        for rank in range(len(rows[0][key])):
            ax.plot(steps, [max(r[key][rank], 1e-16) for r in rows], lw=1, label=f"rank {rank}")
        ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("||x_i - mean|| / ||mean||" if relative else "||x_i - mean||")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def plot_elastic(runs: dict[str, list[dict]], output: str) -> None:
    """Per run: the largest ||z_i - mean|| / lr over ranks at each record (thin) and its
    running maximum, the run's elastic-consistency constant (thick). Records where the ranks
    agree exactly (an exact average just before) are drawn at the axis' floor, a tenth of the
    smallest constant, instead of stretching it down to rounding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cycler import cycler

    curves = {}
    for label, rows in runs.items():
        curves[label] = ([r["step"] for r in rows],
                         [max(d / r["lr"] if r.get("lr") else 0.0 for d in r["deviation"])
                          for r in rows],
                         [r.get("elastic_constant", max(r["elastic"])) for r in rows])
    floor = 0.1 * min((c for _, _, constant in curves.values() for c in constant if c > 0),
                      default=1.0)
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.set_prop_cycle(cycler(linestyle=["-", "--"]) * cycler(color=plt.cm.tab10.colors))
    for label, (steps, now, constant) in curves.items():
        line, = ax.plot(steps, [max(c, floor) for c in constant], lw=2,
                        label=f"{label}: B = {constant[-1]:.3g}")
        ax.plot(steps, [max(v, floor) for v in now], lw=0.6, alpha=0.5, color=line.get_color(),
                linestyle=line.get_linestyle())
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor)
    ax.set(xlabel="step", ylabel="max_i ||z_i - mean|| / lr",
           title="elastic-consistency estimate per variant (thick: running constant B)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="JSON lines written with HVD_SGP_METRICS")
    parser.add_argument("-o", "--output", default="deviation.png")
    parser.add_argument("--absolute", action="store_true", help="plot ||x_i - mean||")
    parser.add_argument("--elastic", action="store_true",
                        help="the elastic-consistency estimate per run, on one axis")
    args = parser.parse_args(argv)
    runs = load(args.logs)
    if not runs:
        parser.error("no records in the given logs")
    if args.elastic:
        plot_elastic(runs, args.output)
    else:
        plot(runs, args.output, relative=not args.absolute)
    print(f"wrote {args.output}: {', '.join(runs)}")


if __name__ == "__main__":
    main()
