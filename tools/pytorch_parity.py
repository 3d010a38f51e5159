#!/usr/bin/env python3
"""Writes the PyTorch parity fixtures that tests/parity.rs checks wgrad against.

Builds, in PyTorch on the CPU, a small CNN of the examples/cnn.rs architecture (narrower, on
12x12 images) and one pre-norm transformer block of examples/gpt.rs, with seeded weights and a
seeded batch; runs forward and backward in float64; and saves the weights, the batch, the
loss and every grad as float32 safetensors in tests/fixtures/. Parameter names are wgrad's
(which are PyTorch's: "0.weight", "attn.in_proj_weight", ...); the batch and the results are
stored as "input", "labels" / "probe", "loss", and "grad.<parameter>" / "grad.input".

Needs torch and safetensors (pip install torch safetensors). Optional: the fixtures it
writes are committed, so `cargo test` checks parity without Python.
"""

import pathlib

import torch
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2, 2),
        torch.nn.Conv2d(4, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2, 2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 3 * 3, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 10),
    ).double()
    x = torch.rand(4, 1, 12, 12, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, 1, 7, 0])
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    return model, x, {"labels": labels.double()}, loss


class Block(torch.nn.Module):
    """wgrad's nn::TransformerBlock: pre-norm, causal multi-head attention, GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x):
        t = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype)
        h = self.ln_1(x)
        attended, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + attended
        return x + self.mlp(self.ln_2(x))


def block():
    torch.manual_seed(1)
    model = Block(16, 4).double()
    # Non-trivial LayerNorm affines and attention biases, so that their grads are checked.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 8, 16, dtype=torch.float64)
    loss = (model(x) * probe).sum()
    loss.backward()
    return model, x, {"probe": probe}, loss


def save(name, model, x, extra, loss):
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    tensors.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    tensors["input"] = x.detach()
    tensors["grad.input"] = x.grad
    tensors["loss"] = loss.detach().reshape(1)
    tensors.update(extra)
    tensors = {k: v.float().contiguous() for k, v in tensors.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT / f"{name}.safetensors")
    print(f"wrote {OUT / name}.safetensors: loss {loss.item():.6f}, {len(tensors)} tensors")


if __name__ == "__main__":
    save("parity_cnn", *cnn())
    save("parity_block", *block())
