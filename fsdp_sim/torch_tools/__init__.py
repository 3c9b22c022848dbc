"""Torch-side tools for fsdp-sim: a reference model and the FSDPMemTracker referee harness.

Everything in this package needs PyTorch (``pip install fsdp-sim[torch]``); importing the
package itself does not import torch.
"""
