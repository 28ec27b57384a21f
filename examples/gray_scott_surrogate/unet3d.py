#!/usr/bin/python3
"""The surrogate network of the Gray-Scott pipeline (docs/tutorial.md): a small 3-d U-Net that maps
the state (u, v) of a Gray-Scott run to the state K steps later, exported to ONNX for `tessera train`
and `tessera infer`.

    unet3d.py [--out unet3d.onnx] [--width 8] [--seed 0]

One level of down- and up-sampling: two 3x3x3 convolutions (GroupNorm, GELU) at full resolution, a
2x max pool, two convolutions at half resolution, a 2x transposed convolution back, the skip
connection concatenated, two convolutions, and a 1x1x1 convolution to the two fields, added to the
input (the network learns the change over K steps; its last layer starts at zero, so before
training it forecasts no change). Convolutional throughout, so the exported graph
runs on any grid whose sides are even (the batch and the spatial dims are dynamic axes).
"""
import argparse

import torch
from torch import nn


def block(cin, cout):
    return nn.Sequential(
        nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.GELU(),
        nn.Conv3d(cout, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.GELU())


class UNet3d(nn.Module):
    def __init__(self, channels=2, width=8):
        super().__init__()
        self.encode = block(channels, width)
        self.down = nn.MaxPool3d(2)
        self.middle = block(width, 2 * width)
        self.up = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.decode = block(2 * width, width)
        self.head = nn.Conv3d(width, channels, 1)
        # The head starts at zero, so the untrained network is the persistence forecast (the
        # state K steps later equals the state now) and training improves on that baseline.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        skip = self.encode(x)
        y = self.up(self.middle(self.down(skip)))
        y = self.decode(torch.cat([y, skip], dim=1))
        return x + self.head(y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="unet3d.onnx")
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = UNet3d(width=args.width).eval()
    x = torch.randn(1, 2, 16, 16, 16)
    axes = {0: "n", 2: "x", 3: "y", 4: "z"}
    torch.onnx.export(model, (x,), args.out, opset_version=17, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": axes, "y": axes})
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
