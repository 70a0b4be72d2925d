"""Communication-reduced SGP, side by side in one run: codecs, error feedback, local steps.

Why: each variant (fp32 SGP, fp16, int8, top-k 10% and 1% with and without error feedback,
random-k, Local SGD, SlowMo) trades bytes for consistency; this measures, on the same data,
seed and script, what each costs in accuracy and time and what it saves on the wire. Every
variant trains a small CNN on scikit-learn's digits on n ranks (each its own SGP node) from the
same seed; the training code is an unmodified Horovod script (``Compression.none``), switched
only by ``HVD_SGP_*`` variables, as a user would from ``sgprun``. To pay the 8 ranks' start-up
once, one ``mpirun`` runs the variants one after the other, setting the variables before each
builds its optimizer (``--separate`` launches one per variant). Every variant runs once per
seed (``--seeds``, default 0 1 2: model initialisation and data order), since one run of a
variant that mixes slowly differs from the next by a point or more. Reported per variant: final
test accuracy (mean over ranks, then over seeds, with the seeds' range and the worst rank),
time and steps until the ranks' mean accuracy first reaches the target, bytes each rank sent per step (the transport's count,
first exact messages included), seconds per step spent encoding/decoding, and the
elastic-consistency constant (largest ||z_i - mean|| / lr over the run, from HVD_SGP_METRICS).

    python examples/compression_benchmark.py                   # SGP and OSGP tau=2, n = 8
    python examples/compression_benchmark.py --quick           # 2 ranks, 3 variants, seconds
    python examples/compression_benchmark.py --codec-cost      # redo only the codec table

Writes docs/compression.json, the tables between the markers of docs/compression.md, and
docs/compression_accuracy.png, docs/compression_elastic.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# label, HVD_SGP_* variables
VARIANTS = {
    "fp32": ("fp32 SGP", {}),
    "fp16": ("fp16", {"COMPRESSION": "fp16"}),
    "int8": ("int8", {"COMPRESSION": "int8"}),
    "topk10": ("top-k 10%", {"COMPRESSION": "topk:0.1"}),
    "topk10-noef": ("top-k 10%, no EF", {"COMPRESSION": "topk:0.1", "ERROR_FEEDBACK": "0"}),
    "topk1": ("top-k 1%", {"COMPRESSION": "topk:0.01"}),
    "topk1-noef": ("top-k 1%, no EF", {"COMPRESSION": "topk:0.01", "ERROR_FEEDBACK": "0"}),
    "randomk10": ("random-k 10%", {"COMPRESSION": "randomk:0.1"}),
    "local4": ("Local SGD H=4", {"MODE": "allreduce", "LOCAL_STEPS": "4"}),
    "slowmo": ("SlowMo on SGP, H=4, beta 0.5, alpha 1", {"SLOWMO": "0.5", "LOCAL_STEPS": "4"}),
    "slowmo-a05": ("SlowMo on SGP, H=4, beta 0.5, alpha 0.5",
                   {"SLOWMO": "0.5", "SLOWMO_LR": "0.5", "LOCAL_STEPS": "4"}),
    "diloco8": ("DiLoCo over gossip, H=8", {"OUTER_OPTIMIZER": "diloco", "LOCAL_STEPS": "8"}),
    "diloco8-ar": ("DiLoCo over AllReduce, H=8",
                   {"OUTER_OPTIMIZER": "diloco", "LOCAL_STEPS": "8", "MODE": "allreduce"}),
    "local8": ("Local SGD H=8", {"MODE": "allreduce", "LOCAL_STEPS": "8"}),
    "sgp8": ("SGP gossiping every 8th step", {"LOCAL_STEPS": "8"}),
    # DiLoCo's preset amplifies the inner steps 0.7 / (1 - 0.9) = 7 times, which this inner
    # SGD (momentum 0.9, lr 0.05) does not survive; Nesterov 0.1 / 0.9 keeps the step
    "nest8": ("Nesterov 0.1/0.9 over gossip, H=8",
              {"OUTER_OPTIMIZER": "nesterov:0.1:0.9", "LOCAL_STEPS": "8"}),
    "nest8-ar": ("Nesterov 0.1/0.9 over AllReduce, H=8",
                 {"OUTER_OPTIMIZER": "nesterov:0.1:0.9", "LOCAL_STEPS": "8", "MODE": "allreduce"}),
    "nest8-int4": ("Nesterov 0.1/0.9 over int4 gossip, H=8",
                   {"OUTER_OPTIMIZER": "nesterov:0.1:0.9", "LOCAL_STEPS": "8",
                    "COMPRESSION": "int4"}),
    "nest8-int2": ("Nesterov 0.1/0.9 over int2 gossip, H=8",
                   {"OUTER_OPTIMIZER": "nesterov:0.1:0.9", "LOCAL_STEPS": "8",
                    "COMPRESSION": "int2"}),
}
OVERLAP = {"OVERLAP": "1", "MAX_DELAY": "2"}


# --- the worker: one rank of one variant ---------------------------------------------------
def cnn():
    import torch
    nn = torch.nn
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def train(args, hvd, bench_model) -> dict:
    """One variant on this rank, configured by the HVD_SGP_* variables of the moment."""
    import torch
    import torch.nn.functional as F

    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = bench_model.digits_split()
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    torch.manual_seed(args.seed)
    model = cnn()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), compression=hvd.Compression.none)
    curve, step = [], 0
    hvd.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(order) - args.batch + 1, args.batch):
            batch = order[i:i + args.batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
            step += 1
            if step % args.eval_every == 0:
                elapsed = time.perf_counter() - start
                curve.append((elapsed, step, bench_model.accuracy(model, x_test, y_test)))
    optimizer.synchronize_gossip()
    seconds = time.perf_counter() - start
    metrics = optimizer.metrics()
    hvd.barrier()
    return {"rank": rank, "curve": curve, "steps": step, "seconds": seconds,
            "final_accuracy": bench_model.accuracy(model, x_test, y_test),
            "bytes_sent": metrics["bytes_sent"], "codec_seconds": metrics["codec_seconds"],
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def worker(args) -> None:
    import torch

    import hvd_sgp.torch as hvd  # a Horovod script: only this import differs
    sys.path.insert(0, str(HERE))
    import bench_model

    hvd.init()
    torch.set_num_threads(1)
    results = [train(args, hvd, bench_model) for _ in bench_model.one_process_runs(
        args.runs, KEPT, lambda key: variables(key, Path(args.out)))]
    Path(args.out, f"rank{hvd.rank()}.json").write_text(json.dumps(results))


# --- the driver --------------------------------------------------------------------------
KEPT = ("HVD_SGP_LOCAL_SIZE", "HVD_SGP_METRICS_EVERY", "HVD_SGP_TIMEOUT")


def variables(key: str, out: Path) -> dict[str, str]:
    """The HVD_SGP_* variables of a run key, ``name`` or ``name:osgp2``."""
    name, _, overlap = key.partition(":")
    chosen = {**VARIANTS[name][1], **(OVERLAP if overlap else {})}
    return {**{f"HVD_SGP_{k}": v for k, v in chosen.items()},
            "HVD_SGP_METRICS": str(out / f"{name}{'-' + overlap if overlap else ''}.jsonl")}


def launch(keys: list[str], args, seed: int) -> list[dict]:
    """One mpirun running the variants ``keys`` in turn from ``seed``; per variant every
    rank's result and the metrics log's records."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1",
                "HVD_SGP_LOCAL_SIZE": "1", "HVD_SGP_METRICS_EVERY": str(args.metrics_every),
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    with tempfile.TemporaryDirectory(prefix="hvd_sgp_compression_") as out:
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", str(args.n),
               "--oversubscribe", "--bind-to", "none", sys.executable, str(Path(__file__)),
               "--worker", "--out", out, "--epochs", str(args.epochs), "--batch",
               str(args.batch), "--lr", str(args.lr), "--seed", str(seed),
               "--eval-every", str(args.eval_every), "--runs", *keys]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.launch_timeout * len(keys), check=False)
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != args.n:
            raise RuntimeError(f"{keys} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-3000:]}")
        per_rank = [json.loads(f.read_text()) for f in files]
        runs = []
        for k, key in enumerate(keys):
            name, _, overlap = key.partition(":")
            log = Path(variables(key, Path(out))["HVD_SGP_METRICS"])
            records = [json.loads(line) for line in log.read_text().splitlines()
                       if line.strip()]
            runs.append({"name": name, "overlap": bool(overlap), "seed": seed,
                         "ranks": [r[k] for r in per_rank],
                         "label": VARIANTS[name][0] + (" (OSGP tau=2)" if overlap else ""),
                         "metrics": records})
        return runs


def averages_per_step(name: str) -> float:
    """Exact model averages per step (Local SGD, SlowMo's outer steps): allreduces, which the
    gossip transport does not count."""
    chosen = VARIANTS[name][1]
    local = int(chosen.get("LOCAL_STEPS", 1))
    outer = chosen.get("MODE") == "allreduce" or "SLOWMO" in chosen
    return 1 / local if outer and local > 1 else 0.0


def summarize(run: dict, target: float, reference_bytes: float | None) -> dict:
    ranks = run["ranks"]
    points = [(max(r["curve"][k][0] for r in ranks), ranks[0]["curve"][k][1],
               statistics.mean(r["curve"][k][2] for r in ranks),
               min(r["curve"][k][2] for r in ranks))
              for k in range(min(len(r["curve"]) for r in ranks))]
    hit = next((p for p in points if p[2] >= target), None)
    steps, n = ranks[0]["steps"], len(ranks)
    sent = statistics.mean(r["bytes_sent"] for r in ranks) / steps
    ring = averages_per_step(run["name"]) * 2 * (n - 1) / n * ranks[0]["model_bytes"]
    elastic = max((max(rec["elastic"]) for rec in run["metrics"]), default=0.0)
    return {"name": run["name"], "label": run["label"], "overlap": run["overlap"],
            "accuracy": statistics.mean(r["final_accuracy"] for r in ranks),
            "worst_accuracy": min(r["final_accuracy"] for r in ranks),
            "seconds_to_target": hit[0] if hit else None,
            "steps_to_target": hit[1] if hit else None, "steps": steps,
            "seconds": max(r["seconds"] for r in ranks), "bytes_per_step": sent + ring,
            "allreduce_estimate": ring > 0,
            "bytes_vs_fp32": reference_bytes / (sent + ring) if reference_bytes else None,
            "codec_ms_per_step": 1e3 * max(r["codec_seconds"] for r in ranks) / steps,
            "elastic": elastic, "model_bytes": ranks[0]["model_bytes"], "curve": points,
            "metrics_label": run["metrics"][0]["label"] if run["metrics"] else "",
            "seed": run["seed"]}


def aggregate(runs: list[dict]) -> dict:
    """One row from a variant's runs over seeds: accuracy as the mean over seeds (with the
    seeds' range and the worst rank of any seed), steps and seconds to the target as medians
    over the seeds that reached it, the rest as means; the curve averaged point by point."""
    first = runs[0]
    reached = [r for r in runs if r["steps_to_target"] is not None]
    points = min(len(r["curve"]) for r in runs)
    curve = [(statistics.mean(r["curve"][k][0] for r in runs), first["curve"][k][1],
              statistics.mean(r["curve"][k][2] for r in runs),
              min(r["curve"][k][3] for r in runs)) for k in range(points)]
    return {**{key: first[key] for key in ("name", "label", "overlap", "steps",
                                           "allreduce_estimate", "model_bytes",
                                           "metrics_label")},
            "seeds": [r["seed"] for r in runs],
            "accuracy": statistics.mean(r["accuracy"] for r in runs),
            "accuracy_range": (min(r["accuracy"] for r in runs),
                               max(r["accuracy"] for r in runs)),
            "worst_accuracy": min(r["worst_accuracy"] for r in runs),
            "reached": len(reached),
            "steps_to_target": (statistics.median(r["steps_to_target"] for r in reached)
                                if reached else None),
            "seconds_to_target": (statistics.median(r["seconds_to_target"] for r in reached)
                                  if reached else None),
            "seconds": statistics.mean(r["seconds"] for r in runs),
            **{key: statistics.mean(r[key] for r in runs)
               for key in ("bytes_per_step", "codec_ms_per_step", "elastic")},
            "bytes_vs_fp32": (statistics.mean(r["bytes_vs_fp32"] for r in runs)
                              if all(r["bytes_vs_fp32"] for r in runs) else None),
            "curve": curve, "per_seed": [{key: r[key] for key in (
                "seed", "accuracy", "worst_accuracy", "steps_to_target", "elastic")}
                for r in runs]}




def codec_cost(parameters: int, repeat: int = 3) -> list[dict]:
    """Seconds to encode and to decode (add into a copy) ``parameters`` float32 values, and
    what one whole gossip iteration costs a node (encoding, copies, summing in; two nodes of
    the simulator, which runs the core's mixers, so no transport time), best of ``repeat``."""
    import numpy as np

    from hvd_sgp.common.codecs import codec
    from hvd_sgp.sim import SimNetwork

    values = np.random.default_rng(0).standard_normal(parameters).astype(np.float32)
    rows = []
    for spec in ("none", "fp16", "int8", "topk:0.1", "topk:0.01", "randomk:0.1",
                 "randomk:0.01"):
        c = codec(spec)
        enc, dec, iteration = [], [], []
        wire = None
        if spec != "none":
            wire = np.empty(c.nbytes(parameters), np.uint8)
            target = np.zeros(parameters, np.float32)
            for _ in range(repeat):
                began = time.perf_counter()
                c.encode(values, wire)
                enc.append(time.perf_counter() - began)
                began = time.perf_counter()
                c.add_to(wire, parameters, target)
                dec.append(time.perf_counter() - began)
            del target
        net = SimNetwork("exponential", parameters, n=2, codec=spec, dtype=np.float32)
        for mixer in net.mixers:
            mixer.ledger = None  # the tests' per-entry mass ledger is not part of the cost
        net.params[...] = values
        net.params[1] *= 0.5
        for step in range(repeat + 1):  # the first opens the edges with exact messages
            net.params += 1e-3
            began = time.perf_counter()
            net.step()
            if step:
                iteration.append((time.perf_counter() - began) / net.n)
        del net
        rows.append({"codec": spec, "encode_s": min(enc) if enc else None,
                     "decode_s": min(dec) if dec else None,
                     "iteration_s": min(iteration),
                     "bytes_vs_fp32": 4 * parameters / len(wire) if wire is not None else 1.0})
    return rows


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Setting: {report['setting']}", ""]
    for overlap in (False, True):
        rows = [r for r in report["rows"] if r["overlap"] == overlap]
        if not rows:
            continue
        lines += [f"**{'Overlap SGP tau = 2' if overlap else 'Synchronous SGP'}**", "",
                  "| variant | accuracy: mean over seeds (range) | worst rank | "
                  f"steps to {report['target']:.0%} (seeds reaching it) | s to it "
                  "| bytes/rank/step | less than fp32 | codec ms/step | elastic constant |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            low, high = r["accuracy_range"]
            lines.append(
                f"| {r['label']} | {r['accuracy']:.4f} ({low:.4f}-{high:.4f}) | "
                f"{r['worst_accuracy']:.4f} | {_fmt(r['steps_to_target'], '.0f')} "
                f"({r['reached']}/{len(r['seeds'])}) | {_fmt(r['seconds_to_target'], '.1f')} | "
                f"{r['bytes_per_step']:,.0f}{'*' if r['allreduce_estimate'] else ''} | "
                f"{_fmt(r['bytes_vs_fp32'], '.1f')}x | "
                f"{r['codec_ms_per_step']:.2f} | {r['elastic']:.2f} |")
        lines.append("")
    if any(r["allreduce_estimate"] for r in report["rows"]):
        lines += ["\\* gossip bytes counted by the transport, plus the exact averages' allreduce "
                  "estimated as ring AllReduce's 2 (n - 1) / n model sizes each.", ""]
    if report.get("codec_cost"):
        if report.get("codec_cost_command"):
            lines += [f"Command: `{report['codec_cost_command']}`", ""]
        lines += [f"Encode / decode of {report['cost_parameters'] / 1e6:.1f}M float32 values, "
                  "and one gossip iteration per node (encode, copies, sum in; no transport), "
                  "one process, best of 3:", "",
                  "| codec | encode ms | decode ms | gossip iteration ms | bytes less than fp32 |",
                  "|---|---|---|---|---|"]
        def ms(seconds):
            return _fmt(None if seconds is None else 1e3 * seconds, ".1f")

        lines += [f"| {c['codec']} | {ms(c['encode_s'])} | {ms(c['decode_s'])} | "
                  f"{ms(c['iteration_s'])} | {c['bytes_vs_fp32']:.1f}x |"
                  for c in report["codec_cost"]]
        lines.append("")
    if report["failures"]:
        lines += ["Failed runs: " + "; ".join(report["failures"]), ""]
    return "\n".join(lines)


def write_markdown(path: Path, text: str) -> None:
    """Replace the text between the result markers, keeping the hand-written analysis."""
    start, end = "<!-- results start -->", "<!-- results end -->"
    old = path.read_text() if path.exists() else f"# Compression\n\n{start}\n{end}\n"
    head, rest = old.split(start, 1)
    path.write_text(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")


def plot(report: dict, folder: Path, logs: list[Path]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cycler import cycler

    from hvd_sgp import plot as sgp_plot

    panels = [o for o in (False, True) if any(r["overlap"] == o for r in report["rows"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, overlap in zip(axes[0], panels):
        # ten colours, then the same dashed: every variant its own line
        ax.set_prop_cycle(cycler(linestyle=["-", "--"]) * cycler(color=plt.cm.tab10.colors))
        for r in (r for r in report["rows"] if r["overlap"] == overlap):
            ax.plot([p[1] for p in r["curve"]], [p[2] for p in r["curve"]], label=r["label"])
        ax.axhline(report["target"], color="grey", lw=0.8)
        ax.set(xlabel="step", ylabel="mean test accuracy (ranks, seeds)", ylim=(0.5, 1.0),
               title=f"digits CNN, n = {report['n']}, "
                     f"{'OSGP tau=2' if overlap else 'synchronous SGP'}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "compression_accuracy.png", dpi=110)
    plt.close(fig)
    sgp_plot.main([str(p) for p in logs] + ["--elastic", "-o",
                                             str(folder / "compression_elastic.png")])


def drive(args) -> dict:
    """Run the variants (one launch each with --separate) and return the report; with
    --separate the report so far is written after every launch, so a run cut short keeps
    what it measured."""
    runs, failures, logs = [], [], []
    keys = args.keys or (list(args.variants) + [f"{name}:osgp2"
                                                for name in args.overlap_variants])
    folder = Path(args.logs)
    folder.mkdir(parents=True, exist_ok=True)
    groups = [(seed, group) for seed in args.seeds
              for group in ([[k] for k in keys] if args.separate else [keys])]
    for seed, group in groups:
        began = time.perf_counter()
        try:
            done = launch(group, args, seed)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            failures.extend(f"{key} (seed {seed})" for key in group)
            print(f"FAILED {group} seed {seed}: {error}", file=sys.stderr, flush=True)
            continue
        for run in done:
            log = folder / f"{run['name']}{'-osgp2' if run['overlap'] else ''}-s{seed}.jsonl"
            log.write_text("".join(json.dumps({**r, "label": run["label"]}) + "\n"
                                   for r in run["metrics"]))
            if seed == args.seeds[0]:
                logs.append(log)
        runs.extend(done)
        print(f"seed {seed}: {', '.join(group)}: {time.perf_counter() - began:.0f} s",
              flush=True)
        if args.separate:
            write_report(report_of(args, runs, failures, logs), args, plots=False)
    return report_of(args, runs, failures, logs)


def report_of(args, runs: list[dict], failures: list[str], logs: list[Path]) -> dict:
    rows = []
    for overlap in (False, True):
        per_run = []
        for seed in args.seeds:
            chosen = [r for r in runs if r["overlap"] == overlap and r["seed"] == seed]
            fp32 = next((r for r in chosen if r["name"] == "fp32"), None)
            reference = (statistics.mean(x["bytes_sent"] for x in fp32["ranks"])
                         / fp32["ranks"][0]["steps"]) if fp32 else None
            per_run += [summarize(r, args.target, reference) for r in chosen]
        names = list(dict.fromkeys(r["name"] for r in per_run))
        rows += [aggregate([r for r in per_run if r["name"] == name]) for name in names]
    seeds = ", ".join(map(str, args.seeds))
    return {"command": " ".join(["python"] + sys.argv), "n": args.n, "target": args.target,
            "seeds": args.seeds,
            "setting": (f"digits CNN ({rows[0]['model_bytes'] / 4 / 1e3:.1f}k parameters) on "
                        f"n = {args.n} ranks, each its own SGP node (one-peer exponential graph)"
                        f", SGD lr {args.lr} momentum 0.9, batch {args.batch} per rank, "
                        f"{args.epochs} epochs, seeds {seeds} (model initialisation and data "
                        "order), localhost (shared memory, 2 cores: wall times are noisy)"
                        if rows else "no run succeeded"),
            "rows": rows, "failures": failures, "logs": [str(p) for p in logs]}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS),
                   default=list(VARIANTS),
                   help="synchronous runs (random-k gossips exact values: nothing is "
                        "dropped, so error feedback does not apply)")
    p.add_argument("--overlap-variants", nargs="*", choices=list(VARIANTS),
                   default=["fp32", "int8", "topk10", "topk10-noef", "topk1", "topk1-noef",
                            "randomk10"])
    p.add_argument("--keys", nargs="*", default=[], metavar="NAME[:osgp2]",
                   help="run these, in this order (instead of the two lists)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="every variant runs once per seed; the tables give means and ranges")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--metrics-every", type=int, default=5)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--codec-cost", action="store_true",
                   help="measure only the codec table (encode, decode, one gossip iteration "
                        "at --cost-parameters), keeping the report's variants")
    p.add_argument("--cost-parameters", type=int, default=25_557_032)
    p.add_argument("--quick", action="store_true", help="2 ranks, 3 variants, 2 epochs")
    p.add_argument("--out", default=str(REPO / "docs" / "compression.json"))
    p.add_argument("--markdown", default=str(REPO / "docs" / "compression.md"))
    p.add_argument("--plots", default=str(REPO / "docs"))
    p.add_argument("--logs", default=str(REPO / "docs" / "compression_metrics"))
    p.add_argument("--separate", action="store_true", help="one mpirun per variant")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runs", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.epochs, args.eval_every, args.seeds = 2, 2, 5, [0]
        args.variants, args.overlap_variants = ["fp32", "topk1", "local4"], ["topk1"]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    if args.codec_cost:  # the codec table only, beside the variants already reported
        out = Path(args.out)
        report = (json.loads(out.read_text()) if out.exists() else
                  {"command": "", "setting": "codec cost only", "rows": [], "failures": []})
        report["codec_cost_command"] = " ".join(["python"] + sys.argv)
    else:
        report = drive(args)
    report["codec_cost"] = codec_cost(args.cost_parameters)
    report["cost_parameters"] = args.cost_parameters
    print(write_report(report, args, plots=not args.codec_cost))
    return 1 if report["failures"] else 0


def write_report(report: dict, args, plots: bool) -> str:
    """JSON, the markdown tables and (``plots``) the figures; returns the markdown."""
    for path in (Path(args.out).parent, Path(args.markdown).parent, Path(args.plots)):
        path.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    text = markdown(report)
    write_markdown(Path(args.markdown), text)
    if plots and report["rows"]:
        plot(report, Path(args.plots), [Path(p) for p in report["logs"]])
    return text


if __name__ == "__main__":
    sys.exit(main())
