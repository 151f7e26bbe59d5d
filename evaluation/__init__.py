"""Evaluation: the simulated policy matrix, live evaluation against real vLLM (with its twin and
the tuned vLLM baselines), calibration and sim-to-real. It sits on top of the other packages:
it may import policies, envs, serving and core, and nothing below imports it."""
