"""Shared setup of the training tests."""

import torch

# The models here are tiny: one intra-op thread is as fast, and avoids OpenMP oversubscription
# (a 50x slowdown) when other processes share the two cores.
torch.set_num_threads(1)
