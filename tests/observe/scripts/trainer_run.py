"""A Hugging Face Trainer script autoscale never saw: TrainingArguments(fp16=True). On a CPU
Accelerate builds no GradScaler for it (its fp16 path needs a GPU); on CUDA it does."""

import hashlib

import torch
from transformers import Trainer, TrainingArguments


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).float(), y)}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
        self.x[3 * 8, 0] = float("inf")

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


torch.manual_seed(0)
model = Net()
cuda = torch.cuda.is_available()
args = TrainingArguments(
    output_dir="out",
    fp16=True,
    use_cpu=not cuda,
    max_steps=8,
    per_device_train_batch_size=8,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=Data())
trainer.train()
scaler = trainer.accelerator.scaler
print("SCALER", type(scaler).__module__, type(scaler).__name__, getattr(scaler, "name", "-"))
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
print("WEIGHTS", digest.hexdigest())
