#!/usr/bin/env python3
"""Prints PyTorch's parameter and buffer names for the structure tests/derive_module.rs
derives (`Net`): nested modules, a ModuleList of blocks, an absent optional module, a
parameter and a buffer of the module's own, a plain attribute. The test's PYTORCH_PARAMETERS
and PYTORCH_BUFFERS are this script's output; with --check it compares them itself.

    pip install torch && python3 tools/pytorch_module_names.py --check
"""
import pathlib
import re
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.dropout = nn.Dropout(0.5)
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1)
        self.blocks = nn.ModuleList([Block(2, 4), Block(4, 4)])
        self.head = nn.Linear(4, 3)
        self.extra = None
        self.scale = nn.Parameter(torch.ones(3))
        self.register_buffer("steps", torch.zeros(1))
        self.width = 4


def main():
    net = Net()
    params = [name for name, _ in net.named_parameters()]
    buffers = [name for name, _ in net.named_buffers()]
    print("parameters:", params)
    print("buffers:", buffers)
    if "--check" in sys.argv:
        test = (pathlib.Path(__file__).parent.parent / "tests" / "derive_module.rs").read_text()

        def listed(const):
            body = re.search(const + r": \[&str; \d+\] = \[(.*?)\];", test, re.S).group(1)
            return re.findall(r'"([^"]+)"', body)

        assert listed("PYTORCH_PARAMETERS") == params, listed("PYTORCH_PARAMETERS")
        assert listed("PYTORCH_BUFFERS") == buffers, listed("PYTORCH_BUFFERS")
        print("done: tests/derive_module.rs lists PyTorch's names")


if __name__ == "__main__":
    main()
