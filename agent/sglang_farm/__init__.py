"""sglang-farm: one SGLang server per GPU, supervised, observable, controllable."""

__version__ = "0.1.0"
