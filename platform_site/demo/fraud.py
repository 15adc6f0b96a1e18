"""The demo model: a small tabular fraud classifier trained with torch on generated data.

No model hub is reachable, so the platform makes its own: 32 float features → 256 → 256 → 2
class probabilities, exported to ONNX with a dynamic batch dimension.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import Any

import numpy as np

FEATURE_NAMES = ["amount", "hour", "merchant_risk", "account_age_days"] + [
    f"v{i}" for i in range(1, 29)
]
N_FEATURES = len(FEATURE_NAMES)


def make_dataset(n: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Standardised features and a fraud label from a fixed nonlinear rule plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    w = rng.normal(size=N_FEATURES).astype(np.float32)
    score = x @ w * 0.5 + 1.5 * x[:, 0] * x[:, 2] - 2.0 + 0.8 * np.sin(3 * x[:, 1])
    y = (score + rng.normal(scale=0.5, size=n) > 0).astype(np.int64)
    return x, y


def train_fraud_model(
    epochs: int = 8, n: int = 20_000, seed: int = 7
) -> tuple[bytes, dict[str, Any]]:
    """Train and export; returns (ONNX bytes, offline metrics and lineage)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    x, y = make_dataset(n, seed)
    split = int(n * 0.8)
    xt, yt = torch.from_numpy(x[:split]), torch.from_numpy(y[:split])
    body = nn.Sequential(
        nn.Linear(N_FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)
    )
    optimiser = torch.optim.Adam(body.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        order = torch.randperm(split)
        for start in range(0, split, 256):
            idx = order[start : start + 256]
            optimiser.zero_grad()
            loss_fn(body(xt[idx]), yt[idx]).backward()
            optimiser.step()
    model = nn.Sequential(body, nn.Softmax(dim=1)).eval()
    with torch.no_grad():
        probs = model(torch.from_numpy(x[split:])).numpy()
    accuracy = float((probs.argmax(1) == y[split:]).mean())
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter warns it is legacy; it is exact
        torch.onnx.export(
            model,
            (torch.zeros(1, N_FEATURES),),
            # The TorchScript exporter (dynamo=False) writes to a file object too; torch's
            # annotation names only paths.
            buffer,  # type: ignore[arg-type]
            input_names=["features"],
            output_names=["probabilities"],
            dynamic_axes={"features": {0: "batch"}, "probabilities": {0: "batch"}},
            dynamo=False,
        )
    details = {
        "offline_metrics": {"accuracy": round(accuracy, 4), "positive_rate": float(y.mean())},
        "training_data_hash": hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest(),
    }
    return buffer.getvalue(), details
