"""The Gymnasium side: engines (simulated and live vLLM), workloads, the environment, reward.

Importing this package registers ``batchpilot/Serving-v0``.
"""

from gymnasium.envs.registration import register, registry

ENV_ID = "batchpilot/Serving-v0"

if ENV_ID not in registry:
    # Truncation is the env's own (episode_s / interval_s steps, both configurable), so no
    # max_episode_steps here.
    register(id=ENV_ID, entry_point="batchpilot.envs.serving_env:ServingEnv")
