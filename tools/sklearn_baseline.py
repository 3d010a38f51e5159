#!/usr/bin/env python3
"""The yardstick for the training example on MNIST-format data.

Writes scikit-learn's bundled handwritten digits (8x8, 1,797 images; no download) as
MNIST-format IDX files (80% train / 20% test, pixels scaled to 0..255), then trains
scikit-learn's MLPClassifier of the same size as `examples/train.rs` (two hidden ReLU layers,
Adam, same batch size and epochs) on the same files and prints its test accuracy.

    pip install scikit-learn
    python3 tools/sklearn_baseline.py /tmp/digits --hidden 128 --epochs 60 --batch-size 64
    cargo run --release --example train -- --data /tmp/digits --hidden 128 --epochs 60 --batch-size 64
"""
import argparse
import os
import struct

import numpy as np
from sklearn.datasets import load_digits
from sklearn.neural_network import MLPClassifier


def write_idx(path, magic, dims, payload):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic))
        for d in dims:
            f.write(struct.pack(">I", d))
        f.write(payload.astype(np.uint8).tobytes())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    labels = digits.target.astype(np.uint8)
    order = np.random.RandomState(0).permutation(len(labels))
    split = int(0.8 * len(labels))
    os.makedirs(args.out_dir, exist_ok=True)
    for prefix, idx in (("train", order[:split]), ("t10k", order[split:])):
        write_idx(os.path.join(args.out_dir, f"{prefix}-images-idx3-ubyte"), 0x803, (len(idx), 8, 8), images[idx])
        write_idx(os.path.join(args.out_dir, f"{prefix}-labels-idx1-ubyte"), 0x801, (len(idx),), labels[idx])

    x = images.reshape(len(labels), -1).astype(np.float32) / 255.0
    train, test = order[:split], order[split:]
    clf = MLPClassifier(
        hidden_layer_sizes=(args.hidden, args.hidden),
        activation="relu",
        solver="adam",
        learning_rate_init=args.lr,
        batch_size=args.batch_size,
        max_iter=args.epochs,
        alpha=0.0,
        random_state=args.seed,
    )
    clf.fit(x[train], labels[train])
    print(f"wrote {split} train / {len(labels) - split} test images to {args.out_dir}")
    print(f"sklearn MLPClassifier test_acc={clf.score(x[test], labels[test]):.4f}")


if __name__ == "__main__":
    main()
