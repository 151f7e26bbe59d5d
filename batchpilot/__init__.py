"""batchpilot: a reinforcement-learning controller for LLM serving on vLLM.

The code lives in the top-level folders ``envs/``, ``policies/`` and ``serving/``, installed
as ``batchpilot.envs``, ``batchpilot.policies`` and ``batchpilot.serving``.
"""

__version__ = "0.1.0"
