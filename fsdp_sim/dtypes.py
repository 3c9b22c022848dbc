"""Element sizes of the dtypes fsdp-sim speaks (PyTorch names without the `torch.` prefix, short forms)."""

from fsdp_sim.errors import ScenarioError

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "uint8": 1}  # uint8: bitsandbytes' packed 4-bit storage


def itemsize(dtype: str, key: str = "dtype") -> int:
    """Bytes per element of `dtype`; `key` names the scenario field in the error."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ScenarioError(f"{key}: unknown dtype {dtype!r}, expected one of {sorted(DTYPE_BYTES)}") from None
