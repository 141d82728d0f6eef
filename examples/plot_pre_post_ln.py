#!/usr/bin/python3
"""Draws the figure of lesson 5 from the CSV files the lesson writes.

    build/test/examples/05_pre_ln_vs_post_ln <dir>      # writes the CSVs
    /usr/bin/python3 examples/plot_pre_post_ln.py <dir> [out.png]

Left: gradient norm of each block's MLP weights at initialization.
Right: held-out loss during training (Adam, lr 1e-2), log scale.
The output defaults to examples/pre_post_ln.png next to this script.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "."
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "pre_post_ln.png")
    grad = read(os.path.join(src, "pre_post_ln_grad.csv"))
    loss = read(os.path.join(src, "pre_post_ln_loss.csv"))

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(grad["block"], grad["pre_ln"], "o-", label="Pre-LN")
    a.plot(grad["block"], grad["post_ln"], "s-", label="Post-LN")
    a.set_xlabel("block (1 = input side)")
    a.set_ylabel("gradient norm of MLP weights")
    a.set_title("At initialization")
    a.set_ylim(bottom=0)
    a.legend()

    b.plot(loss["step"], loss["pre_ln"], label="Pre-LN, no warmup")
    b.plot(loss["step"], loss["post_ln"], label="Post-LN, no warmup")
    b.plot(loss["step"], loss["post_ln_warmup"], "--", label="Post-LN, 100-step warmup")
    b.set_yscale("log")
    b.set_xlabel("training step")
    b.set_ylabel("held-out loss")
    b.set_title("Training with Adam, lr 1e-2")
    b.legend()

    fig.suptitle("12 residual blocks, width 32: LayerNorm before or after the residual add")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main()
