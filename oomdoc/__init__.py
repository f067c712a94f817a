"""oomdoc: the out-of-memory doctor for PyTorch.

Runs a training script under instrumentation, catches the OOM, measures what
filled the device and which fixes help.
"""

__version__ = "0.1.0"
