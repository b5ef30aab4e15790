"""The reasoning recipe's wing (GRPO/PPO on a causal LM): `config.py` (its sections), `flow.py` (the driver),
`workers/` (rollout, reward, inference, critic, actor, tool), `tasks/` (prompt data, synthetic tasks, rewards,
tools), `warm_start.py`, `profiler.py` and `evaluation.py`. It stands on the core (runtime, algorithms, engines,
planner, run_dir) and imports nothing of the embodied wing (tests/unit/test_layering.py)."""
