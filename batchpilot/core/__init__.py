"""The core every part shares: knobs and actions, the engine interface and memory model,
admission, telemetry (snapshot and observation), the shield and the controller interface.
Training (``envs/``, ``policies/``) and serving (``serving/``) build on it; it imports none of
them (``tests/test_imports.py`` fails on any import that breaks that order)."""
