"""The safe loader lives with the format plug-ins: :mod:`ckptier.formats.safe_load`.

Re-exported here for callers that import it from ``ckptier.tasks``.
"""

from ckptier.formats.safe_load import *  # noqa: F403
from ckptier.formats.safe_load import (  # noqa: F401
    DEFAULT_ALLOWLIST,
    CheckpointLoadError,
    LoadedCheckpoint,
    UnsafeCheckpoint,
    load_checkpoint_dir,
    load_dcp_tensors,
    load_safetensors,
    read_dcp_metadata,
    safe_torch_load,
    scan_pickle,
)
