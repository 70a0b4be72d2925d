"""Synthetic local objectives with per-node data, so that SGP can be studied at any n in numpy.

Each node's data differ (non-iid): local steps pull the nodes apart and only mixing brings them
back together, which is what the parameter deviation measures. Gradients are computed for all
nodes at once, on the (n, dim) array of their parameters.
"""
from __future__ import annotations

import numpy as np

from hvd_sgp.common.errors import SgpValueError


class Objective:
    """f(z) = mean_i f_i(z): node i sees only f_i, through stochastic gradients."""

    name = "objective"

    def gradient(self, params: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Row i: a stochastic gradient of f_i at params[i]."""
        raise NotImplementedError

    def loss(self, point: np.ndarray) -> float:
        """The global objective f at one point."""
        raise NotImplementedError


class Quadratic(Objective):
    """f_i(z) = 1/2 sum_j h_ij (z_j - c_ij)^2 plus gradient noise: curvatures and minimisers
    differ per node; the global minimiser, sum_i h_i c_i / sum_i h_i, is known."""

    name = "quadratic"

    def __init__(self, nodes: int, dim: int, seed: int = 0, noise: float = 0.1):
        rng = np.random.default_rng(seed)
        self.curvature = rng.uniform(0.5, 2.0, size=(nodes, dim))
        self.centers = 2.0 + rng.normal(size=(nodes, dim))
        self.noise = noise
        self.optimum = (self.curvature * self.centers).sum(0) / self.curvature.sum(0)

    def gradient(self, params: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        grad = self.curvature * (params - self.centers)
        if self.noise:
            grad += self.noise * rng.standard_normal(grad.shape)
        return grad

    def loss(self, point: np.ndarray) -> float:
        return float(0.5 * (self.curvature * (point - self.centers) ** 2).sum(1).mean())


class Logistic(Objective):
    """L2-regularised logistic regression; node i holds ``samples`` points whose features are
    shifted by a node-specific offset and whose labels follow one planted model. Gradients use
    mini-batches of ``batch`` local samples."""

    name = "logistic"

    def __init__(self, nodes: int, dim: int, seed: int = 0, samples: int = 32, batch: int = 8,
                 reg: float = 1e-3):
        rng = np.random.default_rng(seed)
        truth = rng.normal(size=dim)
        shift = rng.normal(size=(nodes, 1, dim))
        self.features = rng.normal(size=(nodes, samples, dim)) + shift
        chance = _sigmoid(self.features @ truth)
        self.labels = (rng.random(size=(nodes, samples)) < chance).astype(np.float64)
        self.batch = batch
        self.reg = reg

    def gradient(self, params: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        nodes, samples, _ = self.features.shape
        picks = rng.integers(0, samples, size=(nodes, self.batch))
        x = np.take_along_axis(self.features, picks[..., None], axis=1)
        y = np.take_along_axis(self.labels, picks, axis=1)
        residual = _sigmoid(np.einsum("nbd,nd->nb", x, params)) - y
        return np.einsum("nb,nbd->nd", residual, x) / self.batch + self.reg * params

    def loss(self, point: np.ndarray) -> float:
        logits = self.features @ point
        data = np.logaddexp(0.0, logits) - self.labels * logits
        return float(data.mean() + 0.5 * self.reg * point @ point)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


OBJECTIVES: dict[str, type[Objective]] = {"quadratic": Quadratic, "logistic": Logistic}


def make_objective(name: str, nodes: int, dim: int, seed: int = 0) -> Objective:
    if name not in OBJECTIVES:
        raise SgpValueError(f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name](nodes, dim, seed=seed)
