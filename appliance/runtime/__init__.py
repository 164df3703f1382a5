"""Runtime providers: where a crew's agents run (Docker pods, or host processes with no isolation).

The contract is in base.py, the errors in errors.py, engine detection in engine.py. Importing
this package does not import the docker SDK; `appliance.runtime.docker` does.
"""

from .base import (
    ContainerRole,
    CrewSpec,
    ExecExited,
    ExecOutput,
    OwnedContainer,
    Pod,
    RuntimeProvider,
)
from .errors import (
    CrewContainerError,
    EngineCallError,
    EngineUnavailable,
    ImageMissing,
    InvalidSpec,
    RuntimeProviderError,
    RuntimeUnavailable,
    UnsafeMount,
)
from .launch import launch_crew

__all__ = [
    "ContainerRole",
    "CrewContainerError",
    "CrewSpec",
    "EngineCallError",
    "EngineUnavailable",
    "ExecExited",
    "ExecOutput",
    "ImageMissing",
    "InvalidSpec",
    "OwnedContainer",
    "Pod",
    "RuntimeProvider",
    "RuntimeProviderError",
    "RuntimeUnavailable",
    "UnsafeMount",
    "launch_crew",
]
