#!/usr/bin/env python3
"""PyTorch CPU yardsticks for the CNN, GPT, Llama and ResNet examples: the same models, data,
optimizers and schedules, trained in PyTorch, printing the same `final:` lines and the time per
step.

    python3 tools/pytorch_baselines.py cnn [--epochs 2] [--data /usr/share/datasets/fashion-mnist]
    python3 tools/pytorch_baselines.py gpt [--iters 2000] [--data data/shakespeare.txt]
    python3 tools/pytorch_baselines.py llama [--iters 2000] [--data data/shakespeare.txt]
    python3 tools/pytorch_baselines.py resnet [--epochs 2] [--data /usr/share/datasets/fashion-mnist]
    python3 tools/pytorch_baselines.py steps [--device cuda]   # ms per step, batch 64 CNN and batch 12 GPT

Needs torch and numpy (pip install torch numpy); llama also transformers and tokenizers.
Threads: PyTorch's default (all cores).
"""

import argparse
import gzip
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def find(directory, name):
    plain = pathlib.Path(directory) / name
    return plain if plain.exists() else pathlib.Path(f"{plain}.gz")


def cnn_model():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def cnn(args):
    torch.manual_seed(0)
    load = lambda name: read_idx(find(args.data, name))
    x_train = torch.tensor(load("train-images-idx3-ubyte") / 255.0, dtype=torch.float32)[:, None]
    y_train = torch.tensor(load("train-labels-idx1-ubyte"), dtype=torch.long)
    x_test = torch.tensor(load("t10k-images-idx3-ubyte") / 255.0, dtype=torch.float32)[:, None]
    y_test = torch.tensor(load("t10k-labels-idx1-ubyte"), dtype=torch.long)
    model = cnn_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    steps_per_epoch = math.ceil(len(x_train) / 128)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    step, started = 0, time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train))
        total_loss = 0.0
        for i in range(0, len(x_train), 128):
            idx = order[i : i + 128]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total_loss += loss.item() * len(idx)
            step += 1
        model.eval()
        with torch.no_grad():
            acc = sum((model(x_test[i : i + 1000]).argmax(1) == y_test[i : i + 1000]).sum().item()
                      for i in range(0, len(x_test), 1000)) / len(x_test)
        print(f"epoch {epoch}: train_loss={total_loss / len(x_train):.4f} test_acc={acc:.4f}")
    rate = step * 128 / (time.time() - started)
    print(f"final: test_acc={acc:.4f} train_loss={total_loss / len(x_train):.4f} steps={step} samples_per_s={rate:.1f}")


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab, width=128, layers=4, heads=4, block=64):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.token(idx) + self.position(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_optimizer(model, lr):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def gpt(args):
    torch.manual_seed(0)
    text = pathlib.Path(args.data).read_text(encoding="utf-8", errors="replace")
    chars = sorted(set(text))
    ids = torch.tensor(np.searchsorted(np.array(chars), np.array(list(text))), dtype=torch.long)
    split = len(ids) * 9 // 10
    train, val = ids[:split], ids[split:]
    model = Gpt(len(chars))
    opt = gpt_optimizer(model, 1e-3)
    batch = lm_batches(torch.Generator().manual_seed(0))

    def estimate(data):
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                      for x, y in (batch(data) for _ in range(20))]
        model.train()
        return sum(losses) / len(losses)

    started = time.time()
    for step in range(1, args.iters + 1):
        lr = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 1) / args.iters))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == args.iters:
            train_loss, val_loss = estimate(train), estimate(val)
            print(f"step {step}: train_loss={train_loss:.4f} val_loss={val_loss:.4f}")
    rate = args.iters * 12 * 64 / (time.time() - started)
    print(f"final: val_loss={val_loss:.4f} train_loss={train_loss:.4f} steps={args.iters} tokens_per_s={rate:.1f}")


def lm_batches(gen):
    def batch(data):
        starts = torch.randint(0, len(data) - 64, (12,), generator=gen)
        x = torch.stack([data[s : s + 64] for s in starts])
        y = torch.stack([data[s + 1 : s + 65] for s in starts])
        return x, y

    return batch


def llama(args):
    """examples/llama.rs from scratch: a byte-level BPE of 512 tokens trained on the text,
    transformers' Llama with the example's default shape, AdamW and the cosine schedule."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    torch.manual_seed(0)
    text = pathlib.Path(args.data).read_text(encoding="utf-8", errors="replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train([args.data], trainer)
    lines = text.splitlines(keepends=True)
    ids = torch.tensor([i for e in tok.encode_batch(lines) for i in e.ids], dtype=torch.long)
    chars_per_token = len(text) / len(ids)
    split = len(ids) * 9 // 10
    train, val = ids[:split], ids[split:]
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    opt = gpt_optimizer(model, 1e-3)
    batch = lm_batches(torch.Generator().manual_seed(0))
    logits = lambda x: model(input_ids=x).logits

    def estimate(data):
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(logits(x).flatten(0, 1), y.flatten()).item()
                      for x, y in (batch(data) for _ in range(20))]
        model.train()
        return sum(losses) / len(losses)

    started = time.time()
    for step in range(1, args.iters + 1):
        lr = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 1) / args.iters))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train)
        loss = F.cross_entropy(logits(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == args.iters:
            train_loss, val_loss = estimate(train), estimate(val)
            print(f"step {step}: train_loss={train_loss:.4f} val_loss={val_loss:.4f}")
    rate = args.iters * 12 * 64 / (time.time() - started)
    print(f"final: val_loss={val_loss:.4f} train_loss={train_loss:.4f} steps={args.iters} "
          f"tokens_per_s={rate:.1f} val_loss_per_char={val_loss / chars_per_token:.4f}")


def conv_bn(c_in, c_out, kernel, stride):
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.first, self.second = conv_bn(c_in, c_out, 3, stride), conv_bn(c_out, c_out, 3, 1)
        self.downsample = conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else None

    def forward(self, x):
        h = self.second(F.relu(self.first(x)))
        return F.relu(h + (self.downsample(x) if self.downsample else x))


def resnet_model(width=16, classes=10):
    layers, c_in = [conv_bn(1, width, 3, 1), nn.ReLU()], width
    for stage in range(4):
        c_out = width << stage
        layers += [BasicBlock(c_in, c_out, 1 if stage == 0 else 2), BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes))


def resnet(args):
    """examples/resnet.rs: SGD with Nesterov momentum 0.9, lr 0.1 cosine to 0, weight decay 5e-4
    on the kernels, label smoothing 0.1, batch 128."""
    torch.manual_seed(0)
    load = lambda name: read_idx(find(args.data, name))
    x_train = torch.tensor(load("train-images-idx3-ubyte") / 255.0, dtype=torch.float32)[:, None]
    y_train = torch.tensor(load("train-labels-idx1-ubyte"), dtype=torch.long)
    x_test = torch.tensor(load("t10k-images-idx3-ubyte") / 255.0, dtype=torch.float32)[:, None]
    y_test = torch.tensor(load("t10k-labels-idx1-ubyte"), dtype=torch.long)
    model = resnet_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9, nesterov=True)
    steps_per_epoch = math.ceil(len(x_train) / 128)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    step, started = 0, time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train))
        total_loss = 0.0
        for i in range(0, len(x_train), 128):
            idx = order[i : i + 128]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx], label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total_loss += loss.item() * len(idx)
            step += 1
        model.eval()
        with torch.no_grad():
            acc = sum((model(x_test[i : i + 1000]).argmax(1) == y_test[i : i + 1000]).sum().item()
                      for i in range(0, len(x_test), 1000)) / len(x_test)
        print(f"epoch {epoch}: train_loss={total_loss / len(x_train):.4f} test_acc={acc:.4f}")
    rate = step * 128 / (time.time() - started)
    print(f"final: test_acc={acc:.4f} train_loss={total_loss / len(x_train):.4f} steps={step} samples_per_s={rate:.1f}")


def steps(args):
    """Milliseconds per training step of the report's CNN and GPT workloads (examples/bench.rs:
    batch 64 CNN with Adam, batch 12 block 64 GPT with AdamW), on --device (cpu or cuda)."""
    device = torch.device(args.device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def time_steps(model, make_batch, opt, n=20):
        x, y = make_batch()
        for i in range(n + 5):
            if i == 5:
                synchronize()
                started = time.time()
            loss = F.cross_entropy(model(x).flatten(0, -2) if x.dim() == 2 else model(x), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        synchronize()
        return (time.time() - started) / n * 1e3

    torch.manual_seed(0)
    model = cnn_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = lambda: (torch.rand(64, 1, 28, 28, device=device), torch.randint(0, 10, (64,), device=device))
    print(f"cnn step, batch 64 (Adam), {device.type}: {time_steps(model, batch, opt):.2f} ms")
    model = Gpt(65).to(device)
    opt = gpt_optimizer(model, 1e-3)
    batch = lambda: (torch.randint(0, 65, (12, 64), device=device), torch.randint(0, 65, (12, 64), device=device))
    print(f"gpt step, batch 12 block 64 (AdamW), {device.type}: {time_steps(model, batch, opt):.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["cnn", "gpt", "llama", "resnet", "steps"])
    parser.add_argument("--data")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--device", default="cpu", help="steps only: cpu or cuda")
    args = parser.parse_args()
    if args.data is None:
        images = args.what in ("cnn", "resnet")
        args.data = "/usr/share/datasets/fashion-mnist" if images else "data/shakespeare.txt"
    {"cnn": cnn, "gpt": gpt, "llama": llama, "resnet": resnet, "steps": steps}[args.what](args)
