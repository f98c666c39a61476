"""orch: run TRL fine-tuning recipes on multi-node GPU clusters through SkyPilot, or on emulated local nodes."""

__version__ = "0.1.0"
