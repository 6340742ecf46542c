"""A small convolutional denoising autoencoder on synthetic images, written as a user writes a
workload (no eval callable: autoscale holds the first batches out for the eval loss).

Smooth random fields (noise blurred by average pooling and upsampled) plus Gaussian noise; the
model maps the noisy image back to the clean one. About 10k parameters, a cosine learning-rate
schedule::

    autoscale run --workload experiments/workloads/denoise.py:make --scenario small-grads --steps 200
"""

import torch
import torch.nn.functional as F


def make(seed: int, device: str):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1, stride=2),
        torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(16, 16, 4, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 1, 3, padding=1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            coarse = torch.randn(16, 1, 6, 6, generator=gen)
            clean = F.interpolate(coarse, size=(24, 24), mode="bilinear", align_corners=False)
            yield clean + 0.3 * torch.randn(clean.shape, generator=gen), clean

    def loss(model, batch):
        noisy, clean = batch
        return F.mse_loss(model(noisy).float(), clean)

    return {
        "model": model,
        "optimizer": optimizer,
        "batches": batches(),
        "loss": loss,
        "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2000),
    }
