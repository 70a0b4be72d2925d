"""SGPStrategy on the digits MLP; run by test_lightning.py on real MPI ranks.
argv: fit|resume DIR MODE (sgp or allreduce)."""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import hvd_sgp.torch as hvd
from hvd_sgp.lightning import SGPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import digits_data  # noqa: E402

phase, directory, mode = sys.argv[1], sys.argv[2], sys.argv[3]
EPOCHS = {"fit": 3, "resume": 5}[phase]
torch.set_num_threads(1)


class Digits(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def on_validation_epoch_end(self):
        self.log("rank_plus_one", float(hvd.rank() + 1), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05 * hvd.size(), momentum=0.9)


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def spread(module) -> float:
    """Largest difference between any rank's parameters and rank 0's."""
    everyone = hvd.allgather(flat(module).reshape(1, -1))
    return (everyone - everyone[0]).abs().max().item()


class Watch(Callback):
    """Records how far the ranks' models are apart during training, and what a resumed run
    starts from."""

    def __init__(self):
        self.spreads, self.start = [], None

    def on_train_start(self, trainer, module):
        sgp = trainer.optimizers[0].sgp_state()
        self.start = (flat(module).clone(), sgp["iteration"], sgp["weights"], trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx % 10 == 0:
            self.spreads.append(spread(module))


def loaders():
    x_train, x_test, y_train, y_test = map(torch.from_numpy, digits_data.split(0.25, seed=0))
    return (DataLoader(TensorDataset(x_train, y_train), batch_size=16, shuffle=True),
            DataLoader(TensorDataset(x_test, y_test), batch_size=64))


hvd.init()
torch.manual_seed(1 + hvd.rank())  # different initialisations: the broadcast makes them one
strategy = SGPStrategy(mode=mode, topology="exponential", metrics_every=10)
watch = Watch()
checkpoints = ModelCheckpoint(dirpath=os.path.join(directory, "ckpt"), save_last=True,
                              every_n_epochs=1)
trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=EPOCHS,
                  logger=CSVLogger(directory, name="logs", version=phase),
                  callbacks=[checkpoints, watch], enable_progress_bar=False,
                  enable_model_summary=False, log_every_n_steps=10)
model = Digits()
train, test = loaders()
last = os.path.join(directory, "ckpt", "last.ckpt")
saved = torch.load(last, weights_only=False) if phase == "resume" else None  # fit rewrites it
trainer.fit(model, train, test, ckpt_path=last if phase == "resume" else None)

rank, size = hvd.rank(), hvd.size()
metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
optimizer = trainer.optimizers[0]
steps_per_epoch = len(trainer.train_dataloader)
everyone_metrics = hvd.allgather_object(metrics)
problems = []
if not metrics["val_acc"] > 0.9:
    problems.append(f"validation accuracy {metrics['val_acc']:.3f}")
if metrics["rank_plus_one"] != size * (size + 1) / 2:
    problems.append(f"sum-reduced metric {metrics['rank_plus_one']}")
if any(m != everyone_metrics[0] for m in everyone_metrics):
    problems.append(f"logged metrics differ across ranks: {everyone_metrics}")
if spread(model) != 0.0:
    problems.append("ranks end with different models (no exact average at the end of fit)")
if steps_per_epoch != -(-len(train.dataset) // size // 16):
    problems.append(f"{steps_per_epoch} steps per epoch: the sampler is not distributed")
if optimizer.sgp_state()["iteration"] != trainer.global_step:
    problems.append(f"SGP iteration {optimizer.sgp_state()['iteration']} != global step "
                    f"{trainer.global_step}")
gossip = mode == "sgp" and os.environ.get("HVD_SGP_LOCAL_SIZE") == "1"
if (optimizer.metrics()["bytes_sent"] > 0) != gossip:  # the transport counts gossip only
    problems.append(f"bytes sent {optimizer.metrics()['bytes_sent']} in mode {mode}")
if not gossip and max(watch.spreads) != 0.0:
    # one node (or AllReduce): gradients are averaged before every step, so the ranks'
    # models never differ; they do where the closure's backward ran after the average
    problems.append(f"ranks drifted apart in training: {max(watch.spreads):.2e}")
if gossip and not max(watch.spreads) > 0.0:
    problems.append("gossip left every rank with the same model at every step")
if phase == "resume":
    start, iteration, weights, step = watch.start
    if step != saved["global_step"] or step != 3 * steps_per_epoch:
        problems.append(f"resumed at global step {step}, checkpoint {saved['global_step']}")
    if iteration != step or weights != [1.0]:
        problems.append(f"resumed SGP state: iteration {iteration}, weights {weights}")
    if not torch.equal(start, torch.cat([v.reshape(-1) for v in saved["state_dict"].values()])):
        problems.append("resumed model differs from the checkpoint's")
    if trainer.global_step != EPOCHS * steps_per_epoch:
        problems.append(f"resumed run ended at step {trainer.global_step}")
if rank == 0:
    csv = open(os.path.join(directory, "logs", phase, "metrics.csv")).readline().split(",")
    wanted = {f"sgp_{name}/rank{r}" for name in ("weight", "bytes_sent", "wait_seconds",
                                                  "deviation") for r in range(size)}
    if not wanted | {"sgp_distance", "train_loss", "val_acc"} <= set(c.strip() for c in csv):
        problems.append(f"logger columns {csv}")
    if not os.path.exists(last):
        problems.append("no last.ckpt")
assert not problems, f"rank {rank}: " + "; ".join(problems)
print(f"rank {rank}: lightning {phase} {mode} passed: val_acc {metrics['val_acc']:.4f}, "
      f"{trainer.global_step} steps, bytes sent {optimizer.metrics()['bytes_sent']}", flush=True)
