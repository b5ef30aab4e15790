"""The embodied recipe's wing (PPO/GRPO/SAC on simulators): `config.py` (its sections), `flow.py` (the driver),
`workers/` (env, policy, actor), `envs/` (gymnasium groups, ManiSkill3, Meta-World, experts), `policies.py`,
`bc.py` (behaviour cloning), `sac/` (learner, replay), `plans.py` (the plans this flow can run) and `profiler.py`.
It stands on the core and imports nothing of the reasoning wing (tests/unit/test_layering.py)."""
