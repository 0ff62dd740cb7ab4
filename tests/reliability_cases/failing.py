"""An autograd function whose backward raises: a backward that fails on one rank."""

import torch


class Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("deliberate failure in backward")
