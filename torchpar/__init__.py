"""torchpar: a PyTorch-native reference trainer with DP/ZeRO, TP and PP in one loop."""

__version__ = "0.1.0"
