"""Low-communication training: bytes per training sample against fp32 AllReduce, and the cost.

Why: DiLoCo-style training (local steps, an outer optimizer on the pseudo-gradient, 2- and
4-bit codecs, streamed fragments) is meant to cut communication by two orders of magnitude at
equal quality; this measures how far each combination gets on two tasks, on n ranks (each its
own SGP node, one-peer exponential graph), the same data and seeds for every variant:

- ``digits``: the small CNN of compression_benchmark.py on scikit-learn's digits (test
  accuracy);
- ``lm``: a next-token model (embeddings of the last CONTEXT tokens, an MLP) on text drawn
  in-process from a random order-2 Markov source over VOCAB symbols (eval cross-entropy, next
  to the source's entropy rate, the floor no model can beat). Nothing is downloaded.

Bytes are what the transport counted on each rank, per training sample (steps x batch); fp32
AllReduce SGD's reference is ring AllReduce's 2 (n-1)/n model bytes per step (MPI's allreduce
is not the transport's to count), and exact averages of the variants over AllReduce are
counted the same way. Quality: the mean over ranks of each rank's own model, and of the model
after one final exact average (``average_parameters()``, as DiLoCo ends).

    python examples/low_communication_benchmark.py --tasks digits lm --seeds 0 1 2

Writes docs/low_communication.json, the table between the markers of
docs/low_communication.md and docs/low_communication.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VOCAB, CONTEXT, ORDER = 24, 3, 2

# label, HVD_SGP_* variables (the inner optimizer is the task's)
VARIANTS = {
    "allreduce": ("fp32 AllReduce SGD", {"MODE": "allreduce"}),
    "sgp": ("fp32 SGP (gossip every step)", {}),
    "local16-ar": ("Local SGD over AllReduce, H=16", {"MODE": "allreduce", "LOCAL_STEPS": "16"}),
    "int4-h16": ("Local SGD over int4 gossip, H=16", {"LOCAL_STEPS": "16", "COMPRESSION": "int4"}),
    "nest-int4-h16": ("Nesterov 0.1/0.9 over int4 gossip, H=16",
                      {"LOCAL_STEPS": "16", "COMPRESSION": "int4",
                       "OUTER_OPTIMIZER": "nesterov:0.1:0.9"}),
    "int2-h16": ("Local SGD over int2 gossip, H=16", {"LOCAL_STEPS": "16", "COMPRESSION": "int2"}),
    "int4-h16-overlap": ("Local SGD over int4 gossip, H=16, overlapped (tau=2)",
                         {"LOCAL_STEPS": "16", "COMPRESSION": "int4", "OVERLAP": "1",
                          "MAX_DELAY": "2"}),
    "stream4-int4-h16": ("Local SGD over int4 gossip, H=16, 4 streamed fragments",
                         {"LOCAL_STEPS": "16", "COMPRESSION": "int4", "OUTER_FRAGMENTS": "4"}),
    "int4-h32": ("Local SGD over int4 gossip, H=32", {"LOCAL_STEPS": "32", "COMPRESSION": "int4"}),
    "int2-h32": ("Local SGD over int2 gossip, H=32", {"LOCAL_STEPS": "32", "COMPRESSION": "int2"}),
}
KEPT = ("HVD_SGP_LOCAL_SIZE", "HVD_SGP_TIMEOUT")


# --- the tasks -----------------------------------------------------------------------------
def markov_text(length: int, seed: int, source_seed: int = 1234):
    """``length`` tokens from a fixed random order-2 Markov source (each context favours a
    few symbols), and the source's entropy rate in nats (the loss floor)."""
    import numpy as np
    rng = np.random.default_rng(source_seed)
    contexts = VOCAB ** ORDER
    table = rng.dirichlet(np.full(VOCAB, 0.1), size=contexts)  # peaked: a few likely symbols
    draw = np.random.default_rng(seed)
    tokens = np.empty(length, np.int64)
    tokens[:ORDER] = draw.integers(VOCAB, size=ORDER)
    cumulative = table.cumsum(axis=1)
    uniform = draw.random(length)
    visits = np.zeros(contexts)
    for t in range(ORDER, length):
        context = tokens[t - 2] * VOCAB + tokens[t - 1]
        visits[context] += 1
        tokens[t] = min(int(np.searchsorted(cumulative[context], uniform[t])), VOCAB - 1)
    entropy = -(table * np.log(np.maximum(table, 1e-300))).sum(axis=1)
    return tokens, float((visits / visits.sum()) @ entropy)


def lm_data(rank: int, size: int, per_rank: int):
    """Windows of CONTEXT tokens and their next token: this rank's training stream, and one
    evaluation stream common to all ranks."""
    import numpy as np
    import torch

    def windows(tokens):
        index = np.arange(CONTEXT)[None, :] + np.arange(len(tokens) - CONTEXT)[:, None]
        return (torch.from_numpy(tokens[index]), torch.from_numpy(tokens[CONTEXT:]))

    train, _ = markov_text(per_rank + CONTEXT, seed=100 + rank)
    held, floor = markov_text(20_000 + CONTEXT, seed=99)
    return (*windows(train), *windows(held), floor)


def language_model():
    import torch
    nn = torch.nn
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 192),
                         nn.ReLU(), nn.Linear(192, 192), nn.ReLU(), nn.Linear(192, VOCAB))


def task_setup(task: str, rank: int, size: int, args):
    """(model, inner optimizer factory, train x, train y, evaluate(model) -> quality)."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(HERE))
    if task == "digits":
        import bench_model
        from compression_benchmark import cnn
        x, y, x_test, y_test = bench_model.digits_split()
        return (cnn(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), x[rank::size],
                y[rank::size], lambda m: bench_model.accuracy(m, x_test, y_test), None)
    x, y, x_eval, y_eval, floor = lm_data(rank, size, args.lm_tokens)

    def eval_loss(model) -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()
    return (language_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), x, y,
            eval_loss, floor)


# --- the worker: one rank, every variant in turn ---------------------------------------------
def train(task: str, args, hvd) -> dict:
    import torch
    import torch.nn.functional as F

    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    model, inner, x, y, evaluate, floor = task_setup(task, rank, size, args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(inner(model.parameters()),
                                         named_parameters=model.named_parameters())
    batch, epochs = (8, args.digits_epochs) if task == "digits" else (32, args.lm_epochs)
    step, curve = 0, []
    hvd.barrier()
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(
            1000 * args.seed + epoch))
        for i in range(0, len(order) - batch + 1, batch):
            chosen = order[i:i + batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[chosen]), y[chosen]).backward()
            optimizer.step()
            step += 1
        curve.append((step, optimizer.metrics()["bytes_sent"], evaluate(model)))
    optimizer.synchronize_gossip()
    own = evaluate(model)
    sent = optimizer.metrics()["bytes_sent"]
    optimizer.average_parameters()
    return {"rank": rank, "steps": step, "batch": batch, "own": own,
            "averaged": evaluate(model), "bytes_sent": sent, "curve": curve, "floor": floor,
            "seconds": time.perf_counter() - start,
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def worker(args) -> None:
    import torch

    import hvd_sgp.torch as hvd
    sys.path.insert(0, str(HERE))
    import bench_model

    hvd.init()
    torch.set_num_threads(1)
    results = [train(args.task, args, hvd) for _ in bench_model.one_process_runs(
        args.runs, KEPT, lambda key: {f"HVD_SGP_{k}": v for k, v in VARIANTS[key][1].items()})]
    Path(args.out, f"rank{hvd.rank()}.json").write_text(json.dumps(results))


# --- the driver ----------------------------------------------------------------------------
def launch(task: str, keys: list[str], seed: int, args) -> list[dict]:
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1",
                "HVD_SGP_LOCAL_SIZE": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    with tempfile.TemporaryDirectory(prefix="hvd_sgp_lowcomm_") as out:
        cmd = [str(Path(sys.executable).parent / "mpirun"), "-np", str(args.n),
               "--oversubscribe", "--bind-to", "none", sys.executable, str(Path(__file__)),
               "--worker", "--task", task, "--out", out, "--seed", str(seed),
               "--digits-epochs", str(args.digits_epochs), "--lm-epochs", str(args.lm_epochs),
               "--lm-tokens", str(args.lm_tokens), "--runs", *keys]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.launch_timeout, check=False)
        files = sorted(Path(out).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != args.n:
            raise RuntimeError(f"{task} {keys} exited {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        per_rank = [json.loads(f.read_text()) for f in files]
        return [{"task": task, "name": key, "seed": seed, "ranks": [r[k] for r in per_rank]}
                for k, key in enumerate(keys)]


def ring_bytes(name: str, n: int, model_bytes: int) -> float:
    """Bytes per rank and step of the exact averages a variant makes over AllReduce (ring)."""
    chosen = VARIANTS[name][1]
    if chosen.get("MODE") != "allreduce":
        return 0.0
    return 2 * (n - 1) / n * model_bytes / int(chosen.get("LOCAL_STEPS", 1))


def summarize(run: dict, n: int) -> dict:
    ranks = run["ranks"]
    first = ranks[0]
    per_step = (statistics.mean(r["bytes_sent"] for r in ranks) / first["steps"]
                + ring_bytes(run["name"], n, first["model_bytes"]))
    reference = ring_bytes("allreduce", n, first["model_bytes"])
    return {"task": run["task"], "name": run["name"], "seed": run["seed"],
            "own": statistics.mean(r["own"] for r in ranks),
            "averaged": statistics.mean(r["averaged"] for r in ranks),
            "bytes_per_sample": per_step / first["batch"],
            "less_than_allreduce": reference / per_step if per_step else math.inf,
            "seconds": max(r["seconds"] for r in ranks), "floor": first["floor"],
            "model_bytes": first["model_bytes"], "steps": first["steps"], "n": n,
            "curve": [(s, b / first["batch"] / max(s, 1), q) for s, b, q in first["curve"]]}


def steady(run: dict) -> float:
    """Bytes per sample after the first epoch (the curve's cumulative figures): the start-up
    cost (compressed gossip's first, exact, message) left out."""
    (s0, v0, _), (s1, v1, _) = run["curve"][0], run["curve"][-1]
    batch = 8 if run["task"] == "digits" else 32  # (train's)
    if s1 == s0:
        return run["bytes_per_sample"]
    per_step = (v1 * batch * s1 - v0 * batch * s0) / (s1 - s0)
    return per_step / batch + ring_bytes(run["name"], run["n"], run["model_bytes"]) / batch


def table(rows: list[dict], args) -> dict:
    """Per task and variant: means over seeds (with the range), and the gap to the fp32
    AllReduce reference of the same seeds."""
    out = []
    for task in args.tasks:
        ref = {r["seed"]: r for r in rows if r["task"] == task and r["name"] == "allreduce"}
        for name in dict.fromkeys(r["name"] for r in rows if r["task"] == task):
            runs = [{"n": args.n, **r} for r in rows if r["task"] == task and r["name"] == name]
            batch = 8 if task == "digits" else 32
            reference = [ring_bytes("allreduce", args.n, r["model_bytes"]) / batch / steady(r)
                         for r in runs]
            gaps = [100 * (r["averaged"] - ref[r["seed"]]["averaged"]) / (
                1 if task == "digits" else ref[r["seed"]]["averaged"])
                for r in runs if r["seed"] in ref]
            out.append({"task": task, "name": name, "label": VARIANTS[name][0],
                        "seeds": [r["seed"] for r in runs],
                        **{k: statistics.mean(r[k] for r in runs) for k in (
                            "own", "averaged", "bytes_per_sample", "less_than_allreduce",
                            "seconds")},
                        "range": (min(r["averaged"] for r in runs),
                                  max(r["averaged"] for r in runs)),
                        "gap": statistics.mean(gaps) if gaps else None,
                        "steady_less_than_allreduce": statistics.mean(reference),
                        "floor": runs[0]["floor"], "model_bytes": runs[0]["model_bytes"],
                        "steps": runs[0]["steps"]})
    return {"rows": out, "runs": rows}


def markdown(report: dict, args, load: str) -> str:
    lines = [f"Measured by `{report['command']}` on n = {args.n} ranks of one machine (2 cores "
             f"shared with other jobs; load average {load}). Quality: the mean over ranks after "
             "one final exact average (each rank's own model before it in brackets). Bytes: "
             "counted by the transport per rank and training sample; the exact averages over "
             "AllReduce as ring AllReduce's 2 (n-1)/n model bytes.", ""]
    for task in args.tasks:
        rows = [r for r in report["rows"] if r["task"] == task]
        if not rows:
            continue
        unit = "accuracy" if task == "digits" else "eval loss (nats)"
        gap = "points vs AllReduce" if task == "digits" else "% vs AllReduce"
        head = (f"digits CNN ({rows[0]['model_bytes'] / 4e3:.1f}k parameters), SGD lr 0.05 "
                f"momentum 0.9, batch 8, {args.digits_epochs} epochs" if task == "digits" else
                f"Markov-source LM ({rows[0]['model_bytes'] / 4e3:.1f}k parameters, vocab "
                f"{VOCAB}, context {CONTEXT}), SGD lr 0.1 momentum 0.9, batch 32, "
                f"{args.lm_tokens} tokens per rank, {args.lm_epochs} epochs; the source's "
                f"entropy rate (the floor): {rows[0]['floor']:.3f}")
        lines += [f"**{head}**", "",
                  f"| variant | seeds | {unit} (own) | range over seeds | {gap} | bytes/sample | "
                  "fewer bytes than fp32 AllReduce | after the first epoch |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            fmt = ".3f" if task == "digits" else ".4f"
            lines.append(f"| {r['label']} | {', '.join(map(str, r['seeds']))} | "
                         f"{r['averaged']:{fmt}} ({r['own']:{fmt}}) | "
                         f"{r['range'][0]:{fmt}}-{r['range'][1]:{fmt}} | "
                         f"{'' if r['gap'] is None else format(r['gap'], '+.2f')} | "
                         f"{r['bytes_per_sample']:,.0f} | {r['less_than_allreduce']:.1f}x | "
                         f"{r['steady_less_than_allreduce']:.1f}x |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = [t for t in ("digits", "lm") if any(r["task"] == t for r in report["rows"])]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in [r for r in report["rows"] if r["task"] == task]:
            ax.scatter(r["bytes_per_sample"], r["averaged"], label=r["label"])
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("bytes per training sample and rank")
        ax.set_ylabel("test accuracy" if task == "digits" else "eval loss (nats)")
        ax.set_title("digits CNN" if task == "digits" else "Markov-source LM")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tasks", nargs="+", choices=("digits", "lm"), default=["digits", "lm"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--digits-epochs", type=int, default=5)
    p.add_argument("--lm-epochs", type=int, default=3)
    p.add_argument("--lm-tokens", type=int, default=8_000, help="training tokens per rank")
    p.add_argument("--launch-timeout", type=float, default=1800)
    p.add_argument("--out", default=str(REPO / "docs" / "low_communication.json"))
    p.add_argument("--markdown", default=str(REPO / "docs" / "low_communication.md"))
    p.add_argument("--plot", default=str(REPO / "docs" / "low_communication.png"))
    p.add_argument("--load", help="the load label to print (default: the load average now)")
    p.add_argument("--render", action="store_true",
                   help="rebuild the table and plot from --out's runs (no training)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", default="digits", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--runs", nargs="*", default=[], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    variants = ["allreduce"] + [v for v in args.variants if v != "allreduce"]
    runs = []
    if args.render:
        saved = json.loads(Path(args.out).read_text())
        runs, args.seeds = saved["runs"], sorted({r["seed"] for r in saved["runs"]})
        args.tasks = [t for t in args.tasks if any(r["task"] == t for r in runs)]
        report = {"command": saved["command"], **table(runs, args)}
    for seed in [] if args.render else args.seeds:
        for task in args.tasks:
            began = time.perf_counter()
            runs += [summarize(r, args.n) for r in launch(task, variants, seed, args)]
            print(f"{task} seed {seed}: {time.perf_counter() - began:.0f} s", flush=True)
            report = {"command": " ".join(["python"] + sys.argv), **table(runs, args)}
            Path(args.out).write_text(json.dumps(report, indent=1))
    load = args.load or report.get("load") or ", ".join(f"{x:.1f}" for x in os.getloadavg())
    report["load"] = load
    Path(args.out).write_text(json.dumps(report, indent=1))
    text = markdown(report, args, load)
    print(text)
    doc = Path(args.markdown)
    begin, end = "<!-- low-communication table -->", "<!-- end low-communication table -->"
    if doc.exists() and begin in doc.read_text():
        before, rest = doc.read_text().split(begin, 1)
        doc.write_text(before + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
    try:
        plot(report, Path(args.plot))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
