"""A Lightning script autoscale never saw, a non-finite batch at step 3: on a GPU
Trainer(precision="16-mixed"); on the CPU, which that refuses, Lightning's own MixedPrecision
plugin (it builds torch.amp.GradScaler itself either way)."""

import hashlib

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins import MixedPrecision


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        print("LOSS", i, repr(loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
xs[3 * 8, 0] = float("inf")  # batch 3
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)
model = Net()
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    max_steps=8,
    plugins=[MixedPrecision("16-mixed", "cpu")],
    enable_checkpointing=False,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, data)
scaler = trainer.precision_plugin.scaler
print("SCALER", type(scaler).__module__, type(scaler).__name__, getattr(scaler, "name", "-"))
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
print("WEIGHTS", digest.hexdigest())
