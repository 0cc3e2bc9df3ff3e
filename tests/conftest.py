"""Loaded before any test module: without CUDA, Triton kernels are tested under Triton's CPU
interpreter, which must be chosen before Triton is first imported (triton.language's own helpers are
built interpreted or compiled at that moment), whichever test module happens to import it first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
