"""A convolutional image classifier on synthetic images, written as a user writes a workload.

The images are 3x16x16 noise with a class-dependent pattern (a fixed random template per class,
faint against the noise), so the task is learnable and nothing is downloaded. 10 classes, about
24k parameters. Use it wherever a model goes::

    autoscale run --workload experiments/workloads/cnn.py:make --scenario bad-batches --steps 200
    autoscale search --workload experiments/workloads/cnn.py:make --budget 10m
    PYTHONPATH=experiments/workloads autoscale search --workload cnn:make --budget 10m
"""

import torch
import torch.nn.functional as F

CLASSES = 10


def _images(n: int, templates: torch.Tensor, gen: torch.Generator):
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    noise = torch.randn(n, 3, 16, 16, generator=gen)
    return noise + 0.6 * templates[labels], labels


def make(seed: int, device: str):
    """The workload protocol: model, optimizer, batches, loss, eval."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, CLASSES),
    )
    templates = torch.randn(CLASSES, 3, 16, 16, generator=torch.Generator().manual_seed(1234))
    train_gen = torch.Generator().manual_seed(seed)
    held_x, held_y = _images(256, templates, torch.Generator().manual_seed(99))

    def batches():
        while True:
            yield _images(32, templates, train_gen)

    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    def evaluate(model):
        return F.cross_entropy(model(held_x.to(device)).float(), held_y.to(device))

    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=2e-3),
        "batches": batches(),
        "loss": loss,
        "eval": evaluate,
    }
