"""Torch-side tools for fsdp-sim: a reference model, the FSDPMemTracker referee harness, the tracer
that turns an ``nn.Module`` into a workload (``trace.py``) and the profiler labels whose times
``fsdp_sim.workload.profile_trace`` reads (``profiling.py``).

Everything in this package needs PyTorch (``pip install -e '.[torch]'`` from a clone); importing the
package itself does not import torch.
"""
