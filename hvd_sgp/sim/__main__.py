"""``python -m hvd_sgp.sim``: SGP on simulated networks, printed as tables.

Three reports: consensus error per step under pure mixing (lr = 0) per topology; parameter
deviation at the end of training against n and lr; and the effect of delays (tau) and of
dropping the de-bias. ``--sweep nodes=...`` / ``--sweep lr=...`` prints only the second.
``--codec int8,topk:0.1,...`` adds a fourth: each codec with and without error feedback where
it applies (pure mixing from spread-out nodes, training from a common start, bytes per node
per step).
``--local-steps H`` gossips every H steps in every report.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Optional, Sequence

from hvd_sgp.sim import OBJECTIVES, simulate


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hvd_sgp.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--topology", action="append",
                        help="repeatable or comma list (default: exponential,ring,random)")
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--delay", type=int, default=0, help="tau: 0 = synchronous SGP")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="quadratic")
    parser.add_argument("--dim", type=int, default=8, help="parameters per node")
    parser.add_argument("--no-debias", action="store_true", help="ablation: no PushSum weight")
    parser.add_argument("--codec", action="append",
                        help="compare codecs: repeatable or comma list (none, fp16, bf16, "
                             "int8, topk:F, randomk:F)")
    parser.add_argument("--consensus-step", type=float, default=None,
                        help="compressed gossip's gamma (default: the codec's)")
    parser.add_argument("--local-steps", type=int, default=1, help="steps per exchange")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="append", metavar="nodes=A,B|lr=A,B",
                        help="only the deviation table, over these values (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write every record")
    parser.add_argument("--plot", metavar="PATH.png", help="consensus error and deviation")
    args = parser.parse_args(argv)
    names = args.topology or ["exponential,ring,random"]
    args.topologies = [t for spec in names for t in spec.split(",") if t]
    args.sweeps = _sweeps(parser, args.sweep or [])
    args.codecs = [c for spec in args.codec or [] for c in spec.split(",") if c]
    if args.local_steps < 1:
        parser.error(f"--local-steps must be >= 1, got {args.local_steps}")
    return args


def _sweeps(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, list]:
    sweeps: dict[str, list] = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        kind = {"nodes": int, "lr": float}.get(key)
        if kind is None or not values:
            parser.error(f"--sweep takes nodes=A,B,... or lr=A,B,..., got {spec!r}")
        sweeps[key] = [kind(v) for v in values.split(",") if v]
    return sweeps


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    base = dict(steps=args.steps, objective=args.objective, peers=args.peers, dim=args.dim,
                seed=args.seed, local_steps=args.local_steps)
    nodes = ",".join(map(str, args.sweeps.get("nodes", [args.nodes])))
    print(f"SGP simulator: {nodes} nodes, {args.steps} steps, {args.objective}, "
          f"delay {args.delay}, de-bias {'off' if args.no_debias else 'on'}, peers {args.peers}")
    records: list[dict] = []
    if not args.sweep:
        records += _mixing_report(args, base)
    records += _deviation_report(args, base)
    if not args.sweep:
        records += _delay_report(args, base)
    if args.codecs:
        records += _compression_report(args, base)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"\nwrote {len(records)} records to {args.json}")
    if args.plot:
        _plot(records, args.plot, args.nodes, args.lr)
        print(f"wrote {args.plot}")
    return 0


def _run(label: str, **settings) -> list[dict]:
    return [{"run": label, **r} for r in simulate(**settings)]


def _mixing_report(args: argparse.Namespace, base: dict) -> list[dict]:
    runs = {t: _run("mixing", topology=t, nodes=args.nodes, lr=0.0, delay=args.delay,
                    debias=not args.no_debias, **base) for t in args.topologies}
    print("\nConsensus error per step, pure mixing (lr=0): sqrt(mean_i ||z_i - average||^2)")
    if args.nodes & (args.nodes - 1) == 0 and args.nodes > 1:
        print(f"(n = 2^{int(math.log2(args.nodes))}: the one-peer exponential graph is exact "
              f"after {int(math.log2(args.nodes))} steps)")
    _table(["step", *runs], [[k, *(runs[t][k]["consensus_error"] for t in runs)]
                             for k in range(args.steps + 1)])
    return [r for run in runs.values() for r in run]


def _deviation_report(args: argparse.Namespace, base: dict) -> list[dict]:
    """Final parameter deviation against n and lr: --sweep values, or n/16..n and lr/4..lr."""
    nodes = args.sweeps.get("nodes") or sorted({max(2, args.nodes // 16), max(2, args.nodes // 4),
                                                args.nodes})
    rates = args.sweeps.get("lr") or [args.lr / 4, args.lr / 2, args.lr]
    print(f"\nParameter deviation after {args.steps} steps of training: "
          f"sqrt(mean_i ||z_i - mean||^2) (loss at the mean)")
    rows, records = [], []
    for n in nodes:
        for lr in rates:
            row: list = [n, lr]
            for t in args.topologies:
                run = _run("training", topology=t, nodes=n, lr=lr, delay=args.delay,
                           debias=not args.no_debias, **base)
                row.append(f"{run[-1]['deviation']:.3e} ({run[-1]['loss']:.4g})")
                records += run
            rows.append(row)
    _table(["n", "lr", *args.topologies], rows)
    return records


def _delay_report(args: argparse.Namespace, base: dict) -> list[dict]:
    topology = args.topologies[0]
    print(f"\nDelays and de-bias ({topology}, {args.nodes} nodes, after {args.steps} steps): "
          f"consensus error of pure mixing; deviation (loss) of training at lr={args.lr}")
    rows, records = [], []
    for tau in sorted({0, 1, 2, args.delay}):
        mixing, training = [], []
        for debias in (True, False):
            mix, train = (_run("delay", topology=topology, nodes=args.nodes, lr=lr, delay=tau,
                               debias=debias, **base) for lr in (0.0, args.lr))
            mixing.append(mix[-1]["consensus_error"])
            training.append(f"{train[-1]['deviation']:.3e} ({train[-1]['loss']:.4g})")
            records += mix + train
        rows.append([tau, *mixing, *training])
    _table(["tau", "error de-biased", "error no de-bias", "training de-biased",
            "training no de-bias"], rows)
    return records


def _compression_report(args: argparse.Namespace, base: dict) -> list[dict]:
    """Per codec and error-feedback setting (where it applies): consensus error and drift of the network average
    under pure mixing from spread-out nodes; deviation and loss of training from a common
    start; bytes one node pushes per step."""
    from hvd_sgp.common.mixers import feeds_back

    topology = args.topologies[0]
    print(f"\nCompressed gossip ({topology}, {args.nodes} nodes, {args.dim} parameters, after "
          f"{args.steps} steps, delay {args.delay}): mixing error and drift of the average; "
          f"training deviation (loss) at lr={args.lr} from a common start")
    rows, records = [], []
    for spec in ["none"] + [c for c in args.codecs if c != "none"]:
        for feedback in (True, False) if feeds_back(spec) else (True,):
            common = dict(base, topology=topology, nodes=args.nodes, delay=args.delay,
                          debias=not args.no_debias, codec=spec, error_feedback=feedback,
                          consensus_step=args.consensus_step)
            mix = _run("compression", lr=0.0, **common)
            train = _run("compression", lr=args.lr, spread=0.0, **common)
            rows.append([spec, ("on" if feedback else "off") if feeds_back(spec) else "—",
                         mix[-1]["consensus_error"],
                         mix[-1]["drift"],
                         f"{train[-1]['deviation']:.3e} ({train[-1]['loss']:.4g})",
                         f"{train[-1]['bytes']:.0f}"])
            records += mix + train
    _table(["codec", "error feedback", "mixing error", "average drift", "training deviation",
            "bytes/node/step"], rows)
    return records


def _table(header: list, rows: list[list]) -> None:
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _cell(value) -> str:
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def _plot(records: list[dict], path: str, nodes: int, lr: float) -> None:
    """Left: consensus error of the mixing runs. Right: deviation of the training runs at
    (nodes, lr), or of every training run when the sweep left that pair out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["run"], r["topology"], r["nodes"], r["lr"], r["delay"], r["debias"])
        curves.setdefault(key, []).append(r)
    main_runs = {k for k in curves if k[0] == "training" and k[2:4] == (nodes, lr)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, rs in curves.items():
        run, topology, n, rate, delay, debias = key
        steps = [r["step"] for r in rs]
        label = f"{topology} n={n} tau={delay}" + ("" if debias else " no de-bias")
        if run == "mixing":
            left.plot(steps, [max(r["consensus_error"], 1e-18) for r in rs], label=label)
        elif run == "training" and (key in main_runs or not main_runs):
            right.plot(steps, [max(r["deviation"], 1e-18) for r in rs],
                       label=f"{label} lr={rate:g}")
    for ax, title in ((left, "consensus error, pure mixing"), (right, "parameter deviation, SGP")):
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
