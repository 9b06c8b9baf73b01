"""Bottom I/O layer: validated, zero-copy checkpoint reading and atomic checkpoint writing."""

from modelpatch.checkpoint.checkpoint import Checkpoint
from modelpatch.checkpoint.safetensors_file import SafetensorsFile, TensorInfo
from modelpatch.checkpoint.writer import write_checkpoint

__all__ = ["Checkpoint", "SafetensorsFile", "TensorInfo", "write_checkpoint"]
