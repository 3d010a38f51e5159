#!/usr/bin/env python3
"""Writes the PyTorch parity fixtures that tests/parity.rs checks wgrad against.

Builds, in PyTorch on the CPU, a small CNN of the examples/cnn.rs architecture (narrower, on
12x12 images), one pre-norm transformer block of examples/gpt.rs, and the blocks of the models
people bring in 2026: a Llama decoder block (RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention with a padding mask), a ResNet BasicBlock with a stride-2 downsample (behind a
padded max-pool stem, ahead of global pooling and a label-smoothed loss), and a U-Net decoder
block (ConvTranspose2d, GroupNorm, bilinear interpolation of the skip, a convolution), with
seeded weights and a seeded batch; runs forward and backward in float64; and saves the
weights, the batch, the loss and every grad as float32 safetensors in tests/fixtures/. Parameter names are wgrad's
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


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(torch.nn.Module):
    """A Llama decoder layer as transformers writes it (LlamaDecoderLayer), smaller."""

    def __init__(self, dim, heads, kv_heads, hidden, theta=10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, dim // heads, theta
        hd = self.head_dim
        self.input_layernorm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.q_proj = torch.nn.Linear(dim, heads * hd, bias=False)
        self.k_proj = torch.nn.Linear(dim, kv_heads * hd, bias=False)
        self.v_proj = torch.nn.Linear(dim, kv_heads * hd, bias=False)
        self.o_proj = torch.nn.Linear(heads * hd, dim, bias=False)
        self.post_attention_layernorm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.gate_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.up_proj = torch.nn.Linear(dim, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x, keep):
        b, t, _ = x.shape
        hd = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal[None, None] & keep.bool()[:, None, None, :]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        )
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        gated = torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h)
        return x + self.down_proj(gated)


def llama():
    torch.manual_seed(2)
    model = LlamaBlock(16, 4, 2, 24).double()
    with torch.no_grad():
        for norm in (model.input_layernorm, model.post_attention_layernorm):
            norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    # Batch row 1 is padded over its last two tokens.
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    probe = torch.randn(2, 6, 16, dtype=torch.float64)
    loss = (model(x, keep) * probe).sum()
    loss.backward()
    return model, x, {"probe": probe, "keep": keep.double()}, loss


class ResNetBlock(torch.nn.Module):
    """torchvision's BasicBlock with a stride-2 downsample, behind a ResNet stem's padded
    max pool and ahead of its global pooling and classifier."""

    def __init__(self, c_in, c_out, classes):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.downsample = torch.nn.Sequential(
            torch.nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), torch.nn.BatchNorm2d(c_out)
        )
        self.fc = torch.nn.Linear(c_out, classes)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(x, 3, stride=2, padding=1)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = torch.relu(out + self.downsample(x))
        pooled = torch.nn.functional.adaptive_avg_pool2d(out, (1, 1)).flatten(1)
        return self.fc(pooled)


def resnet():
    torch.manual_seed(3)
    model = ResNetBlock(3, 8, 5).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bn" in name or "downsample.1" in name:
                p.add_(0.1 * torch.randn_like(p))
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    x = torch.randn(4, 3, 12, 12, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 4, 1])
    loss = torch.nn.functional.cross_entropy(model(x), labels, label_smoothing=0.1)
    loss.backward()
    return model, x, {"labels": labels.double(), **buffers}, loss


class UNetUp(torch.nn.Module):
    """A U-Net decoder block: transposed convolution up, GroupNorm and SiLU, the skip
    connection resampled bilinearly to match and concatenated, a convolution."""

    def __init__(self, c_in, c_skip, c_out):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(c_in, c_out, 3, stride=2, padding=1, output_padding=1)
        self.norm = torch.nn.GroupNorm(2, c_out)
        self.conv = torch.nn.Conv2d(c_out + c_skip, c_out, 3, padding=1)

    def forward(self, x, skip):
        u = torch.nn.functional.silu(self.norm(self.up(x)))
        s = torch.nn.functional.interpolate(skip, size=u.shape[-2:], mode="bilinear")
        return self.conv(torch.cat([u, s], dim=1))


def unet():
    torch.manual_seed(4)
    model = UNetUp(8, 3, 4).double()
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn_like(model.norm.weight))
        model.norm.bias.add_(0.1 * torch.randn_like(model.norm.bias))
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64, requires_grad=True)
    skip = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    probe = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    loss = (model(x, skip) * probe).sum()
    loss.backward()
    return model, x, {"skip": skip, "probe": probe}, loss


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
    save("parity_llama_block", *llama())
    save("parity_resnet_block", *resnet())
    save("parity_unet_up", *unet())
