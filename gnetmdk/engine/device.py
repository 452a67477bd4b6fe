"""Which device a run uses and how torch's backends are set for it: gnetmdk.dist.device, re-exported here
for the trainer and the tools. It sits on a low floor so that the chip tools set the backends as
training does without importing the engine."""
from gnetmdk.dist.device import configure_backends, resolve_device, set_tf32, tf32_enabled

__all__ = ["configure_backends", "resolve_device", "set_tf32", "tf32_enabled"]
