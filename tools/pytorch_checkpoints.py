#!/usr/bin/env python3
"""Checkpoints between wgrad and PyTorch, both ways, for a net with a BatchNorm (running
statistics and num_batches_tracked).

Writes tests/fixtures/torch_batchnorm_net.safetensors: PyTorch's state_dict (int64
num_batches_tracked included) of a small conv + BatchNorm2d + linear net after two training
steps, and tests/fixtures/torch_batchnorm_net_probe.safetensors: an input and the net's output
in eval mode. tests/io.rs loads the first into wgrad strictly and checks the output.

With a path (the checkpoint `cargo test --test io` writes to target/wgrad_batchnorm_net.safetensors),
it also loads that wgrad checkpoint into PyTorch with strict=True and prints its eval output.

Needs torch and safetensors (pip install torch safetensors).
"""

import pathlib
import sys

import torch
from safetensors.torch import load_file, save_file

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def net():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 3),
    )


def main():
    torch.manual_seed(5)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(6, 3, 4, 4)
        loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0, 1, 2]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    probe = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        out = model(probe)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, FIXTURES / "torch_batchnorm_net.safetensors")
    save_file({"input": probe, "output": out}, FIXTURES / "torch_batchnorm_net_probe.safetensors")
    print("wrote", ", ".join(f"{k} {v.dtype}" for k, v in state.items()))
    if len(sys.argv) > 1:
        theirs = net()
        theirs.load_state_dict(load_file(sys.argv[1]), strict=True)
        theirs.eval()
        with torch.no_grad():
            print(f"{sys.argv[1]} loaded with strict=True; eval output on the probe:")
            print(theirs(probe))


if __name__ == "__main__":
    main()
