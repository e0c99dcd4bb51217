"""Offline tools that build what the engine ships (for example the embedded default model)."""
